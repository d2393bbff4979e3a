"""Rollup deferral on a real server: an append goes on while a rollup table is locked,
owes the rollup of its rows, and a later append (or maintenance) folds it in exactly once:
the rollup then equals what a rebuild computes from the stored observations."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from coda_memory import MemoryService
from coda_memory.ports import ObservationRecord
from coda_memory.postgres import PostgresStore, batch_keys, maintenance
from coda_memory.postgres import rollup as rollup_module
from coda_memory.postgres.analytics import rebuild_rollups
from coda_memory.postgres.engine import driver_connection
from coda_memory.postgres.rollup_batch import owed_statements
from coda_memory.postgres.rollup_owed import ROLLUP_LOCK_TIMEOUT
from tests.helpers import FakeClock, tool_ok
from tests.postgres.helpers import consolidate, dsn, fetch, locked
from tests.postgres.test_analytics import (
    D1,
    D2,
    FIXTURE,
    ROLLUP_COLUMNS,
    access,
    asked,
    call,
    rollup_rows,
)

ROLLUP_TABLES = tuple(ROLLUP_COLUMNS)
#: The writer's lock timeout in these tests: an append that waited for it would show.
WRITER_LOCK_TIMEOUT = timedelta(seconds=5)
#: Generous on a busy machine, and still far below the writer's lock timeout.
PROMPTLY = 2.5
#: After everything the fixture holds.
LATER = datetime(2100, 1, 1, tzinfo=UTC)
#: A batch's idempotency key.
KEY = "5b0d3c4e-2f61-4a8e-9c1d-7e3f0a6b8c9d"
#: Every kind of rollup: tools (1), entities (2), domains (4).
ALL_KINDS = 7


def writer(url: str) -> PostgresStore:
    return PostgresStore.from_url(url, writer_lock_timeout=WRITER_LOCK_TIMEOUT)


@pytest.fixture
async def store(pg_url: str) -> AsyncIterator[PostgresStore]:
    """A store of the test's database with the writer's lock timeout of these tests."""
    store = writer(pg_url)
    try:
        yield store
    finally:
        await store.close()


async def rollup(store: PostgresStore) -> dict[str, list[tuple[Any, ...]]]:
    """Every rollup table, shards summed away."""
    return {table: await rollup_rows(store, table) for table in ROLLUP_TABLES}


async def rebuilt(store: PostgresStore) -> dict[str, list[tuple[Any, ...]]]:
    """The rollup as a rebuild computes it from the stored observations."""
    await rebuild_rollups(store)
    return await rollup(store)


async def owed(url: str) -> list[tuple[Any, ...]]:
    return await fetch(url, "SELECT identity_id, kinds FROM coda_memory.rollup_owed ORDER BY 1")


async def stored(url: str) -> int:
    return int((await fetch(url, "SELECT count(*) FROM coda_memory.observations"))[0][0])


async def counted(store: PostgresStore) -> tuple[int, int, int]:
    """The rollup's tool calls, entity accesses and domain queries."""
    tools = await rollup_rows(store, "tool_daily")
    return (
        sum(successes + failures for *_, successes, failures, _ in tools),
        sum(row[3] for row in await rollup_rows(store, "entity_daily")),
        sum(row[2] for row in await rollup_rows(store, "domain_daily")),
    )


async def timed_append(store: PostgresStore, batch: list[ObservationRecord], **kw: Any) -> Any:
    started = time.monotonic()
    outcome = await asyncio.wait_for(store.append(batch, **kw), 10)
    assert time.monotonic() - started < PROMPTLY
    return outcome


@pytest.mark.parametrize("table", ROLLUP_TABLES)
async def test_an_append_goes_on_while_a_rollup_table_is_locked(
    pg_url: str, table: str, store: PostgresStore
) -> None:
    await store.append(FIXTURE[:5])
    async with locked(pg_url, table):
        outcome = await timed_append(store, FIXTURE[5:])
        assert (outcome.stored, outcome.refused) == (len(FIXTURE) - 5, [])
        assert await stored(pg_url) == len(FIXTURE)
        # One record per identity of the batch, for every kind it feeds.
        assert await owed(pg_url) == [("ana", ALL_KINDS), ("ben", ALL_KINDS), ("cy", ALL_KINDS)]
        assert store.rollup_debt.known
    # Released: the store's next append folds what it owes.
    await store.append([asked("dee", "royalty", D2)])
    assert await owed(pg_url) == []
    assert not store.rollup_debt.known
    assert await rollup(store) == await rebuilt(store)


