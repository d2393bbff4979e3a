"""PostgresStore: appending, facts and history, forgetting, identities, schemas."""

from __future__ import annotations

from datetime import UTC, timedelta
from typing import cast

import pytest

from coda_memory.core.model import FactEventKind, ObservationType
from coda_memory.errors import SchemaNotMigrated
from coda_memory.ports import MemoryStore
from coda_memory.postgres import PostgresStore
from coda_memory.postgres.engine import asyncpg_url
from coda_memory.postgres.migrate import migrate_async
from coda_memory.postgres.schema import metadata
from tests.postgres.helpers import (
    NOW,
    consolidate,
    contents,
    event,
    fact,
    fetch,
    plan,
    record,
)


async def test_append_stores_the_batch_in_order(pg_store: PostgresStore) -> None:
    batch = [
        record("first", metadata={"toolName": "get_account", "durationMs": 12}),
        record("second", session_id=None, type=ObservationType.QUERY_PATTERN),
        record("third", created_at=NOW.astimezone(UTC) - timedelta(hours=1)),
    ]

    outcome = await pg_store.append(batch)

    assert outcome.stored == 3
    assert outcome.refused == []
    stored = await pg_store.observations("alice")
    assert contents(stored) == ["first", "second", "third"]
    assert [o.id for o in stored] == sorted(o.id for o in stored)
    assert stored[0].metadata == {"toolName": "get_account", "durationMs": 12}
    assert stored[1].session_id is None
    assert stored[1].type is ObservationType.QUERY_PATTERN
    assert stored[2].created_at == NOW - timedelta(hours=1)
    assert all(o.created_at.tzinfo is UTC for o in stored)


async def test_append_of_nothing_stores_nothing(pg_store: PostgresStore) -> None:
    assert (await pg_store.append([])).stored == 0


async def test_poison_rows_are_refused_and_every_good_row_is_stored(
    pg_store: PostgresStore,
) -> None:
    poison = {
        1: record("nul \x00 byte"),  # the server refuses NUL in text
        4: record("lone \udc80 surrogate"),  # cannot be encoded as UTF-8
        5: record("jsonb refuses \\u0000", metadata={"note": "a\x00b"}),
        7: record("check", type=cast(ObservationType, "not_a_type")),
        8: record("not json", metadata={"value": float("nan")}),
        10: record("nul in session", session_id="s\x00"),
    }
    batch = [poison.get(i) or record(f"good {i}") for i in range(12)]

    outcome = await pg_store.append(batch)

    assert [index for index, _ in outcome.refused] == sorted(poison)
    assert outcome.stored == 12 - len(poison)
    for _, reason in outcome.refused:
        assert reason
        assert "\n" not in reason
    reasons = dict(outcome.refused)
    assert "0x00" in reasons[1]
    assert "ck_observations_type" in reasons[7]
    good = [f"good {i}" for i in range(12) if i not in poison]
    assert contents(await pg_store.observations("alice")) == good
    # Rows written under the bisection's savepoints carry the top-level transaction id.
    assert contents((await consolidate(pg_store)).observations) == good
    assert (await consolidate(pg_store)).observations == []


async def test_a_batch_of_only_poison_stores_nothing(pg_store: PostgresStore) -> None:
    outcome = await pg_store.append([record("\x00"), record("\x00\x00")])

    assert outcome.stored == 0
    assert [index for index, _ in outcome.refused] == [0, 1]
    assert await pg_store.observations("alice") == []


async def test_facts_are_stored_with_their_anchor(pg_store: PostgresStore) -> None:
    anchored = fact("tool_affinity:a", confidence_at=NOW + timedelta(days=1), ease_factor=2.5)
    plain = fact("entity_frequency:account:42", confidence=0.75, count=3)
    await pg_store.append([record()])
    async with pg_store.consolidation("alice") as unit:
        await unit.load()
        await unit.apply(plan(upserts=[anchored, plain], consumed=1))
        await unit.commit()

    stored = {f.subject: f for f in await pg_store.facts("alice")}

    assert stored["tool_affinity:a"] == anchored
    # The anchor is always stored: None reads back as last_reinforced_at.
    assert stored["entity_frequency:account:42"] == plain.model_copy(
        update={"confidence_at": plain.last_reinforced_at}
    )
    assert stored["entity_frequency:account:42"].id == "fact:entity_frequency:account:42"


