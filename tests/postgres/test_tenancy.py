"""Tenant isolation in the database: row-level security and the three kinds of role.

Superusers bypass row-level security, so these tests create roles of their own (unique
per run, dropped afterwards), none a superuser: an owner that migrates a schema of its
own, an ``app`` role the service runs as, and an ``analyst`` role. A connection takes a
role with the ``role`` server setting, as ``SET ROLE`` would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

import asyncpg
import pytest
from alembic import command
from sqlalchemy import Connection, pool, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine
from typer.testing import CliRunner

from coda_memory import MemoryService
from coda_memory import analytics as coda_analytics
from coda_memory.cli import app
from coda_memory.errors import AccessDenied
from coda_memory.postgres import PostgresStore, analytics, maintenance
from coda_memory.postgres.engine import create_engine, driver_connection
from coda_memory.postgres.migrate import alembic_config
from coda_memory.postgres.schema import validate_schema_name
from coda_memory.postgres.tenancy import (
    ALL_IDENTITIES,
    SET_TENANT_SESSION,
    apply_grants,
    grant_script,
    quote_role,
    tenancy_sql,
)
from coda_memory.postgres.unit import Statements
from tests.helpers import FakeClock, domain, entity, tool_failed, tool_ok
from tests.postgres.helpers import dsn, prepared_plans, superuser, table_digests
from tests.postgres.test_analytics import D1, call
from tests.postgres.test_migrations import HEAD
from tests.postgres.test_query_plans import Recorder, plan_nodes

SCHEMA = "tenancy"
PER_IDENTITY = (
    "observations",
    "facts",
    "fact_events",
    "checkpoints",
    "tool_users",
    "entity_users",
    "domain_users",
)
#: Per-identity too: the import ledger, written by the owner's import (forget deletes).
LEDGER = ("redis_imports",)
AGGREGATE_TABLES = ("tool_daily", "tool_durations", "entity_daily", "domain_daily")
AGGREGATE_VIEWS = (
    "analytics_window",
    "tool_effectiveness",
    "entity_popularity",
    "domain_trends",
    "fact_summary",
)
#: What the app role may update and delete (no UPDATE on the append-only tables).
UPDATABLE = ("facts", "checkpoints", "tool_users", "entity_users", "domain_users")


@dataclass(frozen=True)
class Tenancy:
    url: str
    owner: str
    app: str
    analyst: str

    def as_role(self, role: str, **settings: str) -> dict[str, Any]:
        """Engine options for connections that act as ``role``."""
        return {"connect_args": {"server_settings": {"role": role, **settings}}}

    async def connect(self, role: str, **settings: str) -> asyncpg.Connection:
        return await asyncpg.connect(dsn(self.url), server_settings={"role": role, **settings})


def _upgrade(connection: Connection) -> None:
    config = alembic_config(schema=SCHEMA)
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


@pytest.fixture
async def tenancy(pg_url: str) -> AsyncIterator[Tenancy]:
    """Schema ``tenancy`` migrated by a non-superuser owner, with an app and an analyst
    role granted by the owner."""
    suffix = secrets.token_hex(4)
    names = Tenancy(pg_url, f"coda_owner_{suffix}", f"coda_app_{suffix}", f"coda_analyst_{suffix}")
    roles = (names.owner, names.app, names.analyst)
    database = make_url(pg_url).database
    await superuser(
        pg_url,
        *(f'CREATE ROLE "{role}" NOLOGIN' for role in roles),
        f'GRANT CREATE ON DATABASE "{database}" TO "{names.owner}"',
    )
    try:
        owner = create_async_engine(pg_url, poolclass=pool.NullPool, **names.as_role(names.owner))
        try:
            async with owner.connect() as conn:
                await conn.run_sync(_upgrade)
                await conn.commit()
                driver = (await conn.get_raw_connection()).driver_connection
                await apply_grants(driver, "app", names.app, SCHEMA)
                await apply_grants(driver, "analyst", names.analyst, SCHEMA)
        finally:
            await owner.dispose()
        yield names
    finally:
        await superuser(
            pg_url,
            f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE',
            *(f'DROP OWNED BY "{role}"' for role in roles),
            *(f'DROP ROLE "{role}"' for role in roles),
        )


async def _populate(t: Tenancy) -> None:
    """alice and bob use the service, which runs as the app role."""
    clock = FakeClock()
    service = MemoryService.from_url(
        t.url, schema=SCHEMA, clock=clock, load_timeout=5.0, **t.as_role(t.app)
    )
    try:
        for who in ("alice", "bob"):
            service.emit_observation(who, tool_ok(f"tool_{who}"))
            service.emit_observation(who, tool_failed("run_sql"))
            service.emit_observation(who, entity("account", f"acct-{who}"))
            service.emit_observation(who, domain("royalty"))
        await service.drain()
        assert service.stats().stored == 8
        # bob is consolidated first, without the read that load_memory does first.
        await service.consolidate("bob")
        for who in ("alice", "bob"):
            loaded = await service.load_memory(who)
            subjects = {f.subject for f in loaded.facts}
            assert f"tool_affinity:tool_{who}" in subjects
            assert {f.identity_id for f in loaded.facts} == {who}
    finally:
        await service.close()


async def _count(conn: asyncpg.Connection, table: str, where: str = "true") -> int:
    count: int = await conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.{table} WHERE {where}")
    return count


async def test_the_app_role_sees_and_changes_one_identity_only(tenancy: Tenancy) -> None:
    await _populate(tenancy)
    superuser = await asyncpg.connect(dsn(tenancy.url))
    app_conn = await tenancy.connect(tenancy.app)
    try:
        before = {t: await _count(superuser, t, "identity_id = 'bob'") for t in PER_IDENTITY}
        assert all(before.values()), before
        # Without a tenant: nothing at all.
        for table in PER_IDENTITY:
            assert await _count(app_conn, table) == 0, table
        async with app_conn.transaction():
            await app_conn.execute(
                "SELECT set_config('coda_memory.identity_id', $1, true)", "alice"
            )
            for table in PER_IDENTITY:
                assert await _count(app_conn, table, "identity_id = 'alice'") > 0, table
                assert await _count(app_conn, table, "identity_id = 'bob'") == 0, table
                assert await _count(app_conn, table, "identity_id <> 'alice'") == 0, table
                deleted = await app_conn.execute(
                    f"DELETE FROM {SCHEMA}.{table} WHERE identity_id = 'bob'"
                )
                assert deleted == "DELETE 0", table
            for table in UPDATABLE:
                updated = await app_conn.execute(
                    f"UPDATE {SCHEMA}.{table} SET identity_id = identity_id "
                    "WHERE identity_id = 'bob'"
                )
                assert updated == "UPDATE 0", table
            # Nor can it write a row of another tenant.
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await app_conn.execute(
                    f"INSERT INTO {SCHEMA}.facts VALUES ('bob', 'domain_preference:x', "
                    "'domain_preference', 'x', 0.5, 1, now(), now(), now(), now(), null)"
                )
        after = {t: await _count(superuser, t, "identity_id = 'bob'") for t in PER_IDENTITY}
        assert after == before
    finally:
        await app_conn.close()
        await superuser.close()


async def test_a_connection_whose_tenant_was_reset_sees_no_row_of_the_empty_identity(
    tenancy: Tenancy,
) -> None:
    # RESET leaves the setting empty, not missing, and the policy of 0004 compared
    # identity_id with it: rows of the empty identity (which stores wrote before they
    # refused it) were the tenant's of every connection whose tenant had been reset.
    await _populate(tenancy)
    await superuser(
        tenancy.url,
        f"INSERT INTO {SCHEMA}.facts VALUES ('', 'domain_preference:x', "
        "'domain_preference', 'x', 0.5, 1, now(), now(), now(), now(), null)",
        f"INSERT INTO {SCHEMA}.observations (identity_id, type, content, created_at) "
        "VALUES ('', 'query_pattern', 'q', now())",
    )
    app_conn = await tenancy.connect(tenancy.app)
    try:
        await app_conn.execute("SELECT set_config('coda_memory.identity_id', 'alice', false)")
        assert await _count(app_conn, "facts") > 0
        await app_conn.execute("RESET coda_memory.identity_id")
        assert (
            await app_conn.fetchval("SELECT current_setting('coda_memory.identity_id', true)") == ""
        )
        for table in PER_IDENTITY:
            assert await _count(app_conn, table) == 0, table
        # Nor may it write a row of the empty identity.
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await app_conn.execute(
                f"INSERT INTO {SCHEMA}.facts VALUES ('', 'domain_preference:y', "
                "'domain_preference', 'y', 0.5, 1, now(), now(), now(), now(), null)"
            )
    finally:
        await app_conn.close()


async def tenant_and_facts_seen(conn: Any) -> tuple[str | None, int]:
    """The tenant a connection holds, and how many facts it sees."""
    row = (
        await conn.execute(
            text(
                "SELECT current_setting('coda_memory.identity_id', true),"
                f" (SELECT count(*) FROM {SCHEMA}.facts)"
            )
        )
    ).one()
    return row[0], row[1]


async def test_a_store_on_one_engine_leaves_no_tenant_on_its_connections(
    tenancy: Tenancy,
) -> None:
    # load_memory's lock-free read sets the tenant for the connection's session. On a
    # store made on one engine, whose other work sets no tenant, the next such work on
    # that connection saw (and could write) the identity last read: every_observation()
    # gave alice's rows, and run() her facts.
    await _populate(tenancy)
    engine = create_engine(
        tenancy.url, schema=SCHEMA, pool_size=1, max_overflow=0, **tenancy.as_role(tenancy.app)
    )
    store = PostgresStore(engine, schema=SCHEMA)
    service = MemoryService(store, clock=FakeClock(), load_timeout=5.0)

    try:
        for who in ("alice", "bob"):
            assert (await service.load_memory(who)).facts
            assert await store.every_observation() == []
            tenant, facts = await store.run(tenant_and_facts_seen)
            assert (tenant or "", facts) == ("", 0)
    finally:
        await service.close()


async def test_a_read_cancelled_as_it_sets_the_tenant_leaves_no_tenant_on_the_connection(
    tenancy: Tenancy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled once the server applied the session's tenant (the reply on its way), a
    read on a store made on one engine gave its connection back to the pool with the
    identity set: the next work that sets none saw her rows."""
    await _populate(tenancy)
    engine = create_engine(
        tenancy.url, schema=SCHEMA, pool_size=1, max_overflow=0, **tenancy.as_role(tenancy.app)
    )
    store = PostgresStore(engine, schema=SCHEMA)
    execute = asyncpg.Connection.execute
    armed = [True]

    async def cancelled_once_applied(self: asyncpg.Connection, query: str, *args: Any) -> Any:
        result = await execute(self, query, *args)
        if query == SET_TENANT_SESSION and armed[0]:
            armed[0] = False
            raise asyncio.CancelledError
        return result

    monkeypatch.setattr(asyncpg.Connection, "execute", cancelled_once_applied)
    try:
        with pytest.raises(asyncio.CancelledError):
            await store.peek("alice")
        assert not armed[0]
        tenant, facts = await store.run(tenant_and_facts_seen)
        assert (tenant or "", facts) == ("", 0)
    finally:
        await store.close()


