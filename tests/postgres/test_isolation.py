"""Isolation on a real server: statement timeouts on the request path, separate request
and writer pools of the configured sizes, and ``start()`` opening and preparing them (and
rehearsing the hot path on the request connections)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
import sqlalchemy.exc
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from coda_memory import Fact, MemoryService
from coda_memory import service as service_module
from coda_memory.errors import StoreBusy
from coda_memory.postgres import PostgresStore
from coda_memory.postgres.append import prepared_statements
from coda_memory.postgres.connection import MAX_TIMEOUT, sqlstate
from coda_memory.postgres.engine import driver_connection
from coda_memory.postgres.unit import Statements
from tests.helpers import tool_ok
from tests.postgres.helpers import (
    NOW,
    backends,
    backends_once_closed,
    consolidate,
    engine,
    fact,
    fetch,
    locked,
    prepared_plans,
    record,
    table_digests,
    until_waiting,
    waiting_for_a_lock,
)

#: On both event loops (see tests/conftest.py).
pytestmark = pytest.mark.both_loops

#: Generous: the statements must fail within their timeout, not within this.
SLACK = 2.0
#: A batch's key, for the appends that give one.
KEY = str(uuid.uuid4())


@pytest.mark.parametrize(
    # rollup_owed: the retention prune reads it; a lock on it held the write statement
    # for the statement timeout.
    "table",
    ["checkpoints", "facts", "observations", "fact_events", "rollup_owed"],
)
async def test_a_held_table_keeps_peek_and_consolidation_waiting_at_most_the_table_lock_timeout(
    pg_url: str, table: str
) -> None:
    timeout = 0.2
    # The statement timeout is far longer: only the table lock timeout ends the waits.
    store = PostgresStore.from_url(
        pg_url,
        statement_timeout=timedelta(seconds=30),
        table_lock_timeout=timedelta(seconds=timeout),
    )
    try:
        await store.append([record("observed")])
        async with locked(pg_url, table):
            started = time.monotonic()
            if table == "facts":
                # Neither the peek nor the facts alone can be read: both wait, then fail.
                with pytest.raises(asyncpg.LockNotAvailableError):
                    await asyncio.wait_for(store.peek("alice"), 2 * timeout + SLACK)
                assert 2 * timeout <= time.monotonic() - started < 2 * timeout + SLACK
            elif table in ("fact_events", "rollup_owed"):  # the peek does not read them
                assert await store.peek("alice") == ([], True)
            else:
                # The facts alone (none yet), and nothing said to wait.
                assert await asyncio.wait_for(store.peek("alice"), timeout + SLACK) == ([], False)
                assert timeout <= time.monotonic() - started < timeout + SLACK
            started = time.monotonic()
            with pytest.raises(asyncpg.LockNotAvailableError):
                await asyncio.wait_for(consolidate(store), timeout + SLACK)
            assert timeout <= time.monotonic() - started < timeout + SLACK
        # Released: both work again on the same pool.
        assert (await store.peek("alice"))[1] is True
        await consolidate(store)
    finally:
        await store.close()


async def test_a_locked_table_fails_an_append_within_the_writer_lock_timeout(
    pg_url: str,
) -> None:
    store = PostgresStore.from_url(pg_url, writer_lock_timeout=timedelta(milliseconds=200))
    try:
        # A lock on a rollup table or on one table of keys does not stop an append (see
        # test_rollup_owed and test_batch_keys); one on the observations does.
        async with locked(pg_url, "observations"):
            started = time.monotonic()
            with pytest.raises(StoreBusy) as raised:
                await asyncio.wait_for(store.append([record("observed")]), 0.2 + SLACK)
            assert sqlstate(raised.value) == "55P03"  # lock_not_available
            assert time.monotonic() - started < 0.2 + SLACK
        assert (await store.append([record("observed")])).stored == 1
    finally:
        await store.close()


async def test_an_append_that_finds_no_writer_connection_free_is_busy_not_refused(
    pg_url: str,
) -> None:
    # The writer pool's only connection stays in use past the pool's timeout: the append
    # reached no server, and says so as a write kept out for now (the writer retries it).
    store = PostgresStore.from_url(pg_url, writer_pool_size=1, pool_timeout=0.2)
    try:
        held = await store.writer_engine.connect()
        try:
            with pytest.raises(StoreBusy) as raised:
                await store.append([record("observed")], batch_key=KEY, first_attempt=True)
            assert not raised.value.may_have_stored
        finally:
            await held.close()
        assert (await store.append([record("observed")], batch_key=KEY)).stored == 1
        rows = await fetch(pg_url, "SELECT count(*) FROM coda_memory.observations")
        assert rows[0][0] == 1
    finally:
        await store.close()


async def test_observations_waiting_for_a_writer_connection_are_stored_not_rejected(
    pg_url: str,
) -> None:
    store = PostgresStore.from_url(pg_url, writer_pool_size=1, pool_timeout=0.2)
    service = MemoryService(store, clock=lambda: NOW)
    warned = asyncio.Event()

    class Warned(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.set()

    handler = Warned(logging.WARNING)
    logging.getLogger("coda_memory").addHandler(handler)
    try:
        held = await store.writer_engine.connect()
        try:
            service.emit_observation("alice", tool_ok("get_account", "s1"))
            # The writer's first word on the batch: retrying it, or (before) rejecting it.
            await asyncio.wait_for(warned.wait(), 10)
        finally:
            await held.close()
        await asyncio.wait_for(service.drain(), 10)
        stats = service.stats()
        assert (stats.stored, stats.rejected, stats.dropped) == (1, 0, 0)
    finally:
        logging.getLogger("coda_memory").removeHandler(handler)
        await service.close()


async def test_observations_held_back_by_a_lock_are_stored_after_it_not_rejected(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Each attempt waits the writer's lock timeout and fails; the writer tries again
    # until the lock goes, and then stores everything, once.
    store = PostgresStore.from_url(pg_url, writer_lock_timeout=timedelta(milliseconds=100))
    service = MemoryService(store, clock=lambda: NOW)
    try:
        async with locked(pg_url, "observations"):
            for n in range(5):
                service.emit_observation("alice", tool_ok("get_account", f"s{n}"))
            async with asyncio.timeout(10):
                while sum("retrying" in r.getMessage() for r in caplog.records) < 2:
                    await asyncio.sleep(0.01)
            assert service.stats().stored == 0
        await asyncio.wait_for(service.drain(), 10)
        stats = service.stats()
        assert (stats.stored, stats.rejected, stats.dropped) == (5, 0, 0)
        rows = await fetch(pg_url, "SELECT count(*) FROM coda_memory.observations")
        assert rows[0][0] == 5
    finally:
        await service.close()


async def test_a_blocked_writer_does_not_block_loads(pg_url: str, admin_url: str) -> None:
    store = PostgresStore.from_url(pg_url, writer_lock_timeout=None, writer_pool_size=1)
    service = MemoryService(store, load_timeout=5.0, clock=lambda: NOW)
    try:
        await store.append([record("observed")])
        async with locked(pg_url, "ingest_batches"), locked(pg_url, "ingest_batches_spill"):
            # Every writer connection waits for the tables of idempotency keys.
            appending = asyncio.create_task(store.append([record("stuck")]))
            await until_waiting(admin_url, store.engine.url.database, 1)
            loaded = await asyncio.wait_for(service.load_memory("alice"), SLACK)
            assert [f.subject for f in loaded.facts] == ["tool_affinity:get_account"]
            assert service.stats().load_timeouts == service.stats().load_errors == 0
            assert not appending.done()
        assert (await appending).stored == 1
    finally:
        await service.close()


async def test_blocked_consolidations_do_not_block_the_writer(pg_url: str, admin_url: str) -> None:
    store = PostgresStore.from_url(
        pg_url, pool_size=2, statement_timeout=None, table_lock_timeout=None
    )
    try:
        async with locked(pg_url, "checkpoints"):
            # Every request connection waits for the checkpoint table.
            runs = [asyncio.create_task(consolidate(store, identity_id=i)) for i in "ab"]
            await until_waiting(admin_url, store.engine.url.database, 2)
            outcome = await asyncio.wait_for(store.append([record("observed")]), 10)
            assert outcome.stored == 1
            assert not any(run.done() for run in runs)
        await asyncio.gather(*runs)
    finally:
        await store.close()


async def test_the_pools_have_the_sizes_configured_and_no_overflow(pg_url: str) -> None:
    store = PostgresStore.from_url(pg_url, pool_size=3, writer_pool_size=1, pool_timeout=0.2)
    try:
        assert store.request_slots == 3
        held: list[AsyncConnection] = []
        for _ in range(3):
            held.append(await store.request_engine.connect())
        with pytest.raises(sqlalchemy.exc.TimeoutError):
            await store.request_engine.connect()
        # The writer's pool is its own: appends go on while every request connection is out.
        assert (await store.append([record("observed")])).stored == 1
        for conn in held:
            await conn.close()
        writer = await store.writer_engine.connect()
        with pytest.raises(sqlalchemy.exc.TimeoutError):
            await store.writer_engine.connect()
        await writer.close()
    finally:
        await store.close()


async def test_the_service_runs_no_more_consolidations_than_request_connections(
    pg_url: str, admin_url: str
) -> None:
    store = PostgresStore.from_url(
        pg_url, pool_size=2, statement_timeout=None, table_lock_timeout=None
    )
    service = MemoryService(store, load_timeout=0.05)
    try:
        assert store.request_slots == 2
        async with locked(pg_url, "checkpoints"):
            loads = [await service.load_memory(f"user-{i}") for i in range(6)]
            assert all(not loaded.facts for loaded in loads)
            await until_waiting(admin_url, store.engine.url.database, 2)
            # Six consolidations wanted; two hold connections, four wait in the loop.
            assert await waiting_for_a_lock(admin_url, store.engine.url.database) == 2
            assert await backends(admin_url, store.engine.url.database) == 3  # + the locker
        await service.drain()
    finally:
        await service.close()


async def test_start_opens_the_pools_and_prepares_the_statements(
    pg_url: str, admin_url: str
) -> None:
    store = PostgresStore.from_url(pg_url, pool_size=3, writer_pool_size=2)
    service = MemoryService(store)
    try:
        database = store.engine.url.database
        assert await backends(admin_url, database) == 0
        await service.start()
        assert await backends(admin_url, database) == 5
        # Every request connection (all of them out at once: no overflow, so these are the
        # ones start() opened) already has the hot-path statements prepared.
        held = [await store.request_engine.connect() for _ in range(3)]
        for conn in held:
            driver = await driver_connection(conn)
            prepared = await driver.fetchval("SELECT count(*) FROM pg_prepared_statements")
            assert prepared >= 8
            await conn.close()
        # And every writer connection an append's insert and rollup statements.
        writers = [await store.writer_engine.connect() for _ in range(2)]
        for conn in writers:
            driver = await driver_connection(conn)
            assert set(prepared_statements(store.schema)) <= set(await prepared_plans(driver))
            await conn.close()
        assert await backends(admin_url, database) == 5
    finally:
        await service.close()


async def test_start_runs_the_hot_path_once_on_each_request_connection_and_writes_nothing(
    pg_url: str,
) -> None:
    """A statement's first run on a connection costs its backend the catalog entries of
    its plan and, for a consolidation's statements, their generic plan: start() has each
    request connection run the peek's and the consolidation's statements once, for the
    empty identity, in a transaction rolled back."""
    seeding = PostgresStore.from_url(pg_url)
    try:
        await seeding.append([record("observed")])
        await consolidate(seeding, "alice", upserts=[fact()])
        await seeding.append([record("waiting", created_at=NOW + timedelta(minutes=1))])
    finally:
        await seeding.close()
    # Rows of the empty identity, as stores wrote them before they refused it: the
    # rehearsal runs as this superuser, whom row-level security does not bound.
    await fetch(pg_url, "INSERT INTO coda_memory.checkpoints (identity_id) VALUES ('')")
    await fetch(
        pg_url,
        "INSERT INTO coda_memory.observations (identity_id, type, content, created_at) "
        "VALUES ('', 'query_pattern', 'q', now())",
    )
    before = await table_digests(pg_url)
    store = PostgresStore.from_url(pg_url, pool_size=3, writer_pool_size=1)
    service = MemoryService(store)
    try:
        await service.start()
        assert await table_digests(pg_url) == before
        statements = Statements.for_schema(store.schema)
        # All but the first consolidation's INSERT (a write) and the deletes sent ahead of
        # a write that deletes thousands of facts.
        skipped = (statements.ensure, statements.delete)
        run = {q.text: q.name for q in statements.all() if q not in skipped}
        held = [await store.request_engine.connect() for _ in range(3)]
        for conn in held:
            driver = await driver_connection(conn)
            plans = await prepared_plans(driver)
            ran = {run[text]: runs for text, runs in plans.items() if text in run}
            # Each once, on its generic plan (the consolidation's transaction asks for them).
            once = dict.fromkeys(run.values(), (1, 0))
            assert ran == once
            await conn.close()
    finally:
        await service.close()


async def test_start_leaves_no_transaction_open_and_no_table_locked(
    pg_url: str, admin_url: str
) -> None:
    # Preparing a statement opens an implicit transaction that holds its tables' locks
    # until the connection's next Sync: a connection left so in the pool would make a
    # migration's ACCESS EXCLUSIVE lock wait for its first request, and all else queue
    # behind the migration.
    store = PostgresStore.from_url(pg_url, pool_size=3, writer_pool_size=2)
    service = MemoryService(store)
    try:
        await service.start()
        database = store.engine.url.database
        assert await backends(admin_url, database, in_transaction=True) == 0
        locker = engine(pg_url)
        try:
            async with locker.begin() as conn:
                await conn.execute(text("SET LOCAL lock_timeout = '1s'"))
                await conn.execute(
                    text("LOCK TABLE coda_memory.observations IN ACCESS EXCLUSIVE MODE")
                )
        finally:
            await locker.dispose()
    finally:
        await service.close()


async def test_without_start_connections_open_on_first_use(pg_url: str, admin_url: str) -> None:
    store = PostgresStore.from_url(pg_url, pool_size=3, writer_pool_size=2)
    service = MemoryService(store, load_timeout=5.0, clock=lambda: NOW)
    try:
        database = store.engine.url.database
        await store.append([record("observed")])
        assert await backends(admin_url, database) == 1
        loaded = await service.load_memory("alice")
        assert [f.subject for f in loaded.facts] == ["tool_affinity:get_account"]
        assert await backends(admin_url, database) == 2
    finally:
        await service.close()


async def test_a_consolidation_reads_facts_again_when_another_moved_the_checkpoint(
    pg_url: str,
) -> None:
    first, second = PostgresStore.from_url(pg_url), PostgresStore.from_url(pg_url)
    try:
        await consolidate(first, upserts=[fact("tool_affinity:old")])
        await first.append([record("observed")])
        facts, pending = await first.peek("alice")
        # Observations wait: the peek leaves the facts out and keeps them.
        assert pending and facts == []
        assert [f.subject for f in await first.kept_facts("alice")] == ["tool_affinity:old"]
        # Another process consolidates between the peek and the lock.
        await consolidate(second, upserts=[fact("tool_affinity:new")])
        async with first.consolidation("alice") as unit:
            loaded = await unit.load()
        assert sorted(f.subject for f in loaded.facts) == [
            "tool_affinity:new",
            "tool_affinity:old",
        ]
        # Nothing moved since this peek: the same facts, without reading them again (a
        # hand-made change that leaves the checkpoint row alone is not seen).
        await first.append([record("observed again")])
        assert (await first.peek("alice"))[1]
        facts = await first.kept_facts("alice")
        await fetch(pg_url, "UPDATE coda_memory.facts SET confidence = 0.25")
        async with first.consolidation("alice") as unit:
            loaded = await unit.load()
        assert len(loaded.facts) == len(facts) == 2
        assert loaded.facts == facts
        assert all(f.confidence != 0.25 for f in loaded.facts)
    finally:
        await first.close()
        await second.close()


TIMEOUTS = ("lock_timeout", "table_lock_timeout", "statement_timeout", "writer_lock_timeout")


@pytest.mark.parametrize("name", TIMEOUTS)
def test_a_timeout_postgres_cannot_take_is_refused_at_once(pg_url: str, name: str) -> None:
    """Postgres takes timeouts up to 2**31 - 1 ms (24.8 days): a longer one made every
    statement that set it fail (every consolidation, or every write, whose observations
    were then lost), long after the service started."""
    with pytest.raises(ValueError, match=f"{name} must be at most"):
        options: dict[str, Any] = {name: MAX_TIMEOUT + timedelta(milliseconds=1)}
        PostgresStore.from_url(pg_url, **options)


async def test_the_longest_timeouts_postgres_takes_work(pg_url: str) -> None:
    longest: dict[str, Any] = dict.fromkeys(TIMEOUTS, MAX_TIMEOUT)
    service = MemoryService(PostgresStore.from_url(pg_url, **longest), clock=lambda: NOW)
    try:
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain()
        facts = await service.consolidate("alice")
        assert [f.subject for f in facts] == ["tool_affinity:get_account"]
        assert service.stats().stored == 1
    finally:
        await service.close()


#: Holds alice's checkpoint row: her consolidation waits for it.
_HOLD_ALICE = text("SELECT 1 FROM coda_memory.checkpoints WHERE identity_id = 'alice' FOR UPDATE")


def _patient_service(pg_url: str) -> tuple[MemoryService, str | None]:
    """A service whose consolidations wait for a held row far longer than a test holds
    it, and its database's name."""
    long = timedelta(seconds=60)
    store = PostgresStore.from_url(pg_url, statement_timeout=long, lock_timeout=long)
    return MemoryService(store, clock=lambda: NOW), store.engine.url.database