async def test_only_the_kinds_a_batch_feeds_are_owed_and_locked(
    pg_url: str, store: PostgresStore
) -> None:
    async with locked(pg_url, "entity_daily"):
        # Tools and domains only: the entity rollup's lock is not in their way.
        await timed_append(store, [call("ana", "t", True, D1), asked("ana", "royalty", D1)])
        assert await owed(pg_url) == []
        await timed_append(store, [access("ben", "account", "1", D1), call("ben", "t", True, D1)])
        assert await owed(pg_url) == [("ben", 1 | 2)]
    await store.append([call("cy", "t", True, D2)])
    assert await owed(pg_url) == []
    assert await rollup(store) == await rebuilt(store)


async def test_owed_records_stay_while_the_table_stays_locked(
    pg_url: str, store: PostgresStore
) -> None:
    async with locked(pg_url, "tool_daily"):
        await timed_append(store, [call("ana", "t", True, D1)])
        # The next append owes as well (it does not try to fold behind the lock).
        await timed_append(store, [call("ben", "t", True, D1)])
        assert await owed(pg_url) == [("ana", 1), ("ben", 1)]
        # Maintenance cannot fold either, and does not wait for the writer's timeout.
        started = time.monotonic()
        assert await maintenance.fold_owed_rollups(store) == 0
        assert time.monotonic() - started < PROMPTLY
        assert await owed(pg_url) == [("ana", 1), ("ben", 1)]
    assert await maintenance.fold_owed_rollups(store) == 2
    assert await owed(pg_url) == []
    assert await rollup(store) == await rebuilt(store)


async def test_a_second_fold_changes_nothing(pg_url: str, store: PostgresStore) -> None:
    async with locked(pg_url, "domain_users"):
        await timed_append(store, FIXTURE)
    assert await maintenance.fold_owed_rollups(store) == 1
    folded = await rollup(store)
    assert await maintenance.fold_owed_rollups(store) == 0
    assert await rollup(store) == folded
    # Nor does an append that folds (its store still believes it owes).
    store.rollup_debt.known = True
    await store.append([call("zed", "t", True, D2)])
    assert not store.rollup_debt.known
    assert await rollup(store) == await rebuilt(store)


async def test_a_retried_batch_is_neither_stored_nor_counted_twice(
    pg_url: str, store: PostgresStore
) -> None:
    async with locked(pg_url, "tool_users"):
        first = await timed_append(store, FIXTURE, batch_key=KEY)
        # The retry of a batch whose outcome was lost, while still locked.
        again = await timed_append(store, FIXTURE, batch_key=KEY)
        assert again == first
        assert len(await owed(pg_url)) == 3
    # And once released, when the retry's append folds the debt.
    assert await store.append(FIXTURE, batch_key=KEY) == first
    assert await owed(pg_url) == []
    assert await stored(pg_url) == len(FIXTURE)
    assert await rollup(store) == await rebuilt(store)


async def test_forget_folds_the_identitys_owed_rollup_first_and_leaves_no_record(
    pg_url: str, store: PostgresStore
) -> None:
    # The anonymous counts stay after a forget, those of calls whose rollup was owed too
    # (the forget deleted the owed records unfolded, and those calls were never counted).
    async with locked(pg_url, "entity_users"):
        await timed_append(store, FIXTURE)
    await store.forget("ana")
    assert await owed(pg_url) == [("ben", ALL_KINDS), ("cy", ALL_KINDS)]
    await store.append([call("ben", "t", True, D2)])
    assert await owed(pg_url) == []
    assert await counted(store) == (9 + 1, 7, 5)
    # ana is no user any more.
    users = await fetch(
        pg_url,
        "SELECT count(*) FROM coda_memory.tool_users WHERE identity_id = 'ana' UNION ALL "
        "SELECT count(*) FROM coda_memory.entity_users WHERE identity_id = 'ana' UNION ALL "
        "SELECT count(*) FROM coda_memory.domain_users WHERE identity_id = 'ana'",
    )
    assert users == [(0,), (0,), (0,)]
    # The others' rows are what a rebuild computes from theirs; ana's counts are not.
    assert (await rollup(store))["tool_users"] == (await rebuilt(store))["tool_users"]