async def test_a_read_a_held_table_keeps_out_gives_back_no_dead_connection(
    tenancy: Tenancy,
) -> None:
    """On a store made on one engine, a read that failed is not given back (its session's
    tenant may be set): its connection was closed and given back to the pool all the
    same, so the next work met a dead connection and the whole pool was replaced, the
    old one's idle connections left open, once for every peek a held table kept out."""
    await _populate(tenancy)
    engine = create_engine(
        tenancy.url,
        schema=SCHEMA,
        pool_size=1,
        max_overflow=0,
        connect_args={"server_settings": {"lock_timeout": "50ms"}},
    )
    store = PostgresStore(engine, schema=SCHEMA)
    admin = await asyncpg.connect(dsn(tenancy.url))
    try:
        assert (await store.peek("alice"))[0]  # the pool's one connection, in use once
        pool_before = engine.pool
        await admin.execute("BEGIN")
        await admin.execute(f"LOCK TABLE {SCHEMA}.checkpoints IN ACCESS EXCLUSIVE MODE")
        facts, pending = await store.peek("alice")  # held out: the facts alone
        assert facts and not pending and store.held_out.peeks == 1
        await admin.execute("ROLLBACK")
        assert (await store.peek("alice"))[0]
        assert engine.pool is pool_before  # no dead connection met: not replaced
    finally:
        await admin.close()
        await store.close()


async def test_the_service_as_the_app_role_forgets_one_identity(tenancy: Tenancy) -> None:
    await _populate(tenancy)
    store = PostgresStore.from_url(tenancy.url, schema=SCHEMA, **tenancy.as_role(tenancy.app))
    try:
        assert await store.facts("bob")
        await store.forget("alice")
        assert await store.facts("alice") == []
        assert await store.history("alice") == []
        assert await store.facts("bob")
        assert await store.observations("bob")
        assert await store.checkpoint("bob") is not None
    finally:
        await store.close()


async def test_start_as_the_app_role_rehearses_the_hot_path_and_changes_nothing(
    tenancy: Tenancy,
) -> None:
    """start() runs the peek's and the consolidation's statements once on each request
    connection, for the empty identity, which the app role may neither see nor write: as
    that role too they run, on their generic plans, and leave every row as it was."""
    await _populate(tenancy)
    tables = (*PER_IDENTITY, *AGGREGATE_TABLES)
    store = PostgresStore.from_url(
        tenancy.url, schema=SCHEMA, pool_size=2, **tenancy.as_role(tenancy.app)
    )
    try:
        before = await table_digests(tenancy.url, SCHEMA, tables)
        await store.start()
        write = Statements.for_schema(SCHEMA).write.text
        held = [await store.request_engine.connect() for _ in range(2)]
        for conn in held:
            plans = await prepared_plans(await driver_connection(conn))
            assert plans[write] == (1, 0)
            await conn.close()
        assert await table_digests(tenancy.url, SCHEMA, tables) == before
    finally:
        await store.close()


