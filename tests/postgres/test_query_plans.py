"""Plan regressions: the analytics, rollup and peek statements use the indexes they rely on.

The database gets enough rows (a year of rollup, tens of thousands of facts and
observations) and fresh statistics for the planner to choose the indexes on its own; no
planner setting is changed. Each test runs the real function, records the statements it
sent, and checks ``EXPLAIN (FORMAT JSON)`` of each with the same parameters.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import event, make_url, pool, text
from sqlalchemy.ext.asyncio import create_async_engine

from benchmarks.replay import SqlCapture, literal
from coda_memory import MemoryService
from coda_memory.postgres import PostgresStore
from coda_memory.postgres.analytics import (
    domain_trends,
    entity_popularity,
    fact_summary,
    tool_effectiveness,
)
from coda_memory.postgres.engine import driver_connection
from coda_memory.postgres.migrate import migrate_async
from coda_memory.postgres.rollup_batch import batch_statements
from coda_memory.postgres.store import GENERIC_PLANS
from coda_memory.postgres.unit import Statements
from tests.postgres.helpers import consolidate, prepared_plans, record

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

#: A year of rollup (40 tools, 400 entities, 6 domains, 8 shards) and its per-identity rows
#: for 5,000 identities; 40,000 facts over 5,000 identities (30 % entities, 20 % affinities,
#: 10 % avoidances, 40 % domains); 100,000 observations over 2,000 identities; and one
#: identity with 60,000 fact events in one session.
LOAD = [
    """
    INSERT INTO coda_memory.tool_daily
    SELECT DATE '2026-03-01' - d, 'tool_' || t, s, 50, 5, 2
    FROM generate_series(0, 364) d, generate_series(1, 40) t, generate_series(0, 7) s
    """,
    """
    INSERT INTO coda_memory.tool_durations
    SELECT DATE '2026-03-01' - d, 'tool_' || t, s, b, 7
    FROM generate_series(0, 364) d, generate_series(1, 40) t, generate_series(0, 1) s,
         generate_series(20, 23) b
    """,
    """
    INSERT INTO coda_memory.entity_daily
    SELECT DATE '2026-03-01' - d, 'account', 'acct-' || e, 3, 1
    FROM generate_series(0, 364) d, generate_series(1, 400) e
    """,
    """
    INSERT INTO coda_memory.domain_daily
    SELECT DATE '2026-03-01' - d, 'domain_' || m, s, 9, 4
    FROM generate_series(0, 364) d, generate_series(1, 6) m, generate_series(0, 7) s
    """,
    """
    INSERT INTO coda_memory.facts (identity_id, subject, category, content, confidence,
        reinforcement_count, last_reinforced_at, confidence_at, created_at, updated_at)
    SELECT 'user-' || (n % 5000), category || ':' || key, category, 'a fact',
           0.2 + (n % 80) / 100.0, 1, at, at, at, at
    FROM generate_series(0, 39999) n,
    LATERAL (SELECT TIMESTAMPTZ '2026-03-01 12:00+00' - (n % 20) * INTERVAL '1 day' AS at) a,
    LATERAL (
        SELECT CASE WHEN n % 10 < 3 THEN 'entity_frequency'
                    WHEN n % 10 < 5 THEN 'tool_affinity'
                    WHEN n % 10 < 6 THEN 'tool_avoidance'
                    ELSE 'domain_preference' END AS category,
               CASE WHEN n % 10 < 3 THEN 'account:acct-' || (n / 10 % 400)
                    WHEN n % 10 < 6 THEN 'tool_' || (n / 10 % 40)
                    ELSE 'domain_' || (n / 10 % 6) END || ':' || (n / 5000) AS key
    ) c
    """,
    """
    INSERT INTO coda_memory.observations (identity_id, type, content, metadata, created_at)
    SELECT 'user-' || (n % 2000), 'tool_success', 'ok',
           jsonb_build_object('toolName', 'tool_' || (n % 40)),
           TIMESTAMPTZ '2026-03-01 12:00+00' - (n % 7) * INTERVAL '1 day'
    FROM generate_series(1, 100000) n
    """,
    # One identity whose 60,000 fact events all fall in one session, so that the sampled
    # statistics see a single session in the table; 20 of its observations from new
    # sessions wait.
    """
    INSERT INTO coda_memory.fact_events (identity_id, subject, category, kind, session_id,
        at, hits, trials, recorded_at)
    SELECT 'user-skew', 'domain_preference:domain_' || n, 'domain_preference', 'created',
           'skew-s0', TIMESTAMPTZ '2026-02-01 12:00+00', 1, 1, TIMESTAMPTZ '2026-02-01 12:00+00'
    FROM generate_series(1, 60000) n
    """,
    """
    INSERT INTO coda_memory.observations (identity_id, type, content, metadata, session_id,
        created_at)
    SELECT 'user-skew', 'query_pattern', 'asked', jsonb_build_object('domain', 'domain_1'),
           'skew-new-' || n, TIMESTAMPTZ '2026-03-01 11:00+00'
    FROM generate_series(1, 20) n
    """,
    """
    INSERT INTO coda_memory.tool_users
    SELECT 'user-' || u, 'tool_' || t, DATE '2026-03-01' - (u % 30), NULL
    FROM generate_series(0, 4999) u, generate_series(1, 10) t
    """,
    """
    INSERT INTO coda_memory.entity_users
    SELECT 'user-' || u, 'account', 'acct-' || e, DATE '2026-03-01' - (u % 30), NULL
    FROM generate_series(0, 4999) u, generate_series(1, 10) e
    """,
    """
    INSERT INTO coda_memory.domain_users
    SELECT 'user-' || u, 'domain_' || m, DATE '2026-03-01' - d
    FROM generate_series(0, 4999) u, generate_series(1, 2) m, generate_series(0, 4) d
    """,
]


async def _load(url: str) -> None:
    await migrate_async(url)
    own = create_async_engine(url, poolclass=pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        async with own.connect() as conn:
            for statement in LOAD:
                await conn.execute(text(statement))
            # Statistics, and a visibility map for index-only scans.
            await conn.execute(text("VACUUM ANALYZE"))
    finally:
        await own.dispose()


async def _admin(url: str, statement: str) -> None:
    own = create_async_engine(url, poolclass=pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        async with own.connect() as conn:
            await conn.execute(text(statement))
    finally:
        await own.dispose()


@pytest.fixture(scope="module")
def loaded_url(admin_url: str) -> Iterator[str]:
    """One loaded database for the module: loading takes seconds, and the plans only
    read it (the append and forget tests change a handful of rows)."""
    name = f"coda_memory_plans_{os.getpid()}_{secrets.token_hex(3)}"
    server = make_url(admin_url)
    # The name is made here from the pid and random hex digits.
    asyncio.run(_admin(admin_url, f'CREATE DATABASE "{name}"'))
    try:
        url = server.set(database=name).render_as_string(hide_password=False)
        asyncio.run(_load(url))
        yield url
    finally:
        asyncio.run(_admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
async def loaded(loaded_url: str) -> AsyncIterator[PostgresStore]:
    store = PostgresStore.from_url(loaded_url)
    try:
        yield store
    finally:
        await store.close()


class Recorder:
    """The statements (and their parameters) an engine sends while recording."""

    def __init__(self, store: PostgresStore) -> None:
        self.statements: list[tuple[str, Any]] = []
        self._engine = store.engine.sync_engine

    def _record(self, conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        self.statements.append((statement, parameters))

    def __enter__(self) -> Recorder:
        event.listen(self._engine, "before_cursor_execute", self._record)
        return self

    def __exit__(self, *exc_info: object) -> None:
        event.remove(self._engine, "before_cursor_execute", self._record)


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


async def plans_of(
    store: PostgresStore, work: Callable[[], Awaitable[Any]], *, keep: Callable[[str], bool]
) -> list[list[dict[str, Any]]]:
    """Run ``work``, then EXPLAIN each statement it sent that ``keep`` selects, replaying
    the others (the analytics settings) first in the same transaction."""
    with Recorder(store) as recorder:
        await work()
    plans: list[list[dict[str, Any]]] = []
    async with store.engine.connect() as conn:
        for statement, parameters in recorder.statements:
            if not keep(statement):
                if statement.lstrip().upper().startswith("SELECT SET_CONFIG"):
                    await conn.exec_driver_sql(statement, parameters)
                continue
            result = await conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", parameters)
            raw = result.scalar_one()
            explained = json.loads(raw) if isinstance(raw, str) else raw
            plans.append(list(plan_nodes(explained[0]["Plan"])))
        await conn.rollback()
    assert plans, "the work sent no statement to explain"
    return plans


def indexes(nodes: list[dict[str, Any]]) -> set[str]:
    return {str(n["Index Name"]) for n in nodes if "Index Name" in n}


def scanned(nodes: list[dict[str, Any]]) -> set[str]:
    """Relations read by a sequential scan."""
    return {str(n["Relation Name"]) for n in nodes if n["Node Type"] == "Seq Scan"}


def analytics(statement: str) -> bool:
    # (Not the settings, nor the check of entity_popularity that the role may read the
    # facts.)
    return "set_config" not in statement and "has_table_privilege" not in statement


async def test_tool_effectiveness_reads_the_window_and_the_tool_facts_by_index(
    loaded: PostgresStore,
) -> None:
    [nodes] = await plans_of(loaded, lambda: tool_effectiveness(loaded, now=NOW), keep=analytics)

    assert {"pk_tool_daily", "pk_tool_durations", "ix_facts_category_subject"} <= indexes(nodes)
    assert not scanned(nodes) & {"tool_daily", "tool_durations", "facts"}


async def test_entity_popularity_reads_the_window_and_the_entity_facts_by_index(
    loaded: PostgresStore,
) -> None:
    [nodes] = await plans_of(loaded, lambda: entity_popularity(loaded, now=NOW), keep=analytics)

    assert {"pk_entity_daily", "ix_facts_category_subject"} <= indexes(nodes)
    assert not scanned(nodes) & {"entity_daily", "facts"}


async def test_domain_trends_read_the_window_by_index(loaded: PostgresStore) -> None:
    [nodes] = await plans_of(loaded, lambda: domain_trends(loaded, now=NOW), keep=analytics)

    assert "pk_domain_daily" in indexes(nodes)
    assert "domain_daily" not in scanned(nodes)


async def test_fact_summary_counts_identities_in_index_order(loaded: PostgresStore) -> None:
    [nodes] = await plans_of(loaded, lambda: fact_summary(loaded, now=NOW), keep=analytics)

    assert "ix_facts_category_identity_id" in indexes(nodes)


async def test_the_rollup_reads_back_the_batch_by_index(loaded: PostgresStore) -> None:
    batch = [
        record("ok", identity_id="user-7", metadata={"toolName": "tool_1", "durationMs": 3}),
        record("ok", identity_id="user-8", metadata={"toolName": "tool_2"}),
    ]

    await loaded.append(batch)
    # The statements append runs, compiled once (rollup_batch.batch_statements), with the batch's
    # identities; appends send them through the driver, so they are explained directly.
    plans: list[list[dict[str, Any]]] = []
    async with loaded.engine.connect() as conn:
        driver = await driver_connection(conn)
        for statement in batch_statements(loaded.schema):
            arguments = statement.arguments(["user-7", "user-8"], 0)
            raw = await driver.fetchval(f"EXPLAIN (FORMAT JSON) {statement.sql}", *arguments)
            explained = json.loads(raw) if isinstance(raw, str) else raw
            plans.append(list(plan_nodes(explained[0]["Plan"])))
        await conn.rollback()

    assert len(plans) == 3
    for nodes in plans:
        assert "ix_observations_identity_id_xid" in indexes(nodes)
        assert "observations" not in scanned(nodes)


async def test_forget_deletes_the_rollup_rows_by_primary_key(loaded: PostgresStore) -> None:
    plans = await plans_of(
        loaded, lambda: loaded.forget("user-7"), keep=lambda s: "_users" in s and "DELETE" in s
    )

    # Three deletes, twice: before the observations' delete and again after it.
    assert len(plans) == 6
    assert {"pk_tool_users", "pk_entity_users", "pk_domain_users"} <= set().union(
        *(indexes(nodes) for nodes in plans)
    )
    assert "tool_users" not in set().union(*(scanned(nodes) for nodes in plans))


def rows_read(nodes: list[dict[str, Any]], relation: str) -> int:
    """Rows the scans of ``relation`` produced or filtered out (a bitmap index scan's
    rows reach its heap scan, which names the relation)."""
    read = 0
    for node in nodes:
        if node.get("Relation Name") != relation:
            continue
        read += int(node.get("Actual Rows", 0)) * int(node.get("Actual Loops", 1))
        read += int(node.get("Rows Removed by Filter", 0))
        read += int(node.get("Rows Removed by Index Recheck", 0))
    return read


async def test_the_peek_reads_the_unconsumed_tail_not_the_identitys_history(
    loaded: PostgresStore,
) -> None:
    # user-11 has 50 observations; a consolidation consumes them all.
    assert len((await consolidate(loaded, "user-11", now=NOW)).observations) == 50
    peek = Statements.for_schema(loaded.schema).peek
    async with loaded.engine.connect() as conn:
        driver = await driver_connection(conn)
        raw = await driver.fetchval(
            f"EXPLAIN (ANALYZE, FORMAT JSON) {peek.text}",
            *peek.arguments(identity_id="user-11", known_version=None, read_limit=None),
        )
        await conn.rollback()
    explained = json.loads(raw) if isinstance(raw, str) else raw
    nodes = list(plan_nodes(explained[0]["Plan"]))

    # Nothing waits, so the check reads nothing: the stored snapshot bounds the
    # (identity_id, xid) range instead of filtering each of the 50 rows.
    assert "ix_observations_identity_id_xid" in indexes(nodes)
    assert rows_read(nodes, "observations") == 0


async def test_the_check_for_earlier_sessions_probes_the_index_however_skewed_they_are(
    loaded: PostgresStore,
) -> None:
    """The events of one session are nearly all the table's, and the planner is told
    (migration 0010) that a session holds few events: the check for each waiting
    observation's session is an index probe, not a scan of the identity's 60,000 events
    for each of them."""
    new = Statements.for_schema(loaded.schema).new_first
    async with loaded.engine.connect() as conn:
        driver = await driver_connection(conn)
        raw = await driver.fetchval(
            f"EXPLAIN (ANALYZE, FORMAT JSON) {new.text}", *new.arguments(identity_id="user-skew")
        )
        await conn.rollback()
    explained = json.loads(raw) if isinstance(raw, str) else raw
    nodes = list(plan_nodes(explained[0]["Plan"]))
    assert "fact_events" not in scanned(nodes)
    assert rows_read(nodes, "fact_events") == 0
    assert rows_read(nodes, "observations") == 20


async def _peek_plan(
    store: PostgresStore, identity_id: str, known_version: str | None, read_limit: int | None
) -> tuple[list[dict[str, Any]], list[Any]]:
    """The peek's executed plan nodes, and its rows."""
    peek = Statements.for_schema(store.schema).peek
    arguments = peek.arguments(
        identity_id=identity_id, known_version=known_version, read_limit=read_limit
    )
    async with store.engine.connect() as conn:
        driver = await driver_connection(conn)
        raw = await driver.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {peek.text}", *arguments)
        rows = await driver.fetch(peek.text, *arguments)
        await conn.rollback()
    explained = json.loads(raw) if isinstance(raw, str) else raw
    return list(plan_nodes(explained[0]["Plan"])), rows