async def test_forget_goes_on_while_a_table_only_the_folding_needs_stays_locked(
    pg_url: str, store: PostgresStore
) -> None:
    # A forget writes to the other rollup tables itself, and waits for their locks.
    async with locked(pg_url, "tool_durations"):
        await timed_append(store, FIXTURE)
        started = time.monotonic()
        await asyncio.wait_for(store.forget("ana"), 10)
        assert time.monotonic() - started < PROMPTLY
        assert await owed(pg_url) == [("ben", ALL_KINDS), ("cy", ALL_KINDS)]
    await store.append([call("ben", "t", True, D2)])
    # ana's calls, owed until the forget, were not counted: the others' are. Her entity
    # accesses and queries were, as a forget folds each kind of rollup on its own.
    assert (await counted(store))[1:] == (7, 5)
    tools = ("tool_daily", "tool_users", "tool_durations")
    kept = await rollup(store)
    expected = await rebuilt(store)
    assert {table: kept[table] for table in tools} == {table: expected[table] for table in tools}


async def test_a_rebuild_drops_the_owed_records_it_recomputes(
    pg_url: str, store: PostgresStore
) -> None:
    async with locked(pg_url, "domain_daily"):
        await timed_append(store, FIXTURE)
    await rebuild_rollups(store)
    assert await owed(pg_url) == []
    # The store still believes it owes: its append finds nothing left to fold.
    await store.append([call("ana", "t", True, D2)])
    assert await rollup(store) == await rebuilt(store)


async def test_prune_folds_first_and_never_deletes_an_observation_still_owed(
    pg_url: str, store: PostgresStore
) -> None:
    async with locked(pg_url, "tool_daily"):
        await timed_append(store, FIXTURE)
        for identity in ("ana", "ben", "cy"):
            await consolidate(store, identity)
        # Every row is consumed, but its rollup is owed and cannot be folded yet.
        outcome = await maintenance.prune_consolidated(store, before=LATER)
        assert (outcome.owed_folded, outcome.deleted) == (0, 0)
        assert await stored(pg_url) == len(FIXTURE)
    outcome = await maintenance.prune_consolidated(store, before=LATER)
    assert (outcome.owed_folded, outcome.deleted) == (1, len(FIXTURE))
    assert await owed(pg_url) == []
    # Every pruned row was counted first.
    assert await counted(store) == (9, 7, 5)


async def test_a_consolidation_never_prunes_an_observation_whose_rollup_is_owed(
    pg_url: str, store: PostgresStore
) -> None:
    # Observations dated further back than the retention, stored while a rollup table is
    # locked: the consolidation's own pruning deleted them before a later append folded
    # their owed rollup, which then counted nothing of them.
    async with locked(pg_url, "tool_daily"):
        await timed_append(store, FIXTURE)
        for identity in ("ana", "ben", "cy"):
            await consolidate(store, identity, now=LATER, retention=timedelta(days=7))
        assert await stored(pg_url) == len(FIXTURE)
    await store.append([call("dee", "t", True, D2)])
    assert await owed(pg_url) == []
    assert (await counted(store))[0] == 9 + 1
    # Folded, they go at the identity's next consolidation.
    await consolidate(store, "ana", now=LATER, retention=timedelta(days=7))
    assert await fetch(
        pg_url, "SELECT count(*) FROM coda_memory.observations WHERE identity_id = 'ana'"
    ) == [(0,)]


async def test_concurrent_folders_fold_each_record_once(pg_url: str) -> None:
    stores = [writer(pg_url) for _ in range(3)]
    try:
        async with locked(pg_url, "tool_durations"):
            for n in range(6):
                batch = [call(f"user-{n % 4}", f"tool-{n % 3}", n % 2 == 0, D1, 10.0 * n)]
                await timed_append(stores[n % 3], [*batch, *FIXTURE[n::6]])
        transactions = await fetch(pg_url, "SELECT DISTINCT xid::text FROM coda_memory.rollup_owed")
        assert len(transactions) == 6
        # Three maintenance runs, one record per transaction, and three appends that fold
        # what their store owes, all at once.
        await asyncio.gather(
            *(maintenance.fold_owed_rollups(s, batch_size=1) for s in stores),
            *(s.append([asked(f"v{n}", "royalty", D2)]) for n, s in enumerate(stores)),
        )
        assert await owed(pg_url) == []
        assert await rollup(stores[0]) == await rebuilt(stores[0])
    finally:
        for store in stores:
            await store.close()