async def test_analytics_as_the_app_role_raise_access_denied(tenancy: Tenancy) -> None:
    """The app role may not read the aggregate views, nor rebuild the rollup: each call
    raises AccessDenied, which says who may, and changes nothing."""
    await _populate(tenancy)
    service = MemoryService.from_url(
        tenancy.url, schema=SCHEMA, clock=FakeClock(), **tenancy.as_role(tenancy.app)
    )
    try:
        for function in (
            coda_analytics.tool_effectiveness,
            coda_analytics.entity_popularity,
            coda_analytics.domain_trends,
            coda_analytics.fact_summary,
        ):
            with pytest.raises(AccessDenied, match="granted to analyst roles") as raised:
                await function(service, min_users=1, schema=SCHEMA)
            assert f"schema {SCHEMA!r}" in str(raised.value)
            assert isinstance(raised.value.__cause__, DBAPIError)
        with pytest.raises(AccessDenied, match="takes the schema's owner"):
            await coda_analytics.rebuild_rollups(service, schema=SCHEMA)
        # The connection is fine afterwards: the app role's own work goes on.
        assert await service.facts("bob")
    finally:
        await service.close()
    owner = await tenancy.connect(tenancy.owner)
    try:
        assert await _count(owner, "tool_daily") > 0
    finally:
        await owner.close()


async def test_analytics_as_a_role_without_any_grant_raise_access_denied(
    tenancy: Tenancy,
) -> None:
    """entity_popularity asks first whether the role may read active_facts, which a role
    without USAGE on the schema cannot even ask: that raised SQLAlchemy's error."""
    await _populate(tenancy)
    stranger = f"coda_stranger_{secrets.token_hex(4)}"
    await superuser(tenancy.url, f'CREATE ROLE "{stranger}" NOLOGIN')
    service = MemoryService.from_url(tenancy.url, schema=SCHEMA, **tenancy.as_role(stranger))
    try:
        for function in (coda_analytics.entity_popularity, coda_analytics.tool_effectiveness):
            with pytest.raises(AccessDenied, match="granted to analyst roles"):
                await function(service, min_users=1, schema=SCHEMA)
    finally:
        await service.close()
        await superuser(tenancy.url, f'DROP ROLE "{stranger}"')


