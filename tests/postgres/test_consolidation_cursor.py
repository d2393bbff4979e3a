"""The consolidation cursor and the unit of work, with real concurrent connections.

Races are staged with explicit transactions and row locks: a second connection holds an
uncommitted insert, a unit holds the checkpoint lock while another waits for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

import asyncpg
import pytest
from sqlalchemy import insert, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from coda_memory.core.logs import identity_label
from coda_memory.errors import ConnectionLost
from coda_memory.postgres import PostgresStore
from coda_memory.postgres.engine import driver_connection
from coda_memory.postgres.schema import observations
from coda_memory.postgres.unit import Statements
from tests.postgres.helpers import (
    NOW,
    consolidate,
    contents,
    engine,
    fact,
    fetch,
    plan,
    record,
)


@asynccontextmanager
async def uncommitted_insert(
    url: str, content: str, **fields: object
) -> AsyncIterator[AsyncConnection]:
    """A connection of its own holding an open transaction that inserted one observation;
    the caller commits it (or leaving the block rolls it back)."""
    own = engine(url)
    try:
        async with own.connect() as conn:
            await conn.begin()
            values = {
                "identity_id": "alice",
                "type": "tool_success",
                "content": content,
                "metadata": {},
                "session_id": "s9",
                "created_at": NOW,
                **fields,
            }
            await conn.execute(insert(observations).values(values))
            yield conn
    finally:
        await own.dispose()


def url_of(store: PostgresStore) -> str:
    return store.engine.url.render_as_string(hide_password=False)


async def test_first_run_sees_everything_and_the_next_nothing(pg_store: PostgresStore) -> None:
    await pg_store.append([record("one"), record("two"), record("other", identity_id="bob")])

    assert contents((await consolidate(pg_store)).observations) == ["one", "two"]
    assert (await consolidate(pg_store)).observations == []
    checkpoint = await pg_store.checkpoint("alice")
    assert checkpoint is not None
    assert (checkpoint.runs, checkpoint.observations_consumed) == (2, 2)
    assert checkpoint.consolidated_at == NOW


async def test_an_append_in_flight_during_a_run_is_left_for_the_next_run(
    pg_store: PostgresStore,
) -> None:
    await pg_store.append([record("committed before")])
    async with uncommitted_insert(url_of(pg_store), "in flight") as writer:
        # A later transaction commits first, so the writer's id is below the run's xmax:
        # a cursor that only compared ids with the last xmax would skip the writer's row.
        await pg_store.append([record("committed while the writer is open")])
        first = await consolidate(pg_store)
        await writer.commit()

    second = await consolidate(pg_store)
    third = await consolidate(pg_store)

    assert contents(first.observations) == [
        "committed before",
        "committed while the writer is open",
    ]
    assert contents(second.observations) == ["in flight"]
    assert third.observations == []


async def test_an_append_committed_after_load_is_left_for_the_next_run(
    pg_store: PostgresStore,
) -> None:
    await pg_store.append([record("before")])
    async with pg_store.consolidation("alice") as unit:
        loaded = await unit.load()
        # Committed while the run holds its lock, after its snapshot was taken.
        await pg_store.append([record("during")])
        await unit.write(plan(consumed=len(loaded.observations)))
        await unit.commit()

    assert contents(loaded.observations) == ["before"]
    assert contents((await consolidate(pg_store)).observations) == ["during"]
    assert (await consolidate(pg_store)).observations == []


async def test_an_old_created_at_is_consumed_once_whatever_the_clock_says(
    pg_store: PostgresStore,
) -> None:
    await pg_store.append([record("on time")])
    await consolidate(pg_store, now=NOW)
    # Written after the run, stamped long before it (a skewed clock, a late flush).
    await pg_store.append([record("backdated", created_at=NOW - timedelta(days=3))])

    assert contents((await consolidate(pg_store, now=NOW)).observations) == ["backdated"]
    assert (await consolidate(pg_store, now=NOW)).observations == []


async def test_prune_deletes_only_old_observations_the_run_saw(pg_store: PostgresStore) -> None:
    old = NOW - timedelta(days=30)
    await pg_store.append([record("old seen", created_at=old), record("recent", created_at=NOW)])
    url = url_of(pg_store)
    async with uncommitted_insert(url, "old in flight", created_at=old) as writer:
        async with pg_store.consolidation("alice") as unit:
            loaded = await unit.load()
            # Committed after the snapshot: visible to the DELETE, but not seen by the run.
            await pg_store.append([record("old committed meanwhile", created_at=old)])
            await unit.write(plan(consumed=2, prune_before=NOW - timedelta(days=7)))
            await unit.commit()
        await writer.commit()

    assert contents(loaded.observations) == ["old seen", "recent"]
    remaining = contents(await pg_store.observations("alice"))
    assert sorted(remaining) == ["old committed meanwhile", "old in flight", "recent"]
    # The survivors are consumed by the next run, once, and then pruned.
    nxt = await consolidate(pg_store, retention=timedelta(days=7))
    assert sorted(contents(nxt.observations)) == ["old committed meanwhile", "old in flight"]
    assert contents(await pg_store.observations("alice")) == ["recent"]


async def test_a_connection_killed_mid_unit_leaves_the_previous_state(
    pg_store: PostgresStore, admin_url: str
) -> None:
    await pg_store.append([record("consumed")])
    await consolidate(pg_store, upserts=[fact("tool_affinity:kept")])
    await pg_store.append([record("pending")])
    before = (await pg_store.checkpoint("alice"), await pg_store.facts("alice"))
    database = pg_store.engine.url.database

    with pytest.raises(ConnectionLost) as lost:
        async with pg_store.consolidation("alice") as unit:
            await unit.load()
            await unit.write(plan(consumed=1, upserts=[fact("tool_affinity:new")]))
            # The unit's backend is the one idle in a transaction on this database.
            killed = await fetch(
                admin_url,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = :db AND state = 'idle in transaction'",
                db=database,
            )
            assert killed == [(True,)]
            await unit.commit()
    # The identity by its label: a host that logs the exception logs no identity.
    assert f"while consolidating {identity_label('alice')}" in str(lost.value)
    assert "alice" not in str(lost.value)

    # The pool replaces the dead connection; nothing of the unit was kept.
    assert (await pg_store.checkpoint("alice"), await pg_store.facts("alice")) == before
    assert contents((await consolidate(pg_store)).observations) == ["pending"]


async def test_the_store_recovers_when_its_connections_are_terminated(
    pg_store: PostgresStore, admin_url: str
) -> None:
    await pg_store.append([record("before")])
    await pg_store.facts("alice")  # leaves a connection idle in the pool
    terminated = await fetch(
        admin_url,
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE datname = :db AND pid <> pg_backend_pid()",
        db=pg_store.engine.url.database,
    )
    assert terminated[0][0] >= 1

    assert (await pg_store.append([record("after")])).stored == 1
    assert contents((await consolidate(pg_store)).observations) == ["before", "after"]


async def wait_until_blocked(admin_url: str, database: str | None) -> None:
    """Return once a backend of ``database`` waits for a lock (the row lock under test)."""
    async with asyncio.timeout(10):
        while not await fetch(
            admin_url,
            "SELECT 1 FROM pg_stat_activity WHERE datname = :db AND wait_event_type = 'Lock'",
            db=database,
        ):
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("first_use", [True, False], ids=["first-use", "existing-checkpoint"])
async def test_a_run_waiting_behind_another_starts_where_it_stopped(
    pg_store: PostgresStore, admin_url: str, first_use: bool
) -> None:
    if not first_use:
        await consolidate(pg_store)  # the checkpoint row exists and is committed
    await pg_store.append([record("first batch")])

    async def second_run() -> list[str]:
        return contents((await consolidate(pg_store, upserts=[fact(count=2)])).observations)

    async with pg_store.consolidation("alice") as unit:
        loaded = await unit.load()
        waiting = asyncio.create_task(second_run())
        await wait_until_blocked(admin_url, pg_store.engine.url.database)
        await pg_store.append([record("while the first run held the lock")])
        await unit.write(plan(consumed=len(loaded.observations), upserts=[fact()]))
        await unit.commit()
    second = await waiting

    assert contents(loaded.observations) == ["first batch"]
    assert second == ["while the first run held the lock"]
    checkpoint = await pg_store.checkpoint("alice")
    assert checkpoint is not None
    assert (checkpoint.runs, checkpoint.observations_consumed) == (2 if first_use else 3, 2)


async def test_lock_timeout_bounds_the_wait_for_a_busy_identity(pg_url: str) -> None:
    store = PostgresStore.from_url(pg_url, lock_timeout=timedelta(milliseconds=50))
    try:
        async with store.consolidation("alice"):
            with pytest.raises((DBAPIError, asyncpg.LockNotAvailableError), match="lock timeout"):
                async with store.consolidation("alice"):
                    pass
            # Another identity is not blocked.
            async with store.consolidation("bob") as other:
                await other.load()
    finally:
        await store.close()


async def test_forget_waits_for_a_running_consolidation(
    pg_store: PostgresStore, admin_url: str
) -> None:
    await pg_store.append([record("observed")])
    async with pg_store.consolidation("alice") as unit:
        loaded = await unit.load()
        forgetting = asyncio.create_task(pg_store.forget("alice"))
        await wait_until_blocked(admin_url, pg_store.engine.url.database)
        await unit.write(plan(consumed=len(loaded.observations), upserts=[fact()]))
        await unit.commit()
    await forgetting

    assert await pg_store.facts("alice") == []
    assert await pg_store.checkpoint("alice") is None


async def test_the_new_observations_query_uses_the_xid_index(pg_store: PostgresStore) -> None:
    # A busy identity: thousands of consumed observations from many transactions, so that
    # only the xid range (not the identity alone) makes reading the new ones cheap.
    for batch in range(10):
        await pg_store.append(
            [
                record(f"o{batch}-{i}", identity_id="id7" if i % 2 else f"id{i % 50}")
                for i in range(1000)
            ]
        )
    await pg_store.append([record("new", identity_id="id7")])
    # The snapshot a consolidation stores with nothing else running on the server: every
    # transaction before the new observation's is visible. (A consolidation's own snapshot
    # has the xmin of the oldest transaction running on the whole server: another client's
    # would put every observation here in the xid range, and the primary key's order win.)
    async with pg_store.engine.connect() as conn:
        new_xid = (
            await conn.execute(
                text("SELECT xid::text FROM coda_memory.observations WHERE content = 'new'")
            )
        ).scalar_one()
        await conn.execute(text("ANALYZE coda_memory.observations, coda_memory.fact_events"))
        # The statement the consolidation unit runs, with its parameters bound.
        statement = Statements.for_schema("coda_memory").new_since.text
        driver = await driver_connection(conn)
        stored = f"{new_xid}:{new_xid}:"
        pending = await driver.fetch(statement, "id7", stored)
        plan_json = await driver.fetchval(f"EXPLAIN (FORMAT JSON) {statement}", "id7", stored)

    assert [row["content"] for row in pending] == ["new"]
    assert "ix_observations_identity_id_xid" in str(plan_json)


async def test_a_run_cancelled_while_waiting_for_the_lock_leaves_nothing_behind(
    pg_store: PostgresStore, admin_url: str
) -> None:
    """The service cancels a consolidation that exceeds its time budget."""
    database = pg_store.engine.url.database
    await pg_store.append([record("observed")])
    async with pg_store.consolidation("alice") as unit:
        loaded = await unit.load()
        waiting = asyncio.create_task(consolidate(pg_store))
        await wait_until_blocked(admin_url, database)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await unit.write(plan(consumed=len(loaded.observations)))
        await unit.commit()

    leftovers = await fetch(
        admin_url,
        "SELECT state, wait_event_type FROM pg_stat_activity "
        "WHERE datname = :db AND (state <> 'idle' OR wait_event_type = 'Lock')",
        db=database,
    )
    assert leftovers == []
    assert (await consolidate(pg_store)).observations == []
    await pg_store.append([record("later")])
    assert contents((await consolidate(pg_store)).observations) == ["later"]


async def test_a_clock_set_back_leaves_the_last_consolidations_instant_where_it_was(
    pg_store: PostgresStore,
) -> None:
    """A run by a clock set back leaves the checkpoint's instant of the last consolidation
    (``consolidated_at``) where the run before it left it. What its moving back did, a late
    observation restarting a deleted fact, is the contract test of a clock set back
    (tests/contract/test_service_semantics.py), which runs on Postgres too."""
    await pg_store.append([record("before")])
    await consolidate(pg_store, now=NOW)
    await pg_store.append([record("set back")])
    await consolidate(pg_store, now=NOW - timedelta(days=30))
    checkpoint = await pg_store.checkpoint("alice")
    assert checkpoint is not None
    assert (checkpoint.runs, checkpoint.consolidated_at) == (2, NOW)