async def test_a_folding_counts_the_records_it_claimed_and_no_other_of_their_transactions(
    pg_url: str, store: PostgresStore
) -> None:
    """Two owed transactions of the same two identities, folded three records at a time:
    the first folding takes one transaction whole and half of the other, and must not
    count the rows of the record it did not claim (the second folding counts them)."""
    async with locked(pg_url, "tool_daily"):
        for n in range(2):
            await timed_append(store, [call("ana", f"t{n}", True, D1), call("ben", "t", True, D1)])
    assert len(await owed(pg_url)) == 4
    # Transactions folded: two in the first folding (one of them in part), one after.
    assert await maintenance.fold_owed_rollups(store, batch_size=3) == 3
    assert await owed(pg_url) == []
    assert await rollup(store) == await rebuilt(store)


async def test_the_service_counts_what_its_appends_owed_and_folded(pg_url: str) -> None:
    service = MemoryService(writer(pg_url), clock=FakeClock(LATER))
    try:
        async with locked(pg_url, "tool_daily"):
            service.emit_observation("ana", tool_ok("t"))
            await service.drain()
            service.emit_observation("ben", tool_ok("t"))
            await service.drain()
            stats = service.stats()
            assert (stats.rollups_owed, stats.rollups_folded, stats.keys_spilled) == (2, 0, 0)
        service.emit_observation("cy", tool_ok("t"))
        await service.drain()
        stats = service.stats()
        assert (stats.rollups_owed, stats.rollups_folded) == (2, 2)
        assert await owed(pg_url) == []
    finally:
        await service.close()


async def test_a_folding_reads_each_owed_record_by_index_not_by_scanning_the_table(
    pg_url: str, store: PostgresStore
) -> None:
    """The planner cannot estimate the rollup's key filters (it guesses a row or two of
    the whole table): as a plain join of the owed records to the observations, it chose
    a scan of every observation, nested under the records, and a folding of 1,000
    records took seconds. Each record's rows are read by an index probe instead."""
    calls = [call(f"user-{n % 50}", f"tool-{n % 7}", n % 3 > 0, D1) for n in range(5_000)]
    for start in range(0, len(calls), 500):  # ten transactions
        await store.append(calls[start : start + 500])
    await fetch(pg_url, "ANALYZE coda_memory.observations")
    async with store.engine.connect() as conn:
        driver = await driver_connection(conn)
        pairs = await driver.fetch(
            "SELECT DISTINCT identity_id, xid FROM coda_memory.observations LIMIT 100"
        )
        identities = [row["identity_id"] for row in pairs]
        xids = [row["xid"] for row in pairs]
        for statement in owed_statements("coda_memory"):
            arguments = statement.arguments(identities, 0, xids)
            plan = "\n".join(
                row[0] for row in await driver.fetch(f"EXPLAIN {statement.sql}", *arguments)
            )
            assert "Seq Scan on observations" not in plan
            assert re.search(r"Index Scan (using|on) ix_observations_\w+", plan), plan


def test_the_rollup_lock_timeout_is_short() -> None:
    assert ROLLUP_LOCK_TIMEOUT < WRITER_LOCK_TIMEOUT / 10


@pytest.mark.parametrize("batch_size", [0, 2**31, True])
async def test_a_batch_size_the_statements_cannot_take_is_refused(
    pg_store: PostgresStore, batch_size: int
) -> None:
    """2**31 failed in the driver ("out of int32 range") after the owed rollups were read."""
    for call_with in (
        maintenance.fold_owed_rollups(pg_store, batch_size=batch_size),
        maintenance.prune_consolidated(pg_store, before=datetime.now(UTC), batch_size=batch_size),
    ):
        with pytest.raises(ValueError, match="batch_size must be"):
            await call_with


async def waiting_for(url: str, table: str, longer_than: timedelta) -> bool:
    """Whether a backend has waited for a lock on ``table`` for ``longer_than``."""
    rows = await fetch(
        url,
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = "
        "(SELECT oid FROM pg_class WHERE relname = :table "
        "AND relnamespace = 'coda_memory'::regnamespace) "
        "AND waitstart < now() - CAST(:longer AS interval)",
        table=table,
        longer=longer_than,
    )
    return int(rows[0][0]) > 0