async def test_the_app_role_owes_the_rollup_under_a_lock_and_folds_it(
    tenancy: Tenancy, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresStore.from_url(tenancy.url, schema=SCHEMA, **tenancy.as_role(tenancy.app))
    owner = await tenancy.connect(tenancy.owner, **ALL_IDENTITIES)
    try:
        async with owner.transaction():
            await owner.execute(f"LOCK TABLE {SCHEMA}.tool_daily IN ACCESS EXCLUSIVE MODE")
            outcome = await store.append([call("alice", "t", True, D1), call("bob", "t", True, D1)])
            assert outcome.stored == 2
            await store.append([call("bob", "t", True, D1)])
        owed = f"SELECT identity_id, count(*) FROM {SCHEMA}.rollup_owed GROUP BY 1 ORDER BY 1"
        assert [tuple(r) for r in await owner.fetch(owed)] == [("alice", 1), ("bob", 2)]
        # The next append folds them: the writer reads both owed transactions' rows, in
        # one folding (one that fails would be logged, then retried one by one).
        with caplog.at_level(logging.WARNING, "coda_memory"):
            await store.append([call("alice", "t", False, D1)])
        assert "not folded" not in caplog.text
        assert await owner.fetch(owed) == []
        counts = f"SELECT sum(successes), sum(failures), sum(latest_users) FROM {SCHEMA}.tool_daily"
        assert tuple(await owner.fetchrow(counts)) == (3, 1, 2)
    finally:
        await owner.close()
        await store.close()


async def test_the_analyst_role_reads_only_the_aggregate_views(tenancy: Tenancy) -> None:
    await _populate(tenancy)
    conn = await tenancy.connect(tenancy.analyst)
    try:
        for relation in (
            *PER_IDENTITY,
            *LEDGER,
            *AGGREGATE_TABLES,
            "rollup_owed",
            "active_facts",
            "alembic_version",
            "analytics_floor",
            "analytics_reader_floor",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.fetch(f"SELECT * FROM {SCHEMA}.{relation} LIMIT 1")
        for view in AGGREGATE_VIEWS:
            columns = await conn.fetch(
                "SELECT column_name FROM information_schema.columns "
                "WHERE table_schema = $1 AND table_name = $2",
                SCHEMA,
                view,
            )
            assert "identity_id" not in {c["column_name"] for c in columns}, view
            await conn.fetch(f"SELECT * FROM {SCHEMA}.{view}")
        # The aggregates count every identity's facts, although no row is readable (the
        # owner lowers the floor to 2, for the two identities).
        await _set_floor(tenancy, 2)
        await conn.execute("SET coda_memory.analytics_now = '2026-01-01T10:00:00Z'")
        summary = {
            r["category"]: r["users"]
            for r in await conn.fetch(f"SELECT * FROM {SCHEMA}.fact_summary")
        }
        assert summary["tool_avoidance"] == 2  # both avoid run_sql
        # Each likes a tool of its own: subjects of one identity are not counted (0015).
        assert "tool_affinity" not in summary
        tools = {
            r["tool_name"]: r["avoidance_users"]
            for r in await conn.fetch(f"SELECT * FROM {SCHEMA}.tool_effectiveness")
        }
        assert tools["run_sql"] == 2
    finally:
        await conn.close()


async def _set_floor(t: Tenancy, min_users: int) -> None:
    owner = await t.connect(t.owner)
    try:
        await owner.execute(f"UPDATE {SCHEMA}.analytics_floor SET min_users = $1", min_users)
    finally:
        await owner.close()


async def _aggregates(conn: asyncpg.Connection) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the aggregate views, as a role reads them on 2026-01-01."""
    await conn.execute("SET coda_memory.analytics_now = '2026-01-01T10:00:00Z'")
    columns = {
        "tool_effectiveness": (
            "tool_name, users, affinity_users, mean_affinity_confidence IS NOT NULL, "
            "avoidance_users, mean_avoidance_confidence IS NOT NULL"
        ),
        "entity_popularity": "entity_id, users",
        "domain_trends": "domain, users",
        "fact_summary": "category, users",
    }
    return {
        view: [tuple(r) for r in await conn.fetch(f"SELECT {c} FROM {SCHEMA}.{view} ORDER BY 1")]
        for view, c in columns.items()
    }


def _removed_by_filters(plan: dict[str, Any]) -> int:
    """The rows every filter of an ``EXPLAIN (ANALYZE, FORMAT JSON)`` plan removed."""
    removed = int(plan.get("Rows Removed by Filter", 0))
    return removed + sum(_removed_by_filters(child) for child in plan.get("Plans", []))


async def test_a_limit_tells_the_analyst_nothing_of_the_groups_left_out(
    tenancy: Tenancy,
) -> None:
    """The views streamed their rows: under LIMIT n the plan stopped after the n-th row
    kept, and EXPLAIN ANALYZE's counts for LIMIT 1, 2, … told where a left-out group
    sorts among the names shown, and how many identities it holds (migration 0017)."""
    await _populate(tenancy)
    clock = FakeClock()
    service = MemoryService.from_url(
        tenancy.url, schema=SCHEMA, clock=clock, load_timeout=5.0, **tenancy.as_role(tenancy.app)
    )
    try:
        # Left out at a floor of 2 and sorting first: alice's alone.
        service.emit_observation("alice", tool_ok("a_tool"))
        service.emit_observation("alice", entity("account", "acct-a"))
        service.emit_observation("alice", domain("contract"))
        for who in ("alice", "bob"):  # shown: both use them
            service.emit_observation(who, entity("account", "acct-shared"))
        await service.drain()
        for who in ("alice", "bob"):
            await service.consolidate(who)
    finally:
        await service.close()
    await _set_floor(tenancy, 2)
    analyst = await tenancy.connect(tenancy.analyst)
    try:
        await analyst.execute("SET coda_memory.analytics_now = '2026-01-01T10:00:00Z'")
        # As a reader may: plans that stream, without hashing (a small table hashes).
        for setting in ("enable_hashagg", "enable_hashjoin", "enable_sort"):
            await analyst.execute(f"SET {setting} = off")
        for view in ("tool_effectiveness", "entity_popularity", "domain_trends"):
            removed = []
            for limit in ("LIMIT 1", ""):
                explained = await analyst.fetchval(
                    f"EXPLAIN (ANALYZE, FORMAT JSON) SELECT * FROM {SCHEMA}.{view} {limit}"
                )
                removed.append(_removed_by_filters(json.loads(explained)[0]["Plan"]))
            shown = await analyst.fetch(f"SELECT * FROM {SCHEMA}.{view}")
            assert shown, view  # a row is shown, so LIMIT 1 could stop after it
            assert removed[0] == removed[1] > 0, (view, removed)
    finally:
        await analyst.close()


async def test_the_analyst_sees_no_group_below_the_floor_that_only_the_owner_sets(
    tenancy: Tenancy,
) -> None:
    """alice and bob: every group holds one or two users. Under the default floor (5) the
    analyst sees none of them; at 2, the groups of both; the owner sees all, always."""
    await _populate(tenancy)
    analyst = await tenancy.connect(tenancy.analyst)
    owner = await tenancy.connect(tenancy.owner, **ALL_IDENTITIES)
    try:
        # alice alone also likes run_sql (a mean over one identity), and both like
        # legacy_tool, which neither used in the window (a row known from facts alone).
        for who, tool in (("alice", "run_sql"), ("alice", "legacy_tool"), ("bob", "legacy_tool")):
            await owner.execute(
                f"INSERT INTO {SCHEMA}.facts VALUES ($1, $2, 'tool_affinity', 'likes it', "
                "0.9, 1, $3, $3, $3, $3, NULL)",
                who,
                f"tool_affinity:{tool}",
                datetime(2026, 1, 1, tzinfo=UTC),
            )
        everything = await _aggregates(owner)
        assert everything["entity_popularity"] == [("acct-alice", 1), ("acct-bob", 1)]
        assert ("run_sql", 2, 1, True, 2, True) in everything["tool_effectiveness"]
        assert await _aggregates(analyst) == {view: [] for view in everything}

        await _set_floor(tenancy, 2)
        assert await _aggregates(analyst) == {
            # The row's groups hold 2 users; alice's affinity is withheld, count and mean.
            # legacy_tool, which nobody used in the window, is left out as one a single
            # user used would be (migration 0014).
            "tool_effectiveness": [("run_sql", 2, None, False, 2, True)],
            "entity_popularity": [],
            "domain_trends": [("royalty", 2)],
            # Only subjects both hold count (0015): no entity (each has its own account),
            # and of the affinities only legacy_tool.
            "fact_summary": [
                ("domain_preference", 2),
                ("tool_affinity", 2),
                ("tool_avoidance", 2),
            ],
        }
        await _set_floor(tenancy, 3)
        assert (await _aggregates(analyst))["tool_effectiveness"] == []
        assert await _aggregates(owner) == everything

        # The analyst can neither read nor change the floor, and no setting moves it.
        for statement in (
            f"SELECT * FROM {SCHEMA}.analytics_floor",
            f"UPDATE {SCHEMA}.analytics_floor SET min_users = 1",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await analyst.execute(statement)
        await analyst.execute("SET coda_memory.all_identities = on")
        assert (await _aggregates(analyst))["tool_effectiveness"] == []
        # The floor is at least 1 (0 would be no floor) and one row.
        for statement in (
            f"UPDATE {SCHEMA}.analytics_floor SET min_users = 0",
            f"INSERT INTO {SCHEMA}.analytics_floor VALUES (false, 1)",
        ):
            with pytest.raises(asyncpg.CheckViolationError):
                await owner.execute(statement)
        # Without its row the floor is unknown, and the analyst sees nothing.
        await owner.execute(f"DELETE FROM {SCHEMA}.analytics_floor")
        await _set_floor(tenancy, 1)  # updates no row
        assert await _aggregates(analyst) == {view: [] for view in everything}
    finally:
        await analyst.close()
        await owner.close()


async def test_stepping_the_window_tells_nothing_of_a_tool_a_few_used(tenancy: Tenancy) -> None:
    """A tool that as many identities as the floor hold facts about stayed, its usage at
    0, on the days nobody used it, and was left out on the day one user did: reading the
    view day by day told when that user used it."""
    owner = await tenancy.connect(tenancy.owner, **ALL_IDENTITIES)
    analyst = await tenancy.connect(tenancy.analyst)
    service = MemoryService.from_url(
        tenancy.url,
        schema=SCHEMA,
        clock=FakeClock(datetime(2026, 1, 7, tzinfo=UTC)),  # after the use below
        **tenancy.as_role(tenancy.app),
    )
    try:
        for who in ("alice", "bob"):
            await owner.execute(
                f"INSERT INTO {SCHEMA}.facts VALUES ($1, 'tool_affinity:probe_tool', "
                "'tool_affinity', 'likes it', 0.9, 1, $2, $2, $2, $2, NULL)",
                who,
                datetime(2026, 1, 1, tzinfo=UTC),
            )
        service.emit_observation(
            "alice", tool_ok("probe_tool", at=datetime(2026, 1, 5, 9, tzinfo=UTC))
        )
        await service.drain()
        await _set_floor(tenancy, 2)
        await analyst.execute("SET coda_memory.analytics_window = '0 days'")
        seen = {}
        for day in (4, 5, 6):
            await analyst.execute(f"SET coda_memory.analytics_now = '2026-01-0{day}T12:00:00Z'")
            seen[day] = await analyst.fetch(
                f"SELECT users FROM {SCHEMA}.tool_effectiveness WHERE tool_name = 'probe_tool'"
            )
        assert seen == {4: [], 5: [], 6: []}
        # The owner sees the tool every day, and alice's use on the 5th.
        await owner.execute("SET coda_memory.analytics_window = '0 days'")
        await owner.execute("SET coda_memory.analytics_now = '2026-01-05T12:00:00Z'")
        assert (
            await owner.fetchval(
                f"SELECT users FROM {SCHEMA}.tool_effectiveness WHERE tool_name = 'probe_tool'"
            )
            == 1
        )
    finally:
        await service.close()
        await analyst.close()
        await owner.close()


async def test_no_count_the_floor_withholds_is_the_remainder_of_another_view(
    tenancy: Tenancy,
) -> None:
    """Under a floor of 2, alice and bob like rare_tool and avoid flaky_tool; carol alone
    avoids rare_tool. tool_effectiveness withholds rare_tool's avoidance_users (1), but
    fact_summary counted every avoidance: its 3 less flaky_tool's 2 gave carol's back."""
    owner = await tenancy.connect(tenancy.owner, **ALL_IDENTITIES)
    analyst = await tenancy.connect(tenancy.analyst)
    service = MemoryService.from_url(
        tenancy.url,
        schema=SCHEMA,
        clock=FakeClock(),
        load_timeout=5.0,
        **tenancy.as_role(tenancy.app),
    )
    try:
        for who in ("alice", "bob"):
            service.emit_observation(who, tool_ok("rare_tool"))
            service.emit_observation(who, tool_failed("flaky_tool"))
        service.emit_observation("carol", tool_failed("rare_tool"))
        await service.drain()
        for who in ("alice", "bob", "carol"):
            await service.consolidate(who)
        await _set_floor(tenancy, 2)
        read = (
            f"SELECT tool_name, avoidance_users FROM {SCHEMA}.tool_effectiveness",
            f"SELECT facts FROM {SCHEMA}.fact_summary WHERE category = 'tool_avoidance'",
        )
        for conn in (analyst, owner):
            await conn.execute("SET coda_memory.analytics_now = '2026-01-01T10:00:00Z'")
        shown = dict(await analyst.fetch(read[0]))
        assert shown == {"rare_tool": None, "flaky_tool": 2}
        # What the analyst can subtract is made of subjects it could be shown.
        assert await analyst.fetchval(read[1]) == 2
        # The owner, whom the floor does not bind, counts every fact.
        assert dict(await owner.fetch(read[0])) == {"rare_tool": 1, "flaky_tool": 2}
        assert await owner.fetchval(read[1]) == 3
    finally:
        await service.close()
        await analyst.close()
        await owner.close()


async def test_no_function_of_the_analyst_sees_a_row_below_the_floor(tenancy: Tenancy) -> None:
    """A function of the analyst's own in a WHERE clause (a temporary one: every role may
    make those), or an expression that fails on one value, must not be run on the rows
    that the floor hides: the views are security barriers."""
    await _populate(tenancy)
    analyst = await tenancy.connect(tenancy.analyst)
    seen: list[str] = []
    analyst.add_log_listener(lambda _conn, message: seen.append(message.message))
    try:
        await analyst.execute(
            "CREATE FUNCTION pg_temp.peek(value text) RETURNS boolean LANGUAGE plpgsql "
            "COST 0.0000001 AS $$ BEGIN RAISE NOTICE 'saw %', value; RETURN true; END $$"
        )
        await analyst.execute("SET coda_memory.analytics_now = '2026-01-01T10:00:00Z'")
        probes = {
            "entity_popularity": "entity_id",
            "tool_effectiveness": "tool_name",
            "domain_trends": "domain",
            "fact_summary": "category",
        }
        for view, column in probes.items():
            rows = await analyst.fetch(
                f"SELECT * FROM {SCHEMA}.{view} WHERE pg_temp.peek({column}::text)"
            )
            assert rows == [], view
            # A division by zero on one hidden value would tell that it exists.
            await analyst.fetch(
                f"SELECT * FROM {SCHEMA}.{view} "
                f"WHERE 1 / (CASE WHEN {column}::text = 'acct-alice' THEN 0 ELSE 1 END) = 1"
            )
        assert seen == []
    finally:
        await analyst.close()


async def test_explain_analyze_tells_the_analyst_nothing_of_a_hidden_value(
    tenancy: Tenancy,
) -> None:
    """Built-in comparisons are leakproof, so the planner pushed them below the security
    barrier, down to the scans: EXPLAIN ANALYZE then showed rows that the floor removed
    for an entity id, domain or tool that exists below the floor (and none for one that
    does not), which told the hidden values one prefix at a time. The plans for a hidden
    value and for a missing one must be the same."""
    await _populate(tenancy)
    analyst = await tenancy.connect(tenancy.analyst)
    try:
        await analyst.execute("SET coda_memory.analytics_now = '2026-01-01T10:00:00Z'")
        probes = {  # (view, column): a value hidden by the floor
            ("entity_popularity", "entity_id"): "acct-alice",
            ("domain_trends", "domain"): "royalty",
            ("tool_effectiveness", "tool_name"): "run_sql",
            ("fact_summary", "category"): "tool_affinity",
        }
        for (view, column), hidden in probes.items():
            plans = {}
            for value in (hidden, "nothing-like-it"):
                for condition in (f"{column} = $1", f"{column} ^@ $1"):
                    rows = await analyst.fetch(
                        "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF, BUFFERS OFF) "
                        f"SELECT * FROM {SCHEMA}.{view} WHERE {condition}",
                        value,
                    )
                    # (The value itself, shown in the filter, aside.)
                    plans[value, condition] = [r[0].replace(value, "?") for r in rows]
            for condition in (f"{column} = $1", f"{column} ^@ $1"):
                assert plans[hidden, condition] == plans["nothing-like-it", condition], (
                    view,
                    condition,
                )
    finally:
        await analyst.close()


async def test_an_analyst_under_a_floor_sees_facts_as_at_the_start_of_the_day(
    tenancy: Tenancy,
) -> None:
    """Stepping the instant by microseconds, an analyst found when one user's fact
    expires (where a count turns NULL). Above a floor of 1 its instant is the start of
    its UTC day; the owner's, and an analyst's under a floor of 1, are as set."""
    analyst = await tenancy.connect(tenancy.analyst)
    owner = await tenancy.connect(tenancy.owner)
    instant = f"SELECT at FROM {SCHEMA}.analytics_window"
    try:
        for conn in (analyst, owner):
            await conn.execute("SET coda_memory.analytics_now = '2026-01-01T10:17:03.5Z'")
        set_at = datetime(2026, 1, 1, 10, 17, 3, 500_000, tzinfo=UTC)
        assert await analyst.fetchval(instant) == datetime(2026, 1, 1, tzinfo=UTC)
        assert await owner.fetchval(instant) == set_at
        await _set_floor(tenancy, 1)
        assert await analyst.fetchval(instant) == set_at
    finally:
        await analyst.close()
        await owner.close()


async def test_an_analyst_gets_rounded_means_and_no_small_bucket(tenancy: Tenancy) -> None:
    """Two days' exact means, one fact apart, gave that fact's confidence (and so its
    instant), and a histogram bucket of one fact traced one user's fact from day to day."""
    await _populate(tenancy)
    analyst = await tenancy.connect(tenancy.analyst)
    owner = await tenancy.connect(tenancy.owner, **ALL_IDENTITIES)
    summary = f"SELECT mean_confidence, histogram FROM {SCHEMA}.fact_summary "
    summary += "WHERE category = 'tool_affinity'"
    try:
        # An affinity both hold (the analyst counts no other: each of _populate's is one
        # identity's), far more confident for alice than for bob: a bucket each.
        for who, confidence in (("alice", 0.95), ("bob", 0.45)):
            await owner.execute(
                f"INSERT INTO {SCHEMA}.facts VALUES ($1, 'tool_affinity:legacy_tool', "
                "'tool_affinity', 'likes it', $2, 1, $3, $3, $3, $3, NULL)",
                who,
                confidence,
                datetime(2026, 1, 1, tzinfo=UTC),
            )
        await _set_floor(tenancy, 2)
        for conn in (analyst, owner):
            await conn.execute("SET coda_memory.analytics_now = '2026-01-04T00:00:00Z'")
        _, buckets = await owner.fetchrow(summary)
        assert 1 in buckets
        exact_mean = await owner.fetchval(
            f"SELECT avg(effective_confidence) FROM {SCHEMA}.active_facts "
            "WHERE subject = 'tool_affinity:legacy_tool'"
        )
        mean, withheld = await analyst.fetchrow(summary)
        assert mean == round(exact_mean, 2) != exact_mean
        # The whole histogram (migration 0014): with the bucket of one withheld alone,
        # the row's facts less the other buckets gave it back.
        assert withheld == [None] * 10
    finally:
        await analyst.close()
        await owner.close()


async def test_the_window_is_counted_in_utc_days_whatever_the_time_zone(
    tenancy: Tenancy,
) -> None:
    """Across a change of daylight saving time in the session's time zone, the window of
    30 days began a day early."""
    analyst = await tenancy.connect(tenancy.analyst)
    owner = await tenancy.connect(tenancy.owner)
    window = f"SELECT start_day, end_day FROM {SCHEMA}.analytics_window"
    try:
        for conn in (analyst, owner):
            await conn.execute("SET TIME ZONE 'Europe/Berlin'")
            await conn.execute("SET coda_memory.analytics_now = '2026-11-10T15:00:00Z'")
            await conn.execute("SET coda_memory.analytics_window = '30 days'")
            assert tuple(await conn.fetchrow(window)) == (date(2026, 10, 11), date(2026, 11, 10))
    finally:
        await analyst.close()
        await owner.close()


async def test_the_owner_sees_every_identity_only_when_it_asks(tenancy: Tenancy) -> None:
    await _populate(tenancy)
    # FORCE: the owner is subject to the policies too.
    conn = await tenancy.connect(tenancy.owner)
    try:
        for table in PER_IDENTITY:
            assert await _count(conn, table) == 0, table
    finally:
        await conn.close()
    conn = await tenancy.connect(tenancy.owner, **ALL_IDENTITIES)
    try:
        assert await _count(conn, "facts", "identity_id IN ('alice', 'bob')") > 0
        assert await conn.fetchval(f"SELECT count(DISTINCT identity_id) FROM {SCHEMA}.facts") == 2
    finally:
        await conn.close()
    # No other role can ask for it.
    conn = await tenancy.connect(tenancy.app, **ALL_IDENTITIES)
    try:
        for table in PER_IDENTITY:
            assert await _count(conn, table) == 0, table
    finally:
        await conn.close()


async def test_a_member_of_the_owner_sees_every_identity_only_when_it_asks(
    tenancy: Tenancy,
) -> None:
    """The owner's policy applies to its members too (a login role granted the owner's
    NOLOGIN role): without the setting such a role sees no row and writes none, as the
    owner, and the analyst still reads the owner's aggregate views."""
    await _populate(tenancy)
    member = f"{tenancy.owner}_member"
    await superuser(tenancy.url, f'CREATE ROLE "{member}" NOLOGIN IN ROLE "{tenancy.owner}"')
    try:
        conn = await tenancy.connect(member)
        try:
            for table in PER_IDENTITY:
                assert await _count(conn, table) == 0, table
            assert await conn.execute(f"UPDATE {SCHEMA}.facts SET confidence = 0") == "UPDATE 0"
            with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
                await conn.execute(
                    f"INSERT INTO {SCHEMA}.checkpoints (identity_id) VALUES ('mallory')"
                )
        finally:
            await conn.close()
        conn = await tenancy.connect(member, **ALL_IDENTITIES)
        try:
            identities = f"SELECT count(DISTINCT identity_id) FROM {SCHEMA}.facts"
            assert await conn.fetchval(identities) == 2
        finally:
            await conn.close()
    finally:
        await superuser(tenancy.url, f'DROP ROLE "{member}"')
    await _set_floor(tenancy, 1)
    now = FakeClock().now.isoformat()
    conn = await tenancy.connect(tenancy.analyst, **{"coda_memory.analytics_now": now})
    try:
        summary = await conn.fetch(f"SELECT category, users FROM {SCHEMA}.fact_summary")
        assert dict(summary)["tool_affinity"] == 2
    finally:
        await conn.close()


async def test_owner_maintenance_and_analytics_work_across_identities(tenancy: Tenancy) -> None:
    await _populate(tenancy)
    options: dict[str, Any] = {
        "connect_args": {"server_settings": {"role": tenancy.owner, **ALL_IDENTITIES}}
    }
    store = PostgresStore.from_url(tenancy.url, schema=SCHEMA, **options)
    try:
        stats = await maintenance.store_stats(store)
        assert stats.identities == 2
        assert stats.observations == 8
        assert await maintenance.pending_identities(store) == []
        assert await maintenance.identity_exists(store, "bob")
        summary = await analytics.fact_summary(store, min_users=1, now=FakeClock().now)
        assert {s.category: s.users for s in summary}["tool_affinity"] == 2
        outcome = await maintenance.prune_consolidated(
            store, before=FakeClock().now.replace(year=2100)
        )
        assert (outcome.deleted, outcome.identities) == (8, 2)
    finally:
        await store.close()
    # Analytics as the owner without the connection setting: they ask for it themselves.
    store = PostgresStore.from_url(tenancy.url, schema=SCHEMA, **tenancy.as_role(tenancy.owner))
    try:
        summary = await analytics.fact_summary(store, min_users=1, now=FakeClock().now)
        assert {s.category: s.users for s in summary}["tool_affinity"] == 2
    finally:
        await store.close()


def test_grant_prints_statements_with_the_role_quoted() -> None:
    result = CliRunner().invoke(app, ["grant", "analyst", 'odd "name"; DROP', "--print"])
    assert result.exit_code == 0, result.output
    assert '"odd ""name""; DROP"' in result.stdout
    # Piped, the script names the role the command would grant (a colour code stayed).
    piped = CliRunner().invoke(app, ["grant", "app", "r\x1b[31m", "--print"])
    assert piped.exit_code == 0, piped.output
    assert 'TO "r\x1b[31m"' in piped.stdout
    assert 'GRANT SELECT\n    ON "coda_memory".analytics_window' in result.stdout
    assert "active_facts" not in result.stdout.replace("(active_facts)", "")
    for bad in ("", "public", "pg_monitor", "x" * 64, "a\x00b"):
        with pytest.raises(ValueError):
            quote_role(bad)
    # Postgres reserves these names case and all: quoted, these are roles like any other.
    assert (quote_role("PG_x"), quote_role("Public")) == ('"PG_x"', '"Public"')
    result = CliRunner().invoke(app, ["grant", "owner", "someone", "--print"])
    assert result.exit_code == 2


def test_grant_on_a_schema_behind_head_says_to_migrate(empty_pg_url: str) -> None:
    """The grants name the latest revision's tables: on an older schema the command failed
    on the first one missing (``relation ... does not exist``), with no word of migrating."""
    import asyncio

    from coda_memory import migrate_async

    asyncio.run(migrate_async(empty_pg_url, revision="0006"))
    role = f"coda_grantee_{secrets.token_hex(4)}"
    asyncio.run(superuser(empty_pg_url, f'CREATE ROLE "{role}" NOLOGIN'))
    try:
        result = CliRunner().invoke(app, ["grant", "app", role, "--url", empty_pg_url])
        assert result.exit_code == 1, result.output
        assert result.stderr.strip().splitlines() == [
            f"error: schema coda_memory is at revision 0006, and grant needs {HEAD}: "
            "run coda-memory migrate"
        ]
    finally:
        asyncio.run(superuser(empty_pg_url, f'DROP OWNED BY "{role}"', f'DROP ROLE "{role}"'))


def test_grant_applies_the_grants(pg_url: str) -> None:
    import asyncio

    role = f"coda_grantee_{secrets.token_hex(4)}"
    asyncio.run(superuser(pg_url, f'CREATE ROLE "{role}" NOLOGIN'))
    try:
        result = CliRunner().invoke(app, ["grant", "app", role, "--url", pg_url])
        assert result.exit_code == 0, result.output

        async def privileges() -> list[bool]:
            conn = await asyncpg.connect(dsn(pg_url))
            try:
                return [
                    await conn.fetchval(
                        "SELECT has_table_privilege($1, $2, $3)", role, f"coda_memory.{t}", p
                    )
                    for t, p in (
                        ("facts", "SELECT"),
                        ("observations", "INSERT"),
                        ("active_facts", "SELECT"),
                        ("observations", "UPDATE"),
                    )
                ]
            finally:
                await conn.close()

        assert asyncio.run(privileges()) == [True, True, False, False]
    finally:
        asyncio.run(superuser(pg_url, f'DROP OWNED BY "{role}"', f'DROP ROLE "{role}"'))


@pytest.mark.parametrize("name", ["information_schema", "pg_catalog", "pg_toast", "pg_temp_1"])
def test_system_schemas_are_refused(name: str) -> None:
    with pytest.raises(ValueError):
        validate_schema_name(name)
    with pytest.raises(ValueError):
        grant_script("app", "someone", name)


def _upgrade_to(revision: str) -> Any:
    def upgrade(connection: Connection) -> None:
        config = alembic_config(schema=SCHEMA)
        config.attributes["connection"] = connection
        command.upgrade(config, revision)

    return upgrade


@pytest.mark.parametrize(
    ("revision", "table"),
    [
        ("0005", "ingest_batches"),
        # 0005 granted its table to nobody: every append of an app role granted at 0004
        # failed, and 0006 and 0007, which ask ingest_batches' ACL, granted nobody either.
        ("0004", "observations"),
    ],
)
async def test_an_upgrade_grants_its_new_table_to_the_app_roles_granted_before(
    pg_url: str, revision: str, table: str
) -> None:
    """``coda-memory grant app`` ran at ``revision``; the tables added later
    (``ingest_batches``, ``rollup_owed``, ``ingest_batches_spill``) the app role can use
    at once, and the analyst role cannot. Only the app role itself is granted them: not a
    member of it, nor ``pg_write_all_data``, which may insert into ``ingest_batches`` too
    but may read no table (granted SELECT on ``rollup_owed``, its members read every
    identity's owed rows)."""
    suffix = secrets.token_hex(4)
    owner, app_role, analyst, member = (
        f"coda_{kind}_{suffix}" for kind in ("owner", "app", "analyst", "member")
    )
    roles = (owner, app_role, analyst, member)
    database = make_url(pg_url).database
    await superuser(
        pg_url,
        *(f'CREATE ROLE "{role}" NOLOGIN' for role in roles),
        f'GRANT CREATE ON DATABASE "{database}" TO "{owner}"',
        f'GRANT "{app_role}" TO "{member}"',
    )
    engine = create_async_engine(
        pg_url, poolclass=pool.NullPool, connect_args={"server_settings": {"role": owner}}
    )
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_upgrade_to(revision))
            await conn.commit()
            driver: Any = (await conn.get_raw_connection()).driver_connection
            # What grant_app.sql granted on the table the check looks at, at ``revision``.
            await driver.execute(
                f'GRANT USAGE ON SCHEMA {SCHEMA} TO "{app_role}", "{analyst}";'
                f'GRANT SELECT, INSERT, UPDATE, DELETE ON {SCHEMA}.{table} TO "{app_role}";'
                f'GRANT SELECT ON {SCHEMA}.tool_daily TO "{analyst}"'
            )
            await conn.run_sync(_upgrade_to("0010"))
            await conn.commit()
            # What 0006 and 0007 granted before they asked the tables' ACL (0011 revokes it).
            await driver.execute(
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON {SCHEMA}.rollup_owed,"
                f" {SCHEMA}.ingest_batches_spill TO pg_write_all_data"
            )
            await conn.run_sync(_upgrade_to("head"))
            await conn.commit()
            granted = {
                role: await driver.fetchval(
                    "SELECT has_table_privilege($1, $2, 'INSERT')", role, f"{SCHEMA}.rollup_owed"
                )
                for role in (app_role, analyst)
            }
            grantees = {
                added: set(
                    await driver.fetchval(
                        "SELECT array_agg(DISTINCT acl.grantee::regrole::text)"
                        " FROM pg_class c, aclexplode(c.relacl) AS acl WHERE c.oid = $1::regclass",
                        f"{SCHEMA}.{added}",
                    )
                )
                for added in ("ingest_batches", "rollup_owed", "ingest_batches_spill")
            }
        assert granted == {app_role: True, analyst: False}
        own = {owner, app_role}
        assert grantees == {"ingest_batches": own, "rollup_owed": own, "ingest_batches_spill": own}
    finally:
        await engine.dispose()
        await superuser(
            pg_url,
            f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE',
            *(f'DROP OWNED BY "{role}"' for role in roles),
            *(f'DROP ROLE "{role}"' for role in roles),
        )


