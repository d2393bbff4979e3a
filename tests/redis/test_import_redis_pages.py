"""import-redis reads an identity larger than a page in pages, each a reply of its own,
as it was at one instant: what the import copies is what one read of the whole identity
gives, and a write that lands between two pages makes it read the identity again."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import NoPermissionError

from coda_memory.core.sanitize import sanitize_observation
from coda_memory.migration import IMPORT_SOCKET_TIMEOUT, import_redis
from coda_memory.postgres import PostgresStore
from coda_memory.postgres.imports import CopyWriter
from coda_memory.redis import RedisStore
from coda_memory.redis import export as export_module
from coda_memory.redis.export import ExportedIdentity, export_identity
from tests.helpers import T0, tool_ok
from tests.redis.test_import_redis import EVENT, fact, ms, now, observation
from tests.redis_fixtures import _own_server

PAGE = 7

#: How many records (JSON values) each reply that a _Recording connection read carried.
_COUNTS: list[int] = []


def _records(reply: Any) -> int:
    if isinstance(reply, bytes):
        return int(reply[:1] in (b"{", b"["))
    if isinstance(reply, list):
        return sum(_records(part) for part in reply)
    return 0


class _Recording(Connection):
    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        reply = await super().read_response(*args, **kwargs)
        _COUNTS.append(_records(reply))
        return reply


async def _seed(client: aioredis.Redis, prefix: str, identity: str) -> None:
    """Of each key of the identity, several pages: 60 of the original server's
    observations (half of them before the checkpoint), 25 coda-memory appended (pending),
    30 facts, 40 fact events and 20 session records."""
    await client.zadd(
        f"{prefix}obs:{identity}",
        {observation(identity, f"o{n}", n / 10, f"tool{n % 9}"): ms(n / 10) for n in range(60)},
    )
    pending = {
        observation(identity, f"p{n}", 2 + n / 10, f"tool{n % 5}"): ms(2 + n / 10)
        for n in range(25)
    }
    await client.zadd(f"{prefix}obs:{identity}", pending)
    await client.zadd(f"{prefix}pending:{identity}", {m: n + 1 for n, m in enumerate(pending)})
    await client.hset(f"{prefix}checkpoint", identity, ms(3))
    await client.hset(
        f"{prefix}facts:{identity}",
        mapping={f"fact:tool_affinity:t{n}": fact(identity, f"t{n}", 0.5, 1) for n in range(30)},
    )
    events = [
        json.dumps({**EVENT, "identityId": identity, "subject": f"tool_affinity:t{n}"})
        for n in range(40)
    ]
    await client.rpush(f"{prefix}history:{identity}", *events)
    await client.hset(
        f"{prefix}sessions:{identity}",
        mapping={
            f"s{n}": json.dumps(
                [{**EVENT, "identityId": identity, "sessionId": f"s{n}", "at": ms(5)}]
            )
            for n in range(20)
        },
    )


def _as_read(exported: ExportedIdentity) -> tuple[Any, ...]:
    return (
        sorted(o.id for o in exported.consumed),
        sorted(o.id for o in exported.pending),
        sorted(exported.consumed + exported.pending, key=lambda o: o.id),
        sorted(exported.facts, key=lambda f: f.subject),
        sorted(exported.events, key=repr),
        exported.checkpoint_at,
        sorted(exported.bad),
        exported.labels,
    )


async def test_an_identity_of_many_pages_is_read_in_bounded_replies_as_one_read_reads_it(
    redis_url: str,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An identity read in one reply (hundreds of thousands of observations) outlived
    redis-py's socket timeout (5 s) at every attempt: no reply carries much more than a
    page, and the import copies what one read of the whole identity gives."""
    await _seed(redis_client, redis_prefix, "ana")
    source = RedisStore.from_url(redis_url, connection_class=_Recording)
    target = PostgresStore.from_url(pg_url)
    try:
        whole = await export_identity(source, "ana")  # in one page of 10,000
        assert (len(whole.consumed), len(whole.pending), len(whole.facts)) == (31, 54, 30)
        assert len(whole.events) == 40 + 20 and whole.bad == []
        monkeypatch.setattr(export_module, "READ_PAGE", PAGE, raising=False)
        _COUNTS.clear()
        paged = await export_identity(source, "ana")
        assert _as_read(paged) == _as_read(whole)
        # The first read's pages of each key (5 of them: 3 of exact size, 2 of a hash),
        # then one page a reply. HSCAN's count is a hint: a page of a hash holds what the
        # buckets it visits hold, which may be more, up to twice while the hash is being
        # rehashed (one read in one reply held the whole identity).
        assert max(_COUNTS) <= 3 * PAGE + 2 * 2 * PAGE and sorted(_COUNTS)[-2] <= 2 * PAGE
        summary = await import_redis(source, target, now=now)
        assert (summary.copied, summary.bad, summary.failed, summary.busy) == (1, [], [], [])
        assert (summary.observations, summary.consumed_observations) == (85, 31)
        assert (summary.facts, summary.fact_events, summary.checkpoints) == (30, 60, 1)
        stored = await target.observations("ana")
        assert sorted(o.metadata["toolName"] for o in stored) == sorted(
            o.metadata["toolName"] for o in whole.consumed + whole.pending
        )
    finally:
        await source.close()
        await target.close()
        _COUNTS.clear()