async def test_upserts_overwrite_and_deletes_remove(pg_store: PostgresStore) -> None:
    first = fact("tool_affinity:a")
    doomed = fact("tool_affinity:b")
    async with pg_store.consolidation("alice") as unit:
        await unit.load()
        await unit.apply(plan(upserts=[first, doomed]))
        await unit.commit()
    reinforced = fact("tool_affinity:a", confidence=0.6, count=2, at=NOW + timedelta(days=1))
    async with pg_store.consolidation("alice") as unit:
        loaded = await unit.load()
        assert {f.subject for f in loaded.facts} == {"tool_affinity:a", "tool_affinity:b"}
        await unit.apply(plan(upserts=[reinforced], deletes=["tool_affinity:b"]))
        await unit.commit()

    stored = await pg_store.facts("alice")

    assert [f.subject for f in stored] == ["tool_affinity:a"]
    assert stored[0].confidence == 0.6
    assert stored[0].reinforcement_count == 2
    assert stored[0].last_reinforced_at == NOW + timedelta(days=1)


async def test_history_keeps_events_in_order_with_their_fields(pg_store: PostgresStore) -> None:
    events = [
        event("tool_affinity:a", kind=FactEventKind.CREATED),
        event("tool_affinity:b", kind=FactEventKind.CREATED, session_id=None),
        event("tool_affinity:a", kind=FactEventKind.EXTENDED, at=NOW + timedelta(minutes=5)),
        event("tool_affinity:b", kind=FactEventKind.EXPIRED, session_id=None),
    ]
    async with pg_store.consolidation("alice") as unit:
        await unit.load()
        await unit.apply(plan(events=events))
        await unit.commit()

    assert await pg_store.history("alice") == events
    assert await pg_store.history("alice", "tool_affinity:a") == [events[0], events[2]]
    assert await pg_store.history("alice", "tool_affinity:zzz") == []


async def test_load_returns_reinforcing_events_of_the_new_sessions_only(
    pg_store: PostgresStore,
) -> None:
    earlier = [
        event("tool_affinity:a", session_id="s1", kind=FactEventKind.CREATED),
        event("tool_affinity:a", session_id="s2", kind=FactEventKind.REINFORCED),
        event("tool_affinity:b", session_id="s1", kind=FactEventKind.EXPIRED),
        event("tool_affinity:c", session_id="s1", kind=FactEventKind.EXTENDED),
        event("tool_affinity:d", session_id="s3", kind=FactEventKind.CREATED),
        event("tool_affinity:a", session_id="s1", kind=FactEventKind.CREATED, identity_id="bob"),
    ]
    for identity in ("alice", "bob"):
        async with pg_store.consolidation(identity) as unit:
            await unit.load()
            mine = [e for e in earlier if e.identity_id == identity]
            await unit.apply(plan(identity, events=mine))
            await unit.commit()
    await pg_store.append(
        [record(session_id="s1"), record(session_id="s3"), record(session_id=None)]
    )

    async with pg_store.consolidation("alice") as unit:
        loaded = await unit.load()

    assert loaded.session_events == [earlier[0], earlier[3], earlier[4]]


async def test_apply_refuses_a_plan_for_another_identity(pg_store: PostgresStore) -> None:
    async with pg_store.consolidation("alice") as unit:
        await unit.load()
        with pytest.raises(ValueError, match="bob"):
            await unit.apply(plan("bob"))
        with pytest.raises(ValueError, match="bob"):
            await unit.apply(plan(upserts=[fact(identity_id="bob")]))


async def test_apply_needs_load_first(pg_store: PostgresStore) -> None:
    async with pg_store.consolidation("alice") as unit:
        with pytest.raises(RuntimeError, match="load"):
            await unit.apply(plan())


async def _populate(store: PostgresStore, identity: str) -> None:
    await store.append([record(identity, identity_id=identity)])
    async with store.consolidation(identity) as unit:
        await unit.load()
        await unit.apply(
            plan(
                identity,
                upserts=[fact(identity_id=identity)],
                events=[event(identity_id=identity)],
                consumed=1,
            )
        )
        await unit.commit()
    # One more observation, not consolidated yet.
    await store.append([record(f"{identity} later", identity_id=identity)])


async def test_forget_removes_only_that_identity(pg_store: PostgresStore) -> None:
    await _populate(pg_store, "alice")
    await _populate(pg_store, "bob")
    bob_before = (
        await pg_store.facts("bob"),
        await pg_store.history("bob"),
        await pg_store.observations("bob"),
        await pg_store.checkpoint("bob"),
    )

    port: MemoryStore = pg_store  # mypy checks that the store implements the port
    await port.forget("alice")

    assert await pg_store.facts("alice") == []
    assert await pg_store.history("alice") == []
    assert await pg_store.observations("alice") == []
    assert await pg_store.checkpoint("alice") is None
    bob_after = (
        await pg_store.facts("bob"),
        await pg_store.history("bob"),
        await pg_store.observations("bob"),
        await pg_store.checkpoint("bob"),
    )
    assert bob_after == bob_before
    assert bob_after[0] and bob_after[1] and bob_after[2] and bob_after[3] is not None