async def test_entity_popularity_as_the_owner_reads_the_facts_of_its_top_entities_only(
    tenancy: Tenancy,
) -> None:
    """The owner's entity_popularity looks up each top entity's facts by subject. Under
    row-level security a condition that is not leakproof (the subject built with ||)
    cannot be an index condition, so each lookup read every entity fact: on a non-
    superuser owner, 100 top entities over 360,000 facts took 6.4 s instead of 0.15 s."""
    owner = await tenancy.connect(tenancy.owner, **ALL_IDENTITIES)
    try:
        # 200 entities used by 5 identities each on 2026-01-01; 2,000 identities hold a
        # fact about one of them (10 each).
        await owner.execute(
            f"INSERT INTO {SCHEMA}.entity_daily (day, entity_type, entity_id, accesses, "
            "latest_users) SELECT DATE '2026-01-01', 'account', 'acct-' || e, 5, 5 "
            "FROM generate_series(1, 200) AS e"
        )
        await owner.execute(
            f"INSERT INTO {SCHEMA}.facts (identity_id, subject, category, content, confidence, "
            "reinforcement_count, last_reinforced_at, confidence_at, created_at, updated_at) "
            "SELECT 'user-' || i, 'entity_frequency:account:acct-' || (i % 200 + 1), "
            "'entity_frequency', 'uses it', 0.9, 1, t, t, t, t "
            "FROM generate_series(1, 2000) AS i, "
            "CAST('2026-01-01T09:00:00Z' AS timestamptz) AS t"
        )
        await owner.execute(f"ANALYZE {SCHEMA}.facts")
        await owner.execute(f"ANALYZE {SCHEMA}.entity_daily")
    finally:
        await owner.close()
    store = PostgresStore.from_url(tenancy.url, schema=SCHEMA, **tenancy.as_role(tenancy.owner))
    try:
        now = datetime(2026, 1, 1, 10, tzinfo=UTC)
        with Recorder(store) as recorder:
            rows = await analytics.entity_popularity(store, min_users=5, now=now, limit=3)
        assert [(r.entity_id, r.users, r.fact_users) for r in rows] == [
            ("acct-1", 5, 10),
            ("acct-10", 5, 10),
            ("acct-100", 5, 10),
        ]
        [(statement, parameters)] = [
            (s, p) for s, p in recorder.statements if "entity_popularity" in s
        ]
        async with store.engine.connect() as conn:
            for setting, arguments in recorder.statements:
                if setting.lstrip().upper().startswith("SELECT SET_CONFIG"):
                    await conn.exec_driver_sql(setting, arguments)
            result = await conn.exec_driver_sql(
                f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}", parameters
            )
            raw = result.scalar_one()
            await conn.rollback()
    finally:
        await store.close()
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    facts_read = sum(
        (int(node["Actual Rows"]) + int(node.get("Rows Removed by Filter", 0)))
        * int(node["Actual Loops"])
        for node in plan_nodes(plan)
        if node.get("Relation Name") == "facts"
    )
    # The facts of the three entities shown, and no other.
    assert facts_read == 30