async def test_the_copy_is_given_the_observations_a_page_at_a_time(
    redis_url: str,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The import held a whole identity in memory, its read's lists and the copy's (an
    identity of 300,000 observations peaked at 552 MiB): the copy is given no more than a
    page of observations at a time, and writes each into its transaction as it comes."""
    await _seed(redis_client, redis_prefix, "ana")
    # Two pending observations that the sorted set no longer holds, given after it.
    lost = [observation("ana", f"l{n}", 4, "lost") for n in range(2)]
    await redis_client.zadd(f"{redis_prefix}pending:ana", {m: 100 + n for n, m in enumerate(lost)})
    monkeypatch.setattr(export_module, "READ_PAGE", PAGE, raising=False)
    given: list[tuple[int, int]] = []
    write = CopyWriter.write

    async def recorded(writer: CopyWriter, consumed: Any, pending: Any) -> None:
        given.append((len(consumed), len(pending)))
        await write(writer, consumed, pending)

    monkeypatch.setattr(CopyWriter, "write", recorded)
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        summary = await import_redis(source, target, now=now)
        assert (summary.copied, summary.bad, summary.failed, summary.busy) == (1, [], [], [])
        assert (summary.observations, summary.consumed_observations) == (87, 31)
        assert max(c + p for c, p in given) <= PAGE
        assert sum(c for c, _ in given) == 31 and sum(p for _, p in given) == 56
        assert len(await target.observations("ana")) == 87
    finally:
        await source.close()
        await target.close()


#: The socket timeout of the connection each reply was read on.
_TIMEOUTS: list[float | None] = []


class _Timed(Connection):
    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        _TIMEOUTS.append(self.socket_timeout)
        return await super().read_response(*args, **kwargs)


async def test_only_the_whole_read_waits_long_for_its_replies(
    redis_url: str, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    """The import waited 300 s for any reply, a page's too, for the sake of the whole
    read's (a reply per key, seconds long): a page's reply is waited for as the import's
    socket timeout says (30 s), the whole read's for WHOLE_READ_TIMEOUT, on a connection
    of its own."""
    await _seed(redis_client, redis_prefix, "ana")
    source = RedisStore.from_url(
        redis_url, connection_class=_Timed, socket_timeout=IMPORT_SOCKET_TIMEOUT
    )
    try:
        _TIMEOUTS.clear()
        paged = await export_identity(source, "ana")
        assert _TIMEOUTS and set(_TIMEOUTS) == {IMPORT_SOCKET_TIMEOUT} == {30.0}
        _TIMEOUTS.clear()
        whole = ExportedIdentity("ana")
        await export_module._read_whole(source, "ana", export_module._Collected(whole))
        assert _TIMEOUTS and set(_TIMEOUTS) == {export_module.WHOLE_READ_TIMEOUT} == {300.0}
        assert sorted(o.id for o in whole.consumed + whole.pending) == sorted(
            o.id for o in paged.consumed + paged.pending
        )
        # The store's own connections still wait 30 s.
        _TIMEOUTS.clear()
        await export_identity(source, "ana")
        assert set(_TIMEOUTS) == {IMPORT_SOCKET_TIMEOUT}
    finally:
        await source.close()
        _TIMEOUTS.clear()


def _write_after_each_read_of(
    monkeypatch: pytest.MonkeyPatch, key: str, write: Callable[[], Awaitable[Any]]
) -> list[int]:
    """``write()`` awaited after each paged read of the sorted set ``key`` (before the
    closing EXEC); the sizes of those reads."""
    read = export_module._zset_pages
    sizes: list[int] = []

    async def then_write(pipe: Any, name: str) -> AsyncIterator[tuple[int, list[Any]]]:
        size = 0
        async for start, page in read(pipe, name):
            size += len(page)
            yield start, page
        if name == key:
            sizes.append(size)
            await write()

    monkeypatch.setattr(export_module, "_zset_pages", then_write)
    return sizes


@pytest.mark.parametrize("write", ["append", "checkpoint"])
async def test_a_write_between_the_pages_reads_the_identity_again(
    redis_url: str,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
    write: str,
) -> None:
    """An append (or a consolidation's new checkpoint) that lands between the pages is
    not half read: the read starts again, and the import copies the identity as it is
    after it, each observation once."""
    await _seed(redis_client, redis_prefix, "ana")
    monkeypatch.setattr(export_module, "READ_PAGE", PAGE, raising=False)
    source = RedisStore.from_url(redis_url)
    writer = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)

    async def once() -> None:
        if len(sizes) > 1:
            return
        if write == "append":
            late = sanitize_observation("ana", tool_ok("late", "late"), T0)
            await writer.append([late])
        else:
            await redis_client.hset(f"{redis_prefix}checkpoint", "ana", ms(4))

    sizes = _write_after_each_read_of(monkeypatch, f"{redis_prefix}obs:ana", once)
    try:
        summary = await import_redis(source, target, now=now)
        # Read twice: the first read saw 85 observations, the second all there were.
        assert sizes == [85, 86 if write == "append" else 85]
        assert (summary.copied, summary.bad, summary.failed, summary.busy) == (1, [], [], [])
        if write == "append":
            assert (summary.observations, summary.consumed_observations) == (86, 31)
            stored = await target.observations("ana")
            assert [o.metadata["toolName"] for o in stored].count("late") == 1
        else:  # the observations dated up to the new checkpoint, and not pending
            assert (summary.observations, summary.consumed_observations) == (85, 41)
    finally:
        await source.close()
        await writer.close()
        await target.close()


async def test_an_identity_written_between_every_page_is_read_whole_once_and_copied_once(
    _redis_server: str,
    redis_url: str,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Live traffic that writes the identity between every two pages of its paged reads
    (a migration under load): after READ_ATTEMPTS reads it was left busy, at every run
    while the traffic lasted. It is then read whole in one MULTI/EXEC, and copied as that
    read found it, each observation once; the next run copies nothing again."""
    await _seed(redis_client, redis_prefix, "ana")
    await redis_client.zadd(f"{redis_prefix}obs:bob", {observation("bob", "b1", 1, "x"): ms(1)})
    monkeypatch.setattr(export_module, "READ_PAGE", PAGE, raising=False)
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    live = redis.Redis.from_url(_redis_server)
    obs_key = f"{redis_prefix}obs:ana"
    written: list[str] = []
    next_page = export_module._next_page

    def write_then_next_page(count: int, read: list[bytes]) -> int:
        # Between two pages of a key (a synchronous client: the write has landed when
        # the next page is asked for), an observation of the original server's.
        tool = f"w{len(written)}"
        live.zadd(obs_key, {observation("ana", tool, 8, tool): ms(8) + len(written)})
        written.append(tool)
        return next_page(count, read)

    wholes: list[str] = []
    read_whole = getattr(export_module, "_read_whole", None)

    async def counted_read_whole(store: RedisStore, identity_id: str, sink: Any) -> Any:
        assert read_whole is not None
        wholes.append(identity_id)
        return await read_whole(store, identity_id, sink)

    monkeypatch.setattr(export_module, "_next_page", write_then_next_page)
    monkeypatch.setattr(export_module, "_read_whole", counted_read_whole, raising=False)
    try:
        summary = await import_redis(source, target, now=now)
        assert (summary.copied, summary.busy, summary.failed, summary.bad) == (2, [], [], [])
        assert wholes == ["ana"]
        # Written between pages during each of the 5 paged reads (export.READ_ATTEMPTS),
        # and not after: the whole read saw every one of them.
        assert len(written) >= 5 and await redis_client.zcard(obs_key) == 85 + len(written)
        assert summary.observations == 85 + 1 + len(written)
        stored = [o.metadata["toolName"] for o in await target.observations("ana")]
        assert len(stored) == 85 + len(written)
        assert sorted(tool for tool in stored if tool.startswith("w")) == sorted(written)
        # Exactly once: the ledger holds it, and a second run copies nothing.
        again = await import_redis(source, target, now=now)
        assert (again.copied, again.skipped, again.busy) == (0, 2, [])
        assert len(await target.observations("ana")) == 85 + len(written)
    finally:
        live.close()
        await source.close()
        await target.close()


async def test_a_user_that_may_not_watch_stops_the_run_naming_the_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An identity larger than a page is read under WATCH, which an ACL user for the
    import now needs too: one without it stops the run on the server's refusal, naming
    the command (not every identity left out as "of the wrong type"), and one with it
    reads the identity."""
    monkeypatch.setattr(export_module, "READ_PAGE", PAGE, raising=False)
    with contextlib.contextmanager(_own_server)() as server:
        admin = aioredis.Redis.from_url(server)
        try:
            commands = ["+@read", "+@connection", "+scan", "+multi", "+exec"]
            await admin.acl_setuser(
                "reader", enabled=True, passwords=["+r3ader"], keys=["*"], commands=commands
            )
            await _seed(admin, "coda:memory:", "ana")
            url = server.replace("redis://", "redis://reader:r3ader@", 1)
            source = RedisStore.from_url(url)
            try:
                with pytest.raises(NoPermissionError, match="'watch' command"):
                    await import_redis(source, None, now=now)
                await admin.acl_setuser("reader", commands=["+watch"])
                summary = await import_redis(source, None, now=now)
                assert (summary.copied, summary.observations, summary.bad) == (1, 85, [])
            finally:
                await source.close()
        finally:
            await admin.aclose()