async def test_an_identity_starts_afresh_after_forget(pg_store: PostgresStore) -> None:
    await _populate(pg_store, "alice")
    await pg_store.forget("alice")
    await pg_store.append([record("after forget")])

    loaded = await consolidate(pg_store)

    assert contents(loaded.observations) == ["after forget"]
    assert loaded.facts == []


TRICKY_IDENTITIES = ["a'; DROP TABLE x; --", "%", "_", "A", "a", "a%", "a\\", ""]


async def test_identity_ids_are_compared_exactly(pg_store: PostgresStore) -> None:
    for identity in TRICKY_IDENTITIES:
        await pg_store.append([record(f"obs of {identity!r}", identity_id=identity)])
        await consolidate(pg_store, identity, upserts=[fact(identity_id=identity)])

    for identity in TRICKY_IDENTITIES:
        assert contents(await pg_store.observations(identity)) == [f"obs of {identity!r}"]
        assert [f.identity_id for f in await pg_store.facts(identity)] == [identity]

    await pg_store.forget("%")

    assert await pg_store.facts("%") == []
    for identity in TRICKY_IDENTITIES:
        if identity != "%":
            assert [f.identity_id for f in await pg_store.facts(identity)] == [identity]
    tables = await fetch(
        pg_store.engine.url.render_as_string(hide_password=False),
        "SELECT count(*) FROM pg_tables WHERE schemaname = 'coda_memory'",
    )
    assert tables == [(len(metadata.tables) + 1,)]  # and alembic_version


async def test_a_custom_schema_holds_everything(empty_pg_url: str) -> None:
    await migrate_async(empty_pg_url, schema="tenant_one")
    store = PostgresStore.from_url(empty_pg_url, schema="tenant_one")
    try:
        await store.append([record("in tenant_one")])
        loaded = await consolidate(store, upserts=[fact()])
        assert contents(loaded.observations) == ["in tenant_one"]
        assert [f.subject for f in await store.facts("alice")] == [fact().subject]
    finally:
        await store.close()

    rows = await fetch(
        empty_pg_url,
        "SELECT count(*) FROM tenant_one.observations WHERE content = :content",
        content="in tenant_one",
    )
    assert rows == [(1,)]
    assert await fetch(
        empty_pg_url, "SELECT count(*) FROM pg_namespace WHERE nspname = 'coda_memory'"
    ) == [(0,)]


async def test_the_default_schema_is_not_migrated_by_a_custom_one(empty_pg_url: str) -> None:
    await migrate_async(empty_pg_url, schema="tenant_one")
    store = PostgresStore.from_url(empty_pg_url)
    try:
        with pytest.raises(SchemaNotMigrated, match="coda_memory"):
            await store.facts("alice")
    finally:
        await store.close()


async def test_an_unmigrated_database_raises_schema_not_migrated(empty_pg_url: str) -> None:
    store = PostgresStore.from_url(empty_pg_url)
    try:
        with pytest.raises(SchemaNotMigrated):
            await store.append([record()])
        with pytest.raises(SchemaNotMigrated):
            await store.facts("alice")
        with pytest.raises(SchemaNotMigrated):
            await store.history("alice")
        with pytest.raises(SchemaNotMigrated):
            await store.forget("alice")
        with pytest.raises(SchemaNotMigrated):
            async with store.consolidation("alice"):
                pass
    finally:
        await store.close()


def test_invalid_schema_names_are_refused() -> None:
    for bad in ("coda-memory", "x; DROP TABLE y", "Upper", "pg_catalog", "1abc", "", "a" * 64):
        with pytest.raises(ValueError, match="schema name"):
            PostgresStore.from_url("postgresql://localhost/db", schema=bad)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:p@db.example:5433/app",
        "postgres://u:p@db.example:5433/app",
        "postgresql+asyncpg://u:p@db.example:5433/app",
    ],
)
def test_urls_are_normalised_to_asyncpg(url: str) -> None:
    normalised = asyncpg_url(url)

    assert normalised.drivername == "postgresql+asyncpg"
    assert (normalised.host, normalised.port, normalised.database) == ("db.example", 5433, "app")


def test_unix_socket_and_sslmode_urls() -> None:
    socket = asyncpg_url("postgresql://postgres:@/postgres?host=/tmp/pg dir")
    assert socket.query == {"host": "/tmp/pg dir"}
    assert socket.host is None
    assert asyncpg_url("postgresql://h/db?sslmode=require").query == {"ssl": "require"}
    with pytest.raises(ValueError, match="mysql"):
        asyncpg_url("mysql://h/db")