@pytest.mark.parametrize("policy", ["all_identities", "tenant"])
async def test_the_policy_templates_write_the_policies_of_the_latest_migrations(
    tenancy: Tenancy, policy: str
) -> None:
    """A table that a later migration makes per-identity, from the templates, gets the
    policies that 0016 and 0020 left on the existing tables, not 0004's: the owner's let
    a member of the owner through without asking for every identity, and the tenant's
    gave a connection whose setting was reset the rows of the empty identity."""
    owner = await tenancy.connect(tenancy.owner)
    try:
        await owner.execute(f"CREATE TABLE {SCHEMA}.later_table (identity_id text NOT NULL)")
        for name in ("enable", "tenant_policy", "owner_policy"):
            await owner.execute(tenancy_sql(name, SCHEMA, "later_table"))
        rows = await owner.fetch(
            "SELECT tablename, roles, qual, with_check FROM pg_catalog.pg_policies "
            "WHERE schemaname = $1 AND policyname = $2",
            SCHEMA,
            policy,
        )
    finally:
        await owner.close()
    policies = {
        row["tablename"]: (tuple(row["roles"]), row["qual"], row["with_check"]) for row in rows
    }
    made = policies.pop("later_table")
    assert set(policies) == {*PER_IDENTITY, *LEDGER, "rollup_owed"}
    assert set(policies.values()) == {made}
    roles, qual, with_check = made
    assert qual == with_check
    if policy == "all_identities":
        assert roles == (tenancy.owner,)
        assert "pg_has_role" in qual and "CURRENT_USER" not in qual
    else:
        assert roles == ("public",)
        assert "nullif" in qual