async def _alice_waits(service: MemoryService) -> None:
    """Alice gets her checkpoint row, and an observation that waits for her next
    consolidation."""
    service.emit_observation("alice", tool_ok("get_account"))
    await service.drain(5)
    await service.consolidate("alice")
    service.emit_observation("alice", tool_ok("get_account"))
    await service.drain(5)


@pytest.mark.parametrize("ends", ["within the grace", "after the grace"])
async def test_close_leaves_no_connection_open_when_a_consolidate_in_flight_ends(
    pg_url: str, admin_url: str, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    """close() disposed the pools while a consolidate() of the caller's held one of their
    connections, which then stayed open after close() had returned. Now close() waits
    for the call, up to its grace; a call that outlives it closes its connection when it
    ends (given back, it went into a pool that nothing used, and stayed open until the
    garbage collector found it)."""
    after = ends == "after the grace"
    if after:
        monkeypatch.setattr(service_module, "CLOSE_GRACE", 0.2)
    service, database = _patient_service(pg_url)
    holder = engine(pg_url)
    consolidating: asyncio.Task[list[Fact]] | None = None
    try:
        await _alice_waits(service)
        async with holder.begin() as conn:
            await conn.execute(_HOLD_ALICE)
            consolidating = asyncio.create_task(service.consolidate("alice"))
            await until_waiting(admin_url, database, 1)
            closing = asyncio.create_task(service.close())
            done, _ = await asyncio.wait({closing}, timeout=10 if after else 0.5)
            if after:  # close() gave up on the consolidation, which still waits
                assert done and not consolidating.done()
                assert await backends(admin_url, database) == 2  # the holder's, the call's
            else:  # close() waits for the consolidation it would cut off
                assert not done
        [preference] = await consolidating
        await closing
        assert preference.id == "fact:tool_affinity:get_account"
        assert await backends_once_closed(admin_url, database) == 0
    finally:
        if consolidating is not None:
            await asyncio.wait({consolidating}, timeout=5)
        await service.close()
        await holder.dispose()
