"""The writer under faults it can't fix by retrying: an error in the rollup, a database
that is down (memory and log volume), a second event loop, an event loop that ends
without close()."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import threading
import warnings
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Any

import psutil
import pytest
import uvloop
from sqlalchemy.engine import make_url

from coda_memory import (
    LoadedMemory,
    MemoryService,
    NewObservation,
    ObservationType,
    migrate_async,
)
from coda_memory import service as service_module
from coda_memory.errors import ConnectionLost, ServiceClosed
from coda_memory.ports import AppendOutcome, ObservationRecord
from coda_memory.postgres import store as store_module
from coda_memory.postgres.append import append_observations
from coda_memory.postgres.connection import READ_ONLY_PAUSE
from coda_memory.writer import CLOSE_GRACE
from tests.helpers import FakeClock, tool_ok
from tests.postgres.helpers import backends_once_closed, fetch, locked, until_waiting

#: On both event loops (see tests/conftest.py).
pytestmark = pytest.mark.both_loops

POISON = "poison_tool"


def _closed_port_url() -> str:
    """A Postgres URL on which nothing listens: a database that is down."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"postgresql://nobody@127.0.0.1:{port}/nothing"


async def test_an_error_in_the_rollup_rejects_only_its_row(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A trigger on the rollup's daily tool counts raises for one tool only.
    await fetch(
        pg_url,
        "CREATE FUNCTION coda_memory.poison() RETURNS trigger LANGUAGE plpgsql AS $$ "
        "BEGIN IF NEW.tool_name = 'poison_tool' THEN RAISE EXCEPTION 'poisoned'; END IF; "
        "RETURN NEW; END $$",
    )
    await fetch(
        pg_url,
        "CREATE TRIGGER poison BEFORE INSERT OR UPDATE ON coda_memory.tool_daily "
        "FOR EACH ROW EXECUTE FUNCTION coda_memory.poison()",
    )
    appends = 0
    service = MemoryService.from_url(pg_url, clock=FakeClock(), batch_size=1_000)
    append = service.store.append

    async def counted(
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        nonlocal appends
        appends += 1
        return await append(records, batch_key=batch_key, first_attempt=first_attempt)

    service.store.append = counted  # type: ignore[method-assign]
    try:
        for n in range(300):
            tool = POISON if n == 137 else f"tool_{n % 7}"
            service.emit_observation(f"user-{n % 13}", tool_ok(tool, session=f"s{n}"))
        with caplog.at_level(logging.WARNING, logger="coda_memory"):
            await service.drain(30)
        stats = service.stats()
        assert (stats.stored, stats.rejected, stats.dropped) == (299, 1, 0)
        assert appends == 1  # one batch, never retried
        rows = await fetch(
            pg_url,
            "SELECT count(*), count(*) FILTER (WHERE metadata->>'toolName' = 'poison_tool') "
            "FROM coda_memory.observations",
        )
        assert rows == [(299, 0)]
        calls = await fetch(pg_url, "SELECT sum(successes) FROM coda_memory.tool_daily")
        assert calls == [(299,)]
        assert "poisoned" in caplog.text
        assert "INSERT" not in caplog.text and "user-" not in caplog.text
    finally:
        await service.close()


async def test_a_permanent_error_is_not_retried(pg_url: str) -> None:
    await fetch(pg_url, "ALTER TABLE coda_memory.observations RENAME TO gone")
    service = MemoryService.from_url(pg_url, clock=FakeClock())
    try:
        for n in range(20):
            service.emit_observation("alice", tool_ok("get_account", session=f"s{n}"))
        await service.drain(10)
        stats = service.stats()
        assert (stats.stored, stats.rejected, stats.pending) == (0, 20, 0)
    finally:
        await service.close()


async def test_a_database_not_accepting_connections_keeps_the_batch_for_later(
    empty_pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """While the database refused connections (ALLOW_CONNECTIONS false, as for
    maintenance), every batch was rejected as if its data were bad: lost for good."""
    await migrate_async(empty_pg_url)
    database = make_url(empty_pg_url).database
    admin = make_url(empty_pg_url).set(database="postgres").render_as_string(False)
    await fetch(admin, f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
    service = MemoryService.from_url(empty_pg_url, clock=FakeClock())
    try:
        with caplog.at_level(logging.WARNING, "coda_memory"):
            for n in range(5):
                service.emit_observation("alice", tool_ok("get_account", session=f"s{n}"))
            # The writer tried, and waits to retry.
            async with asyncio.timeout(10):
                while "storing 5 observation(s) failed" not in caplog.text:
                    await asyncio.sleep(0.01)
        assert service.stats().rejected == 0
        await fetch(admin, f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        await service.drain(10)
        stats = service.stats()
        assert (stats.stored, stats.rejected, stats.pending) == (5, 0, 0)
    finally:
        await fetch(admin, f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        await service.close()


async def _read_only(admin: str, database: str | None) -> None:
    """Make ``database`` read-only for new sessions and end its sessions: what a failover
    to a server that only reads does to the connections of a service."""
    await fetch(admin, f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
    await fetch(
        admin,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = :db AND pid <> pg_backend_pid()",
        db=database,
    )


async def test_a_read_only_database_keeps_the_batches_for_later_and_is_left_when_writable(
    empty_pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that only reads (an Aurora writer demoted by a failover, a hot standby,
    default_transaction_read_only) rejected every batch as if its data were bad, and its
    connections stayed read-only in the pools once it was writable again: loads failed
    and observations were lost until the process restarted."""
    await migrate_async(empty_pg_url)
    database = make_url(empty_pg_url).database
    admin = make_url(empty_pg_url).set(database="postgres").render_as_string(False)
    service = MemoryService.from_url(empty_pg_url, clock=FakeClock(), load_timeout=5.0)
    users = ["alice", "bob", "carol", "dave"]

    def counts(loaded: LoadedMemory) -> list[tuple[str, int]]:
        return [(f.subject, f.reinforcement_count) for f in loaded.facts]

    try:
        await service.start()
        for user in users:
            service.emit_observation(user, tool_ok("get_account", session="s0"))
        await service.drain(10)
        for user in users:
            assert len((await service.load_memory(user)).facts) == 1
        for user in ("alice", "bob"):  # stored: their next loads consolidate it
            service.emit_observation(user, tool_ok("get_account", session="s1"))
        await service.drain(10)
        # The service's connections are replaced by read-only ones, as by a failover.
        await _read_only(admin, database)
        # A service starting now is told why it can't (the FastAPI example serves on).
        starting = MemoryService.from_url(empty_pg_url, clock=FakeClock())
        try:
            with pytest.raises(ConnectionLost, match="read-only transaction"):
                await starting.start()
        finally:
            await starting.close()
        # Loads meanwhile: carol's and dave's peek (nothing waits) on read-only connections
        # of their own, which stay in the pool.
        await asyncio.gather(*(service.load_memory(user) for user in ("carol", "dave")))
        with caplog.at_level(logging.WARNING, "coda_memory"):
            for n in range(2, 7):
                service.emit_observation("alice", tool_ok("get_account", session=f"s{n}"))
            async with asyncio.timeout(10):  # the writer tried, and waits to retry
                while "storing 5 observation(s) failed" not in caplog.text:
                    await asyncio.sleep(0.01)
            # The reason the server gave, not "the connection died".
            assert "read-only transaction" in caplog.text
        assert service.stats().rejected == 0
        await fetch(admin, f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
        # Writable again: no connection is reset from outside, the service leaves the
        # read-only ones by itself. A consolidation that meets one fails (its load is
        # answered from the facts at hand) and throws it away, and for READ_ONLY_PAUSE
        # after it consolidations fail at once; then the writable server answers.
        await service.drain(10)
        stats = service.stats()
        assert (stats.stored, stats.rejected, stats.pending) == (11, 0, 0)
        for user, count in (("alice", 7), ("bob", 2)):
            async with asyncio.timeout(10):
                while (loaded := counts(await service.load_memory(user))) == [
                    ("tool_affinity:get_account", 1)
                ]:
                    await asyncio.sleep(0.05)  # polling until the pause is over
            assert loaded == [("tool_affinity:get_account", count)]
    finally:
        await fetch(admin, f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
        await service.close()


async def test_a_read_only_database_is_asked_for_a_connection_once_a_second_not_per_load(
    empty_pg_url: str,
) -> None:
    """Each consolidation that met the read-only server threw its connection away, and
    the next one made another: 182 new connections for 200 loads, loads past their
    timeout for the time it took to connect."""
    await migrate_async(empty_pg_url)
    database = make_url(empty_pg_url).database
    admin = make_url(empty_pg_url).set(database="postgres").render_as_string(False)
    service = MemoryService.from_url(empty_pg_url, clock=FakeClock(), load_timeout=5.0)
    users = [f"user-{n}" for n in range(5)]

    async def sessions() -> int:
        rows = await fetch(
            admin, "SELECT sessions FROM pg_stat_database WHERE datname = :db", db=database
        )
        return int(rows[0][0])

    try:
        for user in users:
            service.emit_observation(user, tool_ok("get_account", session="s0"))
        await service.drain(10)  # stored, not consolidated: every load consolidates
        await _read_only(admin, database)
        before = await sessions()
        started = asyncio.get_running_loop().time()
        for _ in range(4):
            for user in users:
                assert (await service.load_memory(user)).facts == []
        took = asyncio.get_running_loop().time() - started
        assert service.stats().load_errors == 20
        # (The fetches connect to another database.) One for the peeks, and one a second
        # at most for the consolidations.
        assert await sessions() - before <= 2 + int(took / READ_ONLY_PAUSE)
    finally:
        await fetch(admin, f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
        await service.close()


async def test_one_outage_of_a_hundred_loads_logs_a_few_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = MemoryService.from_url(
        _closed_port_url(), clock=FakeClock(), load_timeout=5.0, connect_args={"timeout": 1}
    )
    secret = "alice.secret@example.com"
    try:
        with caplog.at_level(logging.DEBUG, logger="coda_memory"):
            for _ in range(100):
                loaded = await service.load_memory(secret)
                assert loaded.facts == []
            for n in range(50):
                service.emit_observation(secret, tool_ok("get_account", session=f"s{n}"))
            await service.close(timeout=1)
    finally:
        await service.close()
    assert service.stats().load_errors == 100
    lines = [r.getMessage() for r in caplog.records]
    assert 1 <= len(lines) <= 8, lines
    text = "\n".join(lines)
    assert secret not in text and "alice" not in text
    assert "SELECT" not in text and "Traceback" not in caplog.text


async def test_one_outage_shows_identities_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    service = MemoryService.from_url(
        _closed_port_url(),
        clock=FakeClock(),
        load_timeout=5.0,
        log_identities=True,
        connect_args={"timeout": 1},
    )
    try:
        with caplog.at_level(logging.WARNING, logger="coda_memory"):
            await service.load_memory("alice")
    finally:
        await service.close(timeout=1)
    assert "'alice'" in caplog.text


async def test_a_thousand_megabytes_with_the_database_down_stay_within_the_byte_bound() -> None:
    bound = 64 * 1024 * 1024
    service = MemoryService.from_url(
        _closed_port_url(), clock=FakeClock(), connect_args={"timeout": 1}
    )
    process = psutil.Process()
    before = process.memory_info().rss
    try:
        for n in range(1_000):
            content = f"{n:04d}" + "x" * 1_000_000  # a new megabyte each time
            service.emit_observation(
                "alice",
                NewObservation(
                    type=ObservationType.TOOL_SUCCESS,
                    content=content,
                    metadata={"toolName": "get_account"},
                ),
            )
            del content
            if n % 100 == 0:
                await asyncio.sleep(0)  # let the writer run (and fail) meanwhile
        grown = process.memory_info().rss - before
        assert grown <= bound + 64 * 1024 * 1024, grown / 2**20
        stats = service.stats()
        # Queued: no more megabytes than the bound holds; the rest was dropped.
        assert stats.pending <= bound // 1_000_000
        assert stats.dropped == 1_000 - stats.pending
    finally:
        await service.close(timeout=1)


def test_a_service_used_from_a_second_event_loop_fails_at_once() -> None:
    service = MemoryService.from_url("memory://", clock=FakeClock())

    async def first() -> None:
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain(5)

    async def second() -> None:
        with pytest.raises(RuntimeError, match="event loop"):
            await asyncio.wait_for(service.drain(5), 1)
        with pytest.raises(RuntimeError, match="event loop"):
            await asyncio.wait_for(service.consolidate("alice"), 1)

    async def back_on_the_first() -> None:
        await service.close()

    with asyncio.Runner() as runner:  # (the first loop runs on, between its runs)
        runner.run(first())
        asyncio.run(second())
        runner.run(back_on_the_first())
    assert service.stats().stored == 1


def test_a_service_whose_loop_ended_unclosed_says_so_on_the_next_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two asyncio.run() calls with one service: the second failed with an error that
    named no cause ("Event loop is closed", from a connection of the first loop), or with
    one that offered no way out (close() raised the same, for ever). The first loop's end
    closes the service now, storing what was queued, and the next loop is told so."""
    service = MemoryService.from_url("memory://", clock=FakeClock())

    async def first() -> None:
        service.emit_observation("alice", tool_ok("get_account"))
        service.emit_observation("alice", tool_ok("run_sql"))  # queued as the loop ends

    async def second() -> None:
        with pytest.raises(ServiceClosed, match=r"event loop ended without close\(\)"):
            await service.consolidate("alice")
        with caplog.at_level(logging.WARNING, "coda_memory"):
            loaded = await service.load_memory("alice")
        assert loaded.facts == []
        assert "after the service's event loop ended without close()" in caplog.text
        await asyncio.wait_for(service.drain(5), 1)  # (closed: nothing queued)
        await asyncio.wait_for(service.close(), 1)

    with pytest.warns(ResourceWarning, match="was not closed before its event loop ended"):
        asyncio.run(first())
    asyncio.run(second())
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.pending, stats.load_errors) == (2, 2, 0, 1)


@pytest.mark.parametrize(
    "new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_a_service_never_closed_closes_quietly_as_its_loop_ends(
    pg_url: str, caplog: pytest.LogCaptureFixture, new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    """A host that never closed its service (no close(), no async with) lost what was
    queued as its asyncio.run() ended, left its connections to the garbage collector, and
    the interpreter printed, at exit: "Task was destroyed but it is pending!" (the
    writer), SQLAlchemy's "non-checked-in connection", "Event loop is closed". As the
    loop ends, the service now stores what is queued and releases its connections; one
    ResourceWarning says it was not closed (shown under -X dev and by pytest)."""
    database = make_url(pg_url).database
    admin = make_url(pg_url).set(database="postgres").render_as_string(False)

    async def serve() -> None:
        service = MemoryService.from_url(pg_url)  # the host's only reference
        await service.start()
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain(5)
        assert (await service.load_memory("alice")).facts
        assert await service.history("alice")
        for n in range(20):  # queued as the loop ends
            service.emit_observation("alice", tool_ok(f"tool_{n}"))
        served.append(service)

    served: list[MemoryService] = []
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(serve())
        gc.collect()  # (what was left to the collector reports as it is freed)
    assert [str(warning.message) for warning in seen] == [
        "a MemoryService was not closed before its event loop ended; it closed itself then "
        "(call `await memory.close()` at shutdown, or use `async with memory:`)"
    ]
    assert seen[0].category is ResourceWarning
    assert [r.getMessage() for r in caplog.records if not r.name.startswith("coda_memory")] == []
    stats = served[0].stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (21, 21, 0, 0)
    assert asyncio.run(backends_once_closed(admin, database)) == 0


@contextlib.contextmanager
def _silent_database() -> Iterator[tuple[str, threading.Event]]:
    """A Postgres URL whose server, on a loop of its own thread, accepts every connection
    and never answers (a database hung, a firewall's black hole), with an event set once
    a client's first message came: its SSLRequest (the default sslmode, prefer), which
    asyncpg sends once its protocol has started. (Cancelled before that, the opening
    left a future of asyncpg's failed and unread, see ``_opened``.)"""
    accepted = threading.Event()
    started: list[tuple[asyncio.AbstractEventLoop, asyncio.Event, int]] = []
    ready = threading.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            # (The server stopping, or a client gone before its first message.)
            with contextlib.suppress(asyncio.CancelledError, asyncio.IncompleteReadError):
                await reader.readexactly(8)  # the SSLRequest
                accepted.set()
                await reader.read()  # (until the client goes)
        finally:
            writer.close()

    async def serve() -> None:
        stop = asyncio.Event()
        server = await asyncio.start_server(hold, "127.0.0.1", 0)
        started.append((asyncio.get_running_loop(), stop, server.sockets[0].getsockname()[1]))
        ready.set()
        async with server:
            await stop.wait()

    thread = threading.Thread(target=asyncio.run, args=(serve(),))
    thread.start()
    ready.wait(5)
    loop, stop, port = started[0]
    try:
        yield f"postgresql://nobody@127.0.0.1:{port}/nothing", accepted
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(5)


@pytest.mark.parametrize(
    "new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_a_service_closing_itself_while_the_database_never_answers_leaves_nothing_pending(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """A service left open on a database that accepts connections and never answers: as
    its loop ended, it closed itself, but the connection its writer was opening went on
    (its connect timeout not reached), and the loop closed under it: asyncio logged "Task
    was destroyed but it is pending!", and its socket was reported unclosed. The
    self-close now cancels the openings and waits for them."""
    monkeypatch.setattr(service_module, "CLOSE_AT_LOOP_END", 0.2)
    served: list[MemoryService] = []

    async def serve(url: str, accepted: threading.Event) -> None:
        service = MemoryService.from_url(url, connect_timeout=60)
        served.append(service)
        service.emit_observation("alice", tool_ok("get_account"))
        assert await asyncio.to_thread(accepted.wait, 5)  # the writer is opening one

    caplog.set_level(logging.WARNING)
    with _silent_database() as (url, accepted), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(serve(url, accepted))
        gc.collect()  # (a task destroyed while pending is logged as it is freed)
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    assert [str(w.message) for w in seen] == [
        "a MemoryService was not closed before its event loop ended; it closed itself then "
        "(call `await memory.close()` at shutdown, or use `async with memory:`)"
    ]
    stats = served[0].stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (1, 0, 1, 0)


async def test_a_call_whose_opening_the_closed_store_cancels_raises_connection_lost() -> None:
    """The openings cancelled under a call that was not (the store closing as the loop
    ends): the call fails with a connection error, not with the cancellation of a task
    that nobody cancelled."""
    with _silent_database() as (url, accepted):
        store = store_module.PostgresStore.from_url(url, connect_timeout=60)
        try:
            call = asyncio.ensure_future(store.facts("alice"))
            assert await asyncio.to_thread(accepted.wait, 5)
            await store.close()  # (released first, as by the self-close: no retry)
            await store.cancel_openings(5)
            with pytest.raises(ConnectionLost, match="being opened as its store closed"):
                await asyncio.wait_for(call, 5)
            assert not call.cancelled()
        finally:
            await store.close()


@pytest.mark.parametrize(
    "new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_a_service_the_host_dropped_unclosed_lives_until_its_loop_ends(
    caplog: pytest.LogCaptureFixture, new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    """Held by nothing but its own writer, a service that the host dropped was collected
    while its loop ran on, its writer with it: "Task was destroyed but it is pending!",
    and what it had queued was lost. It now lives until close(), or the loop's end."""
    stored: list[MemoryService] = []

    async def serve() -> None:
        service = MemoryService.from_url("memory://", clock=FakeClock())
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain(5)
        service.emit_observation("alice", tool_ok("run_sql"))  # queued
        watched = weakref.ref(service)
        del service
        gc.collect()
        survivor = watched()
        assert survivor is not None
        stored.append(survivor)

    with (
        caplog.at_level(logging.WARNING),
        pytest.warns(ResourceWarning, match="was not closed before its event loop ended"),
        asyncio.Runner(loop_factory=new_loop) as runner,
    ):
        runner.run(serve())
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    stats = stored[0].stats()
    assert (stats.emitted, stats.stored, stats.pending) == (2, 2, 0)


def test_facts_on_a_first_loop_bind_the_service_to_it(pg_url: str) -> None:
    """facts() and history() left the service unbound: on the next loop it used the
    connections of the first, and failed with "Event loop is closed" (its pool logged
    SQLAlchemy's "Exception closing connection" with a traceback)."""
    service = MemoryService.from_url(pg_url)

    async def first() -> None:
        assert await service.facts("alice") == []

    async def second() -> None:
        for call in (service.facts, service.history):
            with pytest.raises(RuntimeError, match="event loop it first ran on"):
                await asyncio.wait_for(call("alice"), 5)

    async def back_on_the_first() -> None:
        assert await service.history("alice") == []
        await service.close()

    with asyncio.Runner() as runner:
        runner.run(first())
        asyncio.run(second())
        runner.run(back_on_the_first())


def test_facts_on_a_loop_that_ended_unclosed_say_so_on_the_next(pg_url: str) -> None:
    """The same with the first loop ended (two asyncio.run() calls): "Event loop is
    closed" from a connection of the ended loop, and a connection it left open."""
    service = MemoryService.from_url(pg_url)
    database = make_url(pg_url).database
    admin = make_url(pg_url).set(database="postgres").render_as_string(False)

    async def first() -> None:
        assert await service.facts("alice") == []

    async def second() -> None:
        with pytest.raises(ServiceClosed, match=r"event loop ended without close\(\)"):
            await service.facts("alice")
        assert await backends_once_closed(admin, database) == 0

    with pytest.warns(ResourceWarning, match="was not closed before its event loop ended"):
        asyncio.run(first())
    asyncio.run(second())


def test_start_and_close_from_a_second_event_loop_say_so_and_leave_the_service_bound(
    pg_url: str,
) -> None:
    """start() on another loop rebound the writer there and failed in the store with
    "Event loop is closed"; close() failed the same way and then counted as done."""
    service = MemoryService.from_url(pg_url)

    async def first() -> None:
        await service.start()
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain(5)

    async def second() -> None:
        # (facts and history failed with "Event loop is closed", or seemed to work)
        calls: list[Callable[[], Awaitable[object]]] = [
            service.start,
            partial(service.facts, "alice"),
            partial(service.history, "alice"),
            partial(service.forget, "alice"),
            service.close,
            service.close,
        ]
        for call in calls:
            with pytest.raises(RuntimeError, match="event loop it first ran on"):
                await asyncio.wait_for(call(), 5)

    async def back_on_the_first() -> None:
        assert [f.category for f in await service.consolidate("alice")] == ["tool_affinity"]
        await service.close()

    with asyncio.Runner() as runner:
        runner.run(first())
        asyncio.run(second())
        runner.run(back_on_the_first())
    assert service.stats().stored == 1


def test_a_load_from_a_second_event_loop_is_empty_and_touches_no_connection(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """It asked the store whether its last answer still held on a connection of the
    first loop (the answers given again), then failed with a RuntimeError."""
    service = MemoryService.from_url(pg_url)
    asked: list[str] = []
    unchanged = service.store.unchanged  # type: ignore[attr-defined]

    async def counted(identity_id: str, version: str) -> bool:
        asked.append(identity_id)
        return bool(await unchanged(identity_id, version))

    service.store.unchanged = counted  # type: ignore[attr-defined]

    async def first() -> None:
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain(5)
        await service.load_memory("alice")  # consolidates: its answer is not kept
        await service.load_memory("alice")  # nothing new: its answer is kept ...
        assert (await service.load_memory("alice")).facts  # ... and given again
        assert asked == ["alice"]

    async def second() -> None:
        with caplog.at_level(logging.WARNING, "coda_memory"):
            loaded = await service.load_memory("alice")
        assert loaded.facts == [] and loaded.prompt_section == ""
        assert asked == ["alice"]  # no store asked from this loop
        assert service.stats().load_errors == 1
        assert "event loop the service does not run on" in caplog.text

    async def back_on_the_first() -> None:
        assert (await service.load_memory("alice")).facts
        await service.close()

    with asyncio.Runner() as runner:
        runner.run(first())
        asyncio.run(second())
        runner.run(back_on_the_first())


def test_drain_after_close_returns_at_once_on_any_loop() -> None:
    """As documented; on another loop than the closed service's it raised RuntimeError."""
    service = MemoryService.from_url("memory://", clock=FakeClock())

    async def first() -> None:
        service.emit_observation("alice", tool_ok("get_account"))
        await service.close()

    async def second() -> None:
        await asyncio.wait_for(service.drain(), 1)

    asyncio.run(first())
    asyncio.run(second())
    assert service.stats().stored == 1


def test_an_observation_emitted_once_the_services_loop_is_closed_is_dropped() -> None:
    """Its writer can never run again: queued, it stayed pending for ever."""
    service = MemoryService.from_url("memory://", clock=FakeClock())

    async def first() -> None:
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain(5)

    async def second() -> None:
        service.emit_observation("alice", tool_ok("run_sql"))

    with pytest.warns(ResourceWarning, match="was not closed"):
        asyncio.run(first())
    asyncio.run(second())
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (2, 1, 1, 0)


def test_what_a_loop_that_ends_before_close_leaves_queued_is_dropped_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An asyncio.run() (a server's loop) that ends without closing the service cancels
    its writer: what it held and what was queued can never be stored, and were neither
    counted nor logged (stats() said pending, on a loop that was gone). The service now
    closes as the loop ends, which tries to store them for CLOSE_AT_LOOP_END, and counts
    and logs what it could not."""
    monkeypatch.setattr(service_module, "CLOSE_AT_LOOP_END", 0.2)
    service = MemoryService.from_url("memory://", clock=FakeClock())
    entered = asyncio.Event()

    async def stuck(records: Any, **_: Any) -> Any:
        entered.set()
        await asyncio.Event().wait()  # a store that does not answer

    monkeypatch.setattr(service.store, "append", stuck)

    async def serve() -> None:
        service.emit_observation("alice", tool_ok("get_account"))
        await entered.wait()  # one batch in flight
        service.emit_observation("alice", tool_ok("run_sql"))
        service.emit_observation("bob", tool_ok("run_sql"))  # and two queued behind it

    with (
        caplog.at_level(logging.WARNING, "coda_memory"),
        pytest.warns(ResourceWarning, match="was not closed"),
    ):
        asyncio.run(serve())
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (3, 0, 3, 0)
    assert "close timed out with 3 observation(s) pending" in caplog.text
    assert "dropped 3 observation(s) (service closed before they were stored)" in caplog.text


def _cancel_every_task() -> set[asyncio.Task[Any]]:
    """A host's sweep at shutdown: every task of the loop but the caller's cancelled; the
    tasks it cancelled."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    for task in others:
        task.cancel()
    return others


def _gated_appends(
    monkeypatch: pytest.MonkeyPatch, service: MemoryService, *, shielded: bool = False
) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold each of ``service``'s appends until ``release`` is set; ``entered`` is set as
    one begins. ``shielded``: a cancellation does not end the wait (an append whose
    COMMIT is on its way ends all the same)."""
    entered, release = asyncio.Event(), asyncio.Event()
    append = service.store.append

    async def gated(records: Any, **options: Any) -> Any:
        entered.set()
        released = release.wait()
        await (asyncio.shield(released) if shielded else released)
        return await append(records, **options)

    monkeypatch.setattr(service.store, "append", gated)
    return entered, release


async def test_a_host_that_cancels_every_task_before_close_loses_nothing_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shutdown recipe: cancel every other task, then close the service. The writer's
    cancellation must not drop the queue, which close() then stores."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    _, release = _gated_appends(monkeypatch, service)
    service.emit_observation("alice", tool_ok("get_account"))
    await asyncio.sleep(0)  # the writer takes the first into an append
    for n in range(4):
        service.emit_observation("alice", tool_ok("run_sql", session=f"s{n}"))
    await asyncio.wait(_cancel_every_task())
    release.set()
    async with asyncio.timeout(5):  # (the cancelled append's batch waited out close's 30 s)
        await service.close()
    stats = service.stats()
    # All five: the batch whose append was cancelled (before it began) goes again.
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (5, 5, 0, 0)


async def test_a_writer_cancelled_twice_counts_its_batch_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelled again while it waited for its cancelled appends (they get a moment to
    end), the writer counted their batch as dropped at once; the append then ended and
    counted it stored too, and the writer's count in flight went below zero, so a
    drain() or close() waited its whole timeout."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    # Its COMMIT is on its way: a cancellation does not end it.
    entered, release = _gated_appends(monkeypatch, service, shielded=True)
    service.emit_observation("alice", tool_ok("get_account"))
    await entered.wait()
    writer = service._writer
    assert writer is not None
    writer.cancel()
    await asyncio.sleep(0)  # the writer cancels its append and waits for it
    writer.cancel()
    await asyncio.sleep(0)
    release.set()
    await asyncio.wait(asyncio.all_tasks() - {asyncio.current_task()})  # its append too
    assert writer.cancelled()
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (1, 1, 0, 0)
    async with asyncio.timeout(5):
        await service.close()


async def test_close_right_after_a_host_cancelled_the_writer_stores_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host that cancels the writer and calls close() before the writer has ended: the
    writer ended as if close() had stopped it (leaving its batch in flight uncounted and
    the queue where no writer took it), so close() waited out its whole timeout."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    entered, release = _gated_appends(monkeypatch, service)
    service.emit_observation("alice", tool_ok("get_account"))
    await entered.wait()  # one batch in flight
    for n in range(4):
        service.emit_observation("alice", tool_ok("run_sql", session=f"s{n}"))
    writer = service._writer
    assert writer is not None
    writer.cancel()  # the host's shutdown, not yet ended ...
    release.set()
    async with asyncio.timeout(5):  # ... when close() begins (its timeout is 30 s)
        await service.close()
    stats = service.stats()
    # All five: the batch in flight ended within the moment its append is given.
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (5, 5, 0, 0)


async def test_a_batch_stored_as_a_host_cancels_every_task_is_counted_stored_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its COMMIT landed, then the host's sweep cancelled the append's own task while the
    acknowledgement was on its way: the writer counted the batch as dropped, though the
    table held it, and the batches validated ahead were dropped too. Now each goes again
    with its key once close() starts the writer again: the store says it has the first,
    and stores the rest once."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    committed, acknowledged = asyncio.Event(), asyncio.Event()
    append = service.store.append
    calls: list[bool] = []

    async def slow_acknowledgement(records: Any, **options: Any) -> Any:
        calls.append(options["first_attempt"])
        outcome = await append(records, **options)
        if len(calls) == 1:
            committed.set()
            await acknowledged.wait()  # the acknowledgement, slow
        return outcome

    monkeypatch.setattr(service.store, "append", slow_acknowledgement)
    service.emit_observation("alice", tool_ok("get_account"))
    await committed.wait()
    for n in range(3):
        service.emit_observation("alice", tool_ok("run_sql", session=f"s{n}"))
    await asyncio.wait(_cancel_every_task())
    acknowledged.set()
    async with asyncio.timeout(5):
        await service.close()
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (4, 4, 0, 0)
    assert calls[:2] == [True, False]  # the first batch again, with its key
    # The store holds each observation once.
    assert len(service.store._identities["alice"].observations) == 4  # type: ignore[attr-defined]


async def test_a_host_cancelling_every_task_twice_leaves_the_writer_pool_its_connection(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's second sweep came as an append gave its connection back: it cancelled
    the task that gives it back before that task began, and asyncio ran none of it. The
    connection stayed checked out until the garbage collector found it, and with a
    writer pool of one, every later append waited for the pool's timeout (30 s)."""
    service = MemoryService.from_url(pg_url, clock=FakeClock(), writer_pool_size=1)
    committed, acknowledged = asyncio.Event(), asyncio.Event()

    async def slow_acknowledgement(conn: Any, *args: Any, **options: Any) -> AppendOutcome:
        outcome = await append_observations(conn, *args, **options)
        committed.set()
        await acknowledged.wait()  # the acknowledgement, slow: the connection still held
        return outcome

    monkeypatch.setattr(store_module, "append_observations", slow_acknowledgement)
    try:
        await service.start()
        service.emit_observation("alice", tool_ok("get_account"))
        await committed.wait()
        _cancel_every_task()
        await asyncio.sleep(0)  # the append, cancelled, gives its connection back ...
        _cancel_every_task()  # ... as the host sweeps again
        await asyncio.wait(asyncio.all_tasks() - {asyncio.current_task()})
        acknowledged.set()
        service.emit_observation("alice", tool_ok("run_sql"))
        async with asyncio.timeout(5):
            await service.drain()
        assert service.store.writer_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        stats = service.stats()
        assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (2, 2, 0, 0)
        rows = await fetch(pg_url, "SELECT count(*) FROM coda_memory.observations")
        assert rows == [(2,)]
    finally:
        await service.close()


async def test_a_batch_whose_append_ends_after_a_new_writer_started_goes_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host's second sweep cancelled the writer's wait for its cancelled append, and
    the writer ended before the append did; an emit started a new writer meanwhile, which
    looked for batches cut short only as it started. The append then ended, its batch
    neither stored nor sent again: pending for ever, and drain() never returned."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    entered, ending = asyncio.Event(), asyncio.Event()
    append = service.store.append

    async def slow_to_end(records: Any, **options: Any) -> Any:
        if not entered.is_set():
            entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                # Its connection given back, a round trip, through every cancellation.
                while not ending.is_set():
                    with contextlib.suppress(asyncio.CancelledError):
                        await ending.wait()
                raise
        return await append(records, **options)

    monkeypatch.setattr(service.store, "append", slow_to_end)

    service.emit_observation("alice", tool_ok("get_account"))
    await entered.wait()
    writer = service._writer
    assert writer is not None
    _cancel_every_task()
    for _ in range(2):  # the writer waits for its append (the wait has begun) ...
        await asyncio.sleep(0)
    _cancel_every_task()  # ... when the host sweeps again
    await asyncio.wait([writer])
    service.emit_observation("alice", tool_ok("run_sql"))  # starts a new writer
    await asyncio.sleep(0)
    ending.set()  # the first append ends, cut short
    async with asyncio.timeout(5):
        await service.drain()
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (2, 2, 0, 0)
    assert len(service.store._identities["alice"].observations) == 2  # type: ignore[attr-defined]
    await service.close()


async def test_a_close_cancelled_while_it_stops_the_writer_still_counts_what_it_held(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A close() left to go on in the background (its caller cancelled) is cancelled too
    when the loop shuts down: cancelled while it waited for the writer, it counted
    nothing, and the writer logged that close() or drain() must follow."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    entered = asyncio.Event()

    async def stuck(records: Any, **_: Any) -> Any:
        entered.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(service.store, "append", stuck)
    service.emit_observation("u1", tool_ok("a"))
    await entered.wait()
    for n in range(3):
        service.emit_observation("u1", tool_ok("b", session=f"s{n}"))
    with caplog.at_level(logging.WARNING, "coda_memory"):
        closing = asyncio.ensure_future(service.close(timeout=0.05))
        await asyncio.wait([closing], timeout=0.2)  # its drain timed out: it stops the writer
        assert service._stopped and not closing.done()
        assert service._closing is not None
        service._closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (4, 0, 4, 0)
    assert "or drain() follows" not in caplog.text


async def test_a_drain_waiting_as_close_gives_up_returns() -> None:
    """close() dropped what it held without waking a drain() that waited for it."""
    service = MemoryService.from_url("memory://", clock=FakeClock())

    async def down(records: Any, **_: Any) -> Any:
        raise ConnectionLost("down")

    service.store.append = down  # type: ignore[method-assign]
    service.emit_observation("u1", tool_ok("a"))
    draining = asyncio.ensure_future(service.drain())
    await asyncio.wait([draining], timeout=0.05)
    await service.close(timeout=0.1)
    async with asyncio.timeout(5):
        await draining
    stats = service.stats()
    assert (stats.emitted, stats.dropped, stats.pending) == (1, 1, 0)


async def test_a_batch_counted_dropped_whose_append_ends_after_all_counts_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close(), cancelled while it waited for the writer, counts what it held as dropped;
    an append given its moment to end then ended and counted its batch as stored too, and
    the count in flight went below zero. It is taken back from the dropped."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    # Its COMMIT is on its way: a cancellation does not end it.
    entered, release = _gated_appends(monkeypatch, service, shielded=True)
    service.emit_observation("u1", tool_ok("a"))
    await entered.wait()
    closing = asyncio.ensure_future(service.close(timeout=0.05))
    await asyncio.wait([closing], timeout=0.2)  # its drain timed out: it stops the writer
    assert service._closing is not None
    service._closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert (service.stats().dropped, service.stats().pending) == (1, 0)
    release.set()
    await asyncio.wait(asyncio.all_tasks() - {asyncio.current_task()})  # the append ends
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (1, 1, 0, 0)
    assert service._inflight == 0


async def test_emits_dropped_while_a_drain_waits_do_not_end_it_early(
    pg_url: str, admin_url: str
) -> None:
    """drain() waited until as many observations were processed as had been emitted when
    it began: those a full queue dropped meanwhile counted toward it, so it returned while
    what it waited for still waited for a held table."""
    service = MemoryService.from_url(pg_url, clock=FakeClock(), queue_size=2)
    await service.start()
    try:
        async with locked(pg_url, "observations"):
            for n in range(2):
                service.emit_observation("alice", tool_ok("get_account", session=f"s{n}"))
            await until_waiting(admin_url, make_url(pg_url).database, 1)  # in an append
            draining = asyncio.ensure_future(service.drain())
            await asyncio.sleep(0)  # the drain begins its wait
            for n in range(4):  # two queued, two dropped (queue full)
                service.emit_observation("bob", tool_ok("run_sql", session=f"s{n}"))
            assert service.stats().dropped == 2
            for _ in range(3):  # turns enough for the drain to see the drops
                await asyncio.sleep(0)
            assert not draining.done()  # alice's two still wait for the table
        async with asyncio.timeout(10):
            await draining
        # As drain() returns: alice's two, which it waited for, are stored.
        store = service.store
        assert isinstance(store, store_module.PostgresStore)
        assert len(await store.observations("alice")) == 2
    finally:
        await service.close()
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (6, 4, 2, 0)


async def test_emits_dropped_while_close_drains_do_not_cut_its_wait_short(
    pg_url: str, admin_url: str
) -> None:
    """close() drops every emit, and counted those of a request still running toward what
    its drain waited for: it stopped waiting as soon as they were as many as the queued
    observations, and dropped those, long before its timeout, while a table was held."""
    service = MemoryService.from_url(pg_url, clock=FakeClock())
    await service.start()
    async with locked(pg_url, "observations"):
        for n in range(3):
            service.emit_observation("alice", tool_ok("get_account", session=f"s{n}"))
        await until_waiting(admin_url, make_url(pg_url).database, 1)  # in an append
        closing = asyncio.ensure_future(service.close(timeout=30))
        for _ in range(2):  # close() begins, then its drain waits
            await asyncio.sleep(0)
        for n in range(3):  # a request still running: dropped, the service is closing
            service.emit_observation("bob", tool_ok("run_sql", session=f"s{n}"))
        # Long enough for close() to give up on an append (CLOSE_GRACE / 2), were it not
        # waiting for it.
        await asyncio.wait([closing], timeout=2 * CLOSE_GRACE)
        assert not closing.done()
    async with asyncio.timeout(10):
        await closing
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (6, 3, 3, 0)
    assert await fetch(pg_url, "SELECT count(*) FROM coda_memory.observations") == [(3,)]


class _FailingClock(FakeClock):
    """A fake clock that raises on its next ``failures`` reads, as a host's clock may
    (a clock of the host's own that reads a server's time, say)."""

    failures = 0

    def __call__(self) -> datetime:
        if self.failures:
            self.failures -= 1
            raise OSError("the host's time source did not answer")
        return super().__call__()


async def test_a_clock_that_raises_as_a_batch_is_validated_loses_none_of_it(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer reads the clock once a batch (for the dates too far ahead): a clock
    that raised there failed the writer, and the batch it held was dropped, counted and
    lost. The batch is now checked against the system clock, with a log line."""
    clock = _FailingClock()
    service = MemoryService.from_url(pg_url, clock=clock)
    try:
        for n in range(5):
            service.emit_observation("alice", tool_ok("get_account", f"s{n}", at=clock.now))
        clock.failures = 1
        with caplog.at_level(logging.WARNING, logger="coda_memory"):
            await service.drain(10)
        assert clock.failures == 0, "the writer read the clock"
        stats = service.stats()
        assert (stats.stored, stats.dropped, stats.rejected, stats.pending) == (5, 0, 0, 0)
        rows = await fetch(pg_url, "SELECT count(*), min(created_at) FROM coda_memory.observations")
        assert rows == [(5, clock.now)]
        assert "the clock raised OSError" in caplog.text
        assert "did not answer" not in caplog.text  # (its message is the host's)
    finally:
        await service.close()


async def test_a_clock_that_raises_as_an_observation_is_emitted_loses_none(pg_url: str) -> None:
    """emit_observation dates an observation that has no created_at by the clock: one
    that raised there made the emit count it as rejected, never queued. It is now dated
    by the system clock."""
    clock = _FailingClock(datetime.now(UTC))  # (a date ahead of it would be clamped)
    service = MemoryService.from_url(pg_url, clock=clock)
    try:
        clock.failures = 1
        before = datetime.now(UTC)
        service.emit_observation("alice", tool_ok("get_account"))
        after = datetime.now(UTC)
        assert clock.failures == 0, "the emit read the clock"
        await service.drain(10)
        stats = service.stats()
        assert (stats.stored, stats.dropped, stats.rejected, stats.pending) == (1, 0, 0, 0)
        rows = await fetch(pg_url, "SELECT created_at FROM coda_memory.observations")
        assert len(rows) == 1 and before <= rows[0][0] <= after
    finally:
        await service.close()