async def test_a_schema_ahead_on_the_app_roles_search_path_redirects_no_table(
    tenancy: Tenancy,
) -> None:
    """Every statement of the service names its tables with their schema: tables of the
    same names in a schema ahead on the role's search path, writable by everyone, are
    neither read nor written."""
    shadow = f"shadow_{secrets.token_hex(4)}"
    names = (*PER_IDENTITY, *LEDGER, *AGGREGATE_TABLES, "rollup_owed", "ingest_batches")
    await superuser(
        tenancy.url,
        f'CREATE SCHEMA "{shadow}"',
        *(f'CREATE TABLE "{shadow}".{name} (x int)' for name in names),
        f'GRANT ALL ON SCHEMA "{shadow}" TO PUBLIC',
        f'GRANT ALL ON ALL TABLES IN SCHEMA "{shadow}" TO PUBLIC',
    )
    try:
        path = {"search_path": f'"{shadow}", public'}
        service = MemoryService.from_url(
            tenancy.url,
            schema=SCHEMA,
            clock=FakeClock(),
            load_timeout=5.0,
            **tenancy.as_role(tenancy.app, **path),
        )
        try:
            service.emit_observation("alice", tool_ok("get_account"))
            service.emit_observation("alice", domain("royalty"))
            await service.drain()
            assert service.stats().stored == 2
            await service.consolidate("alice")
            loaded = await service.load_memory("alice")
            assert "tool_affinity:get_account" in {f.subject for f in loaded.facts}
        finally:
            await service.close()
        admin = await asyncpg.connect(dsn(tenancy.url))
        try:
            for name in names:
                assert await admin.fetchval(f'SELECT count(*) FROM "{shadow}".{name}') == 0
            assert await _count(admin, "observations", "identity_id = 'alice'") == 2
        finally:
            await admin.close()
    finally:
        await superuser(tenancy.url, f'DROP SCHEMA "{shadow}" CASCADE')