@pytest.mark.parametrize("table", ["tool_daily", "entity_users", "domain_daily"])
async def test_forget_waits_for_a_table_it_writes_and_keeps_the_owed_counts(
    pg_url: str, table: str
) -> None:
    """A table the forget writes itself, locked: the forget waits for it (up to its lock
    timeout) and then folds the identity's owed rollup. It folded first, gave up on the
    lock after 50 ms, deleted the owed records, and then waited for the same table
    anyway: the counts of the identity's owed calls were lost."""
    store = PostgresStore.from_url(
        pg_url, writer_lock_timeout=WRITER_LOCK_TIMEOUT, lock_timeout=timedelta(seconds=10)
    )
    try:
        async with AsyncExitStack() as held:
            await held.enter_async_context(locked(pg_url, table))
            await timed_append(store, FIXTURE)
            forget = asyncio.ensure_future(store.forget("ana"))
            async with asyncio.timeout(10):
                # Past the folding's own wait: the forget's, were it to give up there.
                while not await waiting_for(pg_url, table, 4 * ROLLUP_LOCK_TIMEOUT):
                    assert not forget.done(), forget
                    await asyncio.sleep(0.01)  # polling the server's lock table
        await asyncio.wait_for(forget, 10)
        assert await owed(pg_url) == [("ben", ALL_KINDS), ("cy", ALL_KINDS)]
        await store.append([call("ben", "t", True, D2)])
        assert await owed(pg_url) == []
        # ana's calls count, as everyone's: nothing owed was lost.
        assert await counted(store) == (9 + 1, 7, 5)
    finally:
        await store.close()


async def test_forget_fails_whole_when_a_table_it_writes_stays_locked(pg_url: str) -> None:
    store = PostgresStore.from_url(
        pg_url, writer_lock_timeout=WRITER_LOCK_TIMEOUT, lock_timeout=timedelta(milliseconds=200)
    )
    try:
        async with locked(pg_url, "tool_daily"):
            await timed_append(store, FIXTURE)
            with pytest.raises(Exception) as raised:
                await asyncio.wait_for(store.forget("ana"), 10)
            assert "lock timeout" in str(raised.value)
        # Nothing of ana was erased, and her owed rollup is still owed, not lost.
        assert await owed(pg_url) == [("ana", ALL_KINDS), ("ben", ALL_KINDS), ("cy", ALL_KINDS)]
        assert await stored(pg_url) == len(FIXTURE)
        await store.forget("ana")
        await store.append([call("ben", "t", True, D2)])
        assert await counted(store) == (9 + 1, 7, 5)
    finally:
        await store.close()


async def _waiting_for_locks(url: str, count: int) -> None:
    """Until ``count`` backends wait for a lock."""
    async with asyncio.timeout(10):
        while True:
            rows = await fetch(
                url, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            )
            if rows[0][0] >= count:
                return
            await asyncio.sleep(0.02)  # polling the server's lock table


async def test_a_forget_and_an_append_of_the_identity_never_deadlock(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An append holds a daily row of tools and waits for the identity's row of entities:
    the forget took the identity's rows of every kind before any daily row, so it had that
    row and then waited for the append's daily row (one shard, as any two connections of
    the eight share one in eight times): "deadlock detected" failed the forget, or
    deferred the append's rollup."""
    monkeypatch.setattr(rollup_module, "SHARDS", 1)
    monkeypatch.setattr(batch_keys, "SHARDS", 1)
    store = PostgresStore.from_url(
        pg_url, writer_lock_timeout=WRITER_LOCK_TIMEOUT, lock_timeout=timedelta(seconds=10)
    )
    holder = await asyncpg.connect(dsn(pg_url))
    try:
        await store.append([call("x", "t", True, D1), access("x", "account", "e1", D1)])
        # The identity's row of entities, held a moment: the forget waits for it first,
        # then the append, which holds its daily row of tools by then.
        held = holder.transaction()
        await held.start()
        await holder.execute(
            "SELECT 1 FROM coda_memory.entity_users WHERE identity_id = 'x' FOR UPDATE"
        )
        forget = asyncio.ensure_future(store.forget("x"))
        await _waiting_for_locks(pg_url, 1)
        append = asyncio.ensure_future(
            store.append([call("a", "t", True, D1), access("x", "account", "e1", D1)])
        )
        await _waiting_for_locks(pg_url, 2)
        await asyncio.sleep(1.2)  # past the append's own check for a deadlock
        await held.rollback()
        outcomes = await asyncio.gather(forget, append, return_exceptions=True)
        assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
        assert store.ingest_counts.rollups_owed == 0
    finally:
        await holder.close()
        await store.close()