async def test_the_peek_reads_no_fact_when_the_caller_knows_their_version(
    loaded: PostgresStore,
) -> None:
    # user-12 has 8 facts; a consolidation gives it a checkpoint, hence a version.
    await consolidate(loaded, "user-12", now=NOW)
    facts = len(await loaded.facts("user-12"))
    assert facts == 8
    nodes, rows = await _peek_plan(loaded, "user-12", None, None)
    assert rows_read(nodes, "facts") >= facts and len(rows) == facts
    version = rows[0]["version"]
    # The version known: the scan of the facts is gated off before it runs.
    nodes, rows = await _peek_plan(loaded, "user-12", version, None)
    assert rows_read(nodes, "facts") == 0
    assert [r["subject"] for r in rows] == [None]
    # Over the read limit: the facts are counted up to one past it, and none is sent.
    nodes, rows = await _peek_plan(loaded, "user-12", None, 5)
    assert rows_read(nodes, "facts") <= 6
    assert [(r["over"], r["subject"]) for r in rows] == [(True, None)]


async def generic_plan(driver: Any, query: str, arguments: Sequence[Any]) -> list[dict[str, Any]]:
    """The nodes of the plan that ``query`` runs on when planned for any value of its
    parameters (``plan_cache_mode = force_generic_plan``), as ``EXPLAIN EXECUTE`` of it
    prepared with the parameter types the server infers; nothing is executed. (``EXECUTE``
    takes no bound parameter: the values go as typed literals, as the replay writes them.)"""
    parameters = (await driver.prepare(query)).get_parameters()
    types = ", ".join(f"{p.schema}.{p.name}" for p in parameters)
    literals = ", ".join(
        literal(value, p.schema, p.name) for value, p in zip(arguments, parameters, strict=True)
    )
    async with driver.transaction():
        await driver.execute(GENERIC_PLANS)
        await driver.execute(f"PREPARE generic_probe ({types}) AS {query}")
        try:
            raw = await driver.fetchval(f"EXPLAIN (FORMAT JSON) EXECUTE generic_probe ({literals})")
        finally:
            await driver.execute("DEALLOCATE generic_probe")
    explained = json.loads(raw) if isinstance(raw, str) else raw
    return list(plan_nodes(explained[0]["Plan"]))


def consolidation_service(store: PostgresStore) -> MemoryService:
    return MemoryService(store, clock=lambda: NOW)


async def test_a_consolidation_plans_its_statements_once_per_connection(
    loaded_url: str,
) -> None:
    """Postgres would plan the write again at every consolidation, with that run's values
    (it judges that cheaper than a plan for any value): the consolidation's transaction
    asks for the generic plans, made once per connection."""
    store = PostgresStore.from_url(loaded_url, pool_size=1)
    service = consolidation_service(store)
    try:
        for identity in ("user-14", "user-15", "user-16"):  # 50 observations waiting each
            assert await service.consolidate(identity)
        async with store.request_engine.connect() as conn:
            plans = await prepared_plans(await driver_connection(conn))
    finally:
        await service.close()
    assert plans[Statements.for_schema(store.schema).write.text] == (3, 0)


async def test_a_consolidations_generic_plans_read_the_identitys_rows_by_index(
    loaded: PostgresStore,
) -> None:
    """Planned for any identity, each statement of a consolidation still reaches the
    identity's facts, observations and events through its indexes: no scan of a table
    that holds every identity's rows."""
    service = consolidation_service(loaded)
    with SqlCapture() as sent:
        assert await service.consolidate("user-17")
    statements = Statements.for_schema(loaded.schema)
    expected = {statements.lock.text, statements.new_first.text, statements.write.text}
    hot_path = {s.text for s in statements.all()}
    explained = [(q, a) for q, a in sent.calls if q in hot_path]
    assert expected <= {q for q, _ in explained}
    async with loaded.engine.connect() as conn:
        driver = await driver_connection(conn)
        for query, arguments in explained:
            nodes = await generic_plan(driver, query, arguments)
            assert not scanned(nodes) & {"facts", "observations", "fact_events"}, query
        await conn.rollback()
