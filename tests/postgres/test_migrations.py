"""Migrations: one head, up/down round trips, no drift from schema.py, the programmatic API."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import secrets
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import event, text

from coda_memory.errors import ForeignAlembicHistory, MigrationUnderWay
from coda_memory.postgres import schema as schema_module
from coda_memory.postgres.engine import asyncpg_url
from coda_memory.postgres.migrate import alembic_config, migrate, migrate_async, migration_sql
from coda_memory.postgres.schema import (
    metadata,
    schema_translate_map,
    validate_schema_name,
)
from coda_memory.postgres.tenancy import grant_script
from tests.postgres.helpers import engine, fetch, superuser

REPOSITORY = Path(__file__).resolve().parents[2]
TABLES = [
    "analytics_floor",
    "checkpoints",
    "domain_daily",
    "domain_users",
    "entity_daily",
    "entity_users",
    "fact_events",
    "facts",
    "ingest_batches",
    "ingest_batches_spill",
    "observations",
    "redis_imports",
    "rollup_owed",
    "tool_daily",
    "tool_durations",
    "tool_users",
]

#: The newest revision. A new migration updates this pin on purpose.
HEAD = "0020"


def upgrade_on(connection: Any, schema: str | None = None, revision: str = "head") -> None:
    """``alembic upgrade head`` (or ``revision``) on ``connection`` (a caller's ``Connection`` or
    ``Engine`` in ``config.attributes``, as pytest-alembic and Alembic's cookbook pass
    them); run it with ``run_sync`` or from a greenlet."""
    config = alembic_config() if schema is None else alembic_config(schema=schema)
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


def alembic(url: str, *args: str, schema: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the alembic command line from the repository root, as a developer would."""
    executable = Path(sys.executable).with_name("alembic")
    command = [str(executable)] if executable.exists() else [sys.executable, "-m", "alembic"]
    env = {**os.environ, "CODA_MEMORY_DATABASE_URL": url}
    env.pop("CODA_MEMORY_SCHEMA", None)
    if schema is not None:
        env["CODA_MEMORY_SCHEMA"] = schema
    return subprocess.run(
        [*command, *args], cwd=REPOSITORY, env=env, capture_output=True, text=True, check=False
    )


def tables_in(url: str, schema: str) -> list[str]:
    rows = asyncio.run(
        fetch(
            url,
            "SELECT tablename FROM pg_tables WHERE schemaname = :schema ORDER BY tablename",
            schema=schema,
        )
    )
    return [row[0] for row in rows]


def version_in(url: str, schema: str) -> list[str]:
    table = f"{validate_schema_name(schema)}.alembic_version"
    rows = asyncio.run(fetch(url, f"SELECT version_num FROM {table}"))
    return [row[0] for row in rows]


def test_there_is_a_single_head_and_it_is_pinned() -> None:
    scripts = ScriptDirectory.from_config(alembic_config())

    assert scripts.get_heads() == [HEAD]
    assert [s.revision for s in scripts.walk_revisions()][-1] == "0001"


def test_the_repository_alembic_ini_uses_the_packaged_migrations() -> None:
    link = REPOSITORY / "migrations"

    assert link.is_symlink()
    assert link.resolve() == (REPOSITORY / "coda_memory" / "postgres" / "migrations").resolve()


def test_upgrade_downgrade_upgrade_and_no_drift(empty_pg_url: str) -> None:
    upgraded = alembic(empty_pg_url, "upgrade", "head")
    assert upgraded.returncode == 0, upgraded.stderr
    assert tables_in(empty_pg_url, "coda_memory") == ["alembic_version", *TABLES]
    assert version_in(empty_pg_url, "coda_memory") == [HEAD]

    downgraded = alembic(empty_pg_url, "downgrade", "base")
    assert downgraded.returncode == 0, downgraded.stderr
    assert tables_in(empty_pg_url, "coda_memory") == ["alembic_version"]
    assert version_in(empty_pg_url, "coda_memory") == []

    again = alembic(empty_pg_url, "upgrade", "head")
    assert again.returncode == 0, again.stderr
    assert tables_in(empty_pg_url, "coda_memory") == ["alembic_version", *TABLES]

    # The host application's own tables are none of autogenerate's business.
    asyncio.run(fetch(empty_pg_url, "CREATE TABLE public.host_orders (id int PRIMARY KEY)"))
    check = alembic(empty_pg_url, "check")
    assert check.returncode == 0, check.stderr
    assert "No new upgrade operations detected" in check.stdout + check.stderr


#: The views that decay facts, which 0012 replaces.
DECAYING_VIEWS = ("active_facts", "tool_effectiveness", "entity_popularity", "fact_summary")


def decaying_views(url: str, role: str) -> list[tuple[str, bool, bool, bool]]:
    """Per view of DECAYING_VIEWS: capped (its exponent in least()), ``role``'s SELECT,
    and a comment."""
    rows = asyncio.run(
        fetch(
            url,
            "SELECT v.name, position('LEAST(' in pg_get_viewdef(c.oid)) > 0, "
            "has_table_privilege(:role, c.oid, 'SELECT'), obj_description(c.oid) IS NOT NULL "
            "FROM unnest(CAST(:views AS text[])) AS v(name) "
            "JOIN pg_class c ON c.oid = to_regclass('coda_memory.' || v.name) ORDER BY 1",
            role=role,
            views=list(DECAYING_VIEWS),
        )
    )
    return [(row[0], row[1], row[2], row[3]) for row in rows]


@contextmanager
def granted_role(url: str, kind: str) -> Iterator[str]:
    """A new role with the grants of ``kind`` ("app" or "analyst") on the schema as it
    stands; on leaving, what it was granted and the role are dropped."""
    role = f"coda_mig_{kind}_{secrets.token_hex(4)}"
    asyncio.run(superuser(url, f'CREATE ROLE "{role}" NOLOGIN'))
    try:
        asyncio.run(superuser(url, grant_script(kind, role, "coda_memory")))
        yield role
    finally:
        asyncio.run(superuser(url, f'DROP OWNED BY "{role}"', f'DROP ROLE "{role}"'))


def test_0012_caps_the_views_decay_in_place(empty_pg_url: str) -> None:
    assert alembic(empty_pg_url, "upgrade", "0011").returncode == 0
    with granted_role(empty_pg_url, "analyst") as role:
        # The analyst reads the aggregate views, not active_facts (it has identity_id).
        granted = {"active_facts": False}
        before = decaying_views(empty_pg_url, role)
        assert before == [
            (name, False, granted.get(name, True), True) for name in sorted(DECAYING_VIEWS)
        ]

        upgraded = alembic(empty_pg_url, "upgrade", "head")
        assert upgraded.returncode == 0, upgraded.stderr
        # Replaced in place: the grants and comments stay.
        assert decaying_views(empty_pg_url, role) == [
            (name, True, grant, comment) for name, _, grant, comment in before
        ]

        downgraded = alembic(empty_pg_url, "downgrade", "0011")
        assert downgraded.returncode == 0, downgraded.stderr
        assert decaying_views(empty_pg_url, role) == before


#: The views that 0013 puts under the k-anonymity floor.
FLOORED_VIEWS = ("domain_trends", "entity_popularity", "fact_summary", "tool_effectiveness")


def floored_views(url: str, role: str) -> list[tuple[str, str, bool, str, Any]]:
    """Per view of FLOORED_VIEWS: its definition, ``role``'s SELECT, its comment and its
    options."""
    rows = asyncio.run(
        fetch(
            url,
            "SELECT v.name, pg_get_viewdef(c.oid), has_table_privilege(:role, c.oid, 'SELECT'), "
            "obj_description(c.oid), c.reloptions "
            "FROM unnest(CAST(:names AS text[])) AS v(name) "
            "JOIN pg_class c ON c.oid = to_regclass('coda_memory.' || v.name) ORDER BY 1",
            role=role,
            names=list(FLOORED_VIEWS),
        )
    )
    return [(row[0], row[1], row[2], row[3], row[4]) for row in rows]


def test_0013_puts_the_views_under_the_floor_in_place(empty_pg_url: str) -> None:
    assert alembic(empty_pg_url, "upgrade", "0012").returncode == 0
    with granted_role(empty_pg_url, "analyst") as role:
        before = floored_views(empty_pg_url, role)
        window = "SELECT pg_get_viewdef('coda_memory.analytics_window'::regclass)"
        window_before = asyncio.run(fetch(empty_pg_url, window))
        assert [(name, grant, options) for name, _, grant, _, options in before] == [
            (name, True, None) for name in FLOORED_VIEWS
        ]
        assert all("analytics_reader_floor" not in view[1] for view in before)

        upgraded = alembic(empty_pg_url, "upgrade", "0013")
        assert upgraded.returncode == 0, upgraded.stderr
        after = floored_views(empty_pg_url, role)
        # Replaced in place: the grants stay; the definitions read the floor, behind a
        # security barrier, and the comments say so.
        assert [(name, grant, options) for name, _, grant, _, options in after] == [
            (name, True, ["security_barrier=true"]) for name in FLOORED_VIEWS
        ]
        for name, definition, _, comment, _ in after:
            assert "analytics_reader_floor" in definition, name
            assert "analytics_floor.min_users (default 5)" in comment, name
        floor = "SELECT min_users FROM coda_memory.analytics_floor"
        assert asyncio.run(fetch(empty_pg_url, floor)) == [(5,)]
        assert "analytics_reader_floor" in asyncio.run(fetch(empty_pg_url, window))[0][0]

        downgraded = alembic(empty_pg_url, "downgrade", "0012")
        assert downgraded.returncode == 0, downgraded.stderr
        assert floored_views(empty_pg_url, role) == before
        assert asyncio.run(fetch(empty_pg_url, window)) == window_before
        assert "analytics_floor" not in tables_in(empty_pg_url, "coda_memory")
        reader = "SELECT to_regclass('coda_memory.analytics_reader_floor') IS NULL"
        assert asyncio.run(fetch(empty_pg_url, reader)) == [(True,)]


def vacuum_truncate_off(url: str, schema: str) -> list[str]:
    """The tables of ``schema`` that vacuum does not truncate."""
    rows = asyncio.run(
        fetch(
            url,
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = :schema AND 'vacuum_truncate=false' = ANY(c.reloptions) "
            "ORDER BY c.relname",
            schema=schema,
        )
    )
    return [row[0] for row in rows]


def test_vacuum_never_truncates_the_request_paths_tables(empty_pg_url: str) -> None:
    upgraded = alembic(empty_pg_url, "upgrade", "head", schema="tenant_four")
    assert upgraded.returncode == 0, upgraded.stderr
    request_tables = ["checkpoints", "fact_events", "facts", "observations"]
    assert vacuum_truncate_off(empty_pg_url, "tenant_four") == request_tables

    downgraded = alembic(empty_pg_url, "downgrade", "0008", schema="tenant_four")
    assert downgraded.returncode == 0, downgraded.stderr
    assert vacuum_truncate_off(empty_pg_url, "tenant_four") == []


def test_check_reports_drift(empty_pg_url: str) -> None:
    migrate(empty_pg_url)
    asyncio.run(fetch(empty_pg_url, "DROP INDEX coda_memory.ix_observations_identity_id_xid"))

    check = alembic(empty_pg_url, "check")

    assert check.returncode != 0
    assert "ix_observations_identity_id_xid" in check.stdout + check.stderr


def test_migrate_creates_everything_in_the_coda_memory_schema(empty_pg_url: str) -> None:
    # A host application's own Alembic history, in the default schema.
    create = "CREATE TABLE public.alembic_version (version_num varchar(32) PRIMARY KEY)"
    asyncio.run(fetch(empty_pg_url, create))
    asyncio.run(fetch(empty_pg_url, "INSERT INTO public.alembic_version VALUES (:v)", v="host"))

    migrate(empty_pg_url)
    migrate(empty_pg_url)  # idempotent

    assert tables_in(empty_pg_url, "coda_memory") == ["alembic_version", *TABLES]
    assert version_in(empty_pg_url, "coda_memory") == [HEAD]
    assert version_in(empty_pg_url, "public") == ["host"]
    assert tables_in(empty_pg_url, "public") == ["alembic_version"]


async def test_migrate_async_into_a_custom_schema(empty_pg_url: str) -> None:
    await migrate_async(empty_pg_url, schema="tenant_two")

    rows = await fetch(
        empty_pg_url,
        "SELECT schemaname, count(*) FROM pg_tables "
        "WHERE schemaname NOT IN ('pg_catalog', 'information_schema') GROUP BY schemaname",
    )
    assert rows == [("tenant_two", len(TABLES) + 1)]
    assert (await fetch(empty_pg_url, "SELECT version_num FROM tenant_two.alembic_version")) == [
        (HEAD,)
    ]


def test_the_cli_honours_coda_memory_schema(empty_pg_url: str) -> None:
    upgraded = alembic(empty_pg_url, "upgrade", "head", schema="tenant_three")
    assert upgraded.returncode == 0, upgraded.stderr
    assert tables_in(empty_pg_url, "tenant_three") == ["alembic_version", *TABLES]
    assert tables_in(empty_pg_url, "coda_memory") == []

    check = alembic(empty_pg_url, "check", schema="tenant_three")
    assert check.returncode == 0, check.stderr


NAMES = """
SELECT c.conname FROM pg_constraint c
JOIN pg_class r ON r.oid = c.conrelid
JOIN pg_namespace n ON n.oid = r.relnamespace
WHERE n.nspname = :schema AND r.relname <> 'alembic_version'
UNION ALL
SELECT indexname FROM pg_indexes WHERE schemaname = :schema AND tablename <> 'alembic_version'
ORDER BY 1
"""


async def test_migrated_names_match_the_naming_convention(empty_pg_url: str) -> None:
    """Constraint and index names from the migrations equal those schema.py produces."""
    await migrate_async(empty_pg_url)
    own = engine(empty_pg_url)
    try:
        async with own.begin() as conn:
            await conn.execute(text("CREATE SCHEMA mirror"))
            mirrored = await conn.execution_options(
                schema_translate_map=schema_translate_map("mirror")
            )
            await mirrored.run_sync(metadata.create_all)
    finally:
        await own.dispose()
    expected = await fetch(empty_pg_url, NAMES, schema="mirror")
    migrated = await fetch(empty_pg_url, NAMES, schema="coda_memory")

    assert migrated == expected
    assert ("ck_facts_confidence",) in migrated


def test_offline_mode_emits_the_ddl() -> None:
    sql = alembic("postgresql://offline.invalid/db", "upgrade", "head", "--sql")

    assert sql.returncode == 0, sql.stderr
    assert "CREATE SCHEMA IF NOT EXISTS coda_memory" in sql.stdout
    assert "CREATE TABLE coda_memory.observations" in sql.stdout
    # Every transaction sets it first, also those that begin after an autocommit block
    # (0002's concurrent index builds): the one after it had no lock timeout.
    transactions = re.split(r"^BEGIN;$", sql.stdout, flags=re.M)[1:]
    assert len(transactions) >= 2
    for transaction in transactions:
        first = next(line for line in transaction.splitlines() if line.strip())
        assert first == "SELECT set_config('lock_timeout', '5s', true) AS set_config_1;"


async def upgrade_from_0001_held_out(url: str, lock: str, *, wait: float) -> None:
    """From 0001, an upgrade while another connection's transaction holds ``lock`` (a LOCK
    TABLE statement) fails on its lock timeout, within 15 s (``wait``: how long it may
    take before it counts as waiting for good); released, the upgrade goes to head."""
    await migrate_async(url, revision="0001")
    holder = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        held = holder.transaction()
        await held.start()
        await holder.execute(lock)
        started = asyncio.get_running_loop().time()
        with pytest.raises(Exception, match="lock timeout"):
            await asyncio.wait_for(migrate_async(url), wait)
        assert asyncio.get_running_loop().time() - started < 15
        await held.rollback()
    finally:
        await holder.close()
    await migrate_async(url)
    assert await fetch(url, "SELECT version_num FROM coda_memory.alembic_version") == [(HEAD,)]


async def test_an_upgrade_past_0002_waits_for_a_held_table_at_most_its_lock_timeout(
    empty_pg_url: str,
) -> None:
    """From 0001 on, the transaction after 0002's index builds ran with no lock timeout:
    the upgrade queued behind a lock on checkpoints for as long as it was held."""
    await upgrade_from_0001_held_out(
        empty_pg_url, "LOCK TABLE coda_memory.checkpoints IN ACCESS SHARE MODE", wait=30
    )


def test_invalid_schema_names_never_reach_the_database() -> None:
    with pytest.raises(ValueError, match="schema name"):
        migrate("postgresql://unreachable.invalid/db", schema="x; DROP SCHEMA public")


async def test_migrate_inside_a_running_loop_fails_at_once_without_a_stray_coroutine(
    empty_pg_url: str,
) -> None:
    import coda_memory

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match=r"await coda_memory\.migrate_async"):
            coda_memory.migrate(empty_pg_url)
        gc.collect()

    assert not [w for w in caught if "never awaited" in str(w.message)]
    count = "SELECT count(*) FROM pg_tables WHERE schemaname = 'coda_memory'"
    assert await fetch(empty_pg_url, count) == [(0,)]
    await coda_memory.migrate_async(empty_pg_url)
    await coda_memory.migrate_async(empty_pg_url)
    assert (await fetch(empty_pg_url, "SELECT version_num FROM coda_memory.alembic_version")) == [
        (HEAD,)
    ]


def test_from_coda_memory_import_migrate_gives_the_function_every_time(
    empty_pg_url: str,
) -> None:
    from coda_memory import migrate as first

    first(empty_pg_url)
    from coda_memory import migrate as second

    second(empty_pg_url)

    assert first is second is migrate
    assert version_in(empty_pg_url, "coda_memory") == [HEAD]


async def test_env_accepts_a_sync_engine(empty_pg_url: str) -> None:
    """An ``Engine`` in ``config.attributes["connection"]`` (Alembic's cookbook); here the
    sync face of an asyncpg engine, driven from a greenlet as SQLAlchemy's asyncio does."""
    from sqlalchemy.util import greenlet_spawn

    own = engine(empty_pg_url)
    try:
        await greenlet_spawn(upgrade_on, own.sync_engine, "via_engine")
    finally:
        await own.dispose()

    assert (await fetch(empty_pg_url, "SELECT version_num FROM via_engine.alembic_version")) == [
        (HEAD,)
    ]


def test_env_rejects_anything_else_as_the_connection() -> None:
    config = alembic_config()
    config.attributes["connection"] = "postgresql://not-a-connection"

    with pytest.raises(TypeError, match="must be a Connection, an Engine or an AsyncEngine"):
        command.upgrade(config, "head")


def _statements(script: str) -> list[str]:
    """Alembic's offline output: one statement per paragraph, ending in ';', between
    comment lines."""
    code = "\n".join(line for line in script.splitlines() if not line.startswith("-- "))
    return [s.strip() for s in code.split(";\n\n") if s.strip()]


async def test_offline_sql_for_another_schema_builds_what_migrate_builds(
    empty_pg_url: str,
) -> None:
    script = migration_sql(schema="reviewed")

    # Outside string literals and comments (settings' names, a module named in a comment),
    # nothing names the default schema.
    code = re.sub(r"'(?:[^']|'')*'", "''", script)
    code = "\n".join(line for line in code.splitlines() if not line.startswith("-- "))
    assert "coda_memory." not in code
    assert "CREATE TABLE reviewed.observations" in script
    conn = await asyncpg.connect(str(asyncpg_url(empty_pg_url)).replace("+asyncpg", ""))
    try:
        for statement in _statements(script):
            await conn.execute(statement)
    finally:
        await conn.close()

    assert await fetch(
        empty_pg_url,
        "SELECT tablename FROM pg_tables WHERE schemaname = 'reviewed' ORDER BY 1",
    ) == [(t,) for t in ["alembic_version", *TABLES]]
    check = await asyncio.to_thread(alembic, empty_pg_url, "check", schema="reviewed")
    assert check.returncode == 0, check.stderr
    # The views work in the translated schema.
    assert await fetch(empty_pg_url, "SELECT count(*) FROM reviewed.tool_effectiveness") == [(0,)]


def test_cli_migrate_sql_prints_the_ddl_without_a_database() -> None:
    from typer.testing import CliRunner

    from coda_memory.cli import app

    env = {"CODA_MEMORY_DATABASE_URL": "postgresql://nobody@unreachable.invalid/db"}
    result = CliRunner().invoke(app, ["migrate", "--sql", "--schema", "dba_review"], env=env)

    assert result.exit_code == 0, result.output
    assert "CREATE TABLE dba_review.observations" in result.stdout
    assert f"UPDATE dba_review.alembic_version SET version_num='{HEAD}'" in result.stdout

    bad = CliRunner().invoke(app, ["migrate", "--sql", "--schema", "Bad-Name"])
    assert bad.exit_code == 2
    assert bad.stderr.startswith("error: invalid schema name")


def test_cli_migrate_sql_for_public_says_where_a_host_alembic_would_look() -> None:
    """Online, a first migration into public is refused; the DDL for a DBA created the
    version table there without a word."""
    from typer.testing import CliRunner

    from coda_memory.cli import app

    result = CliRunner().invoke(app, ["migrate", "--sql", "--schema", "public"])

    assert result.exit_code == 0, result.output
    assert "CREATE TABLE public.alembic_version" in result.stdout
    assert " ".join(result.stderr.split()) == (
        "note: this DDL creates coda-memory's Alembic version table in public, where a host "
        "application's Alembic looks for its own (its first upgrade would then fail on a "
        "revision it does not know); coda-memory migrate refuses a first migration there: "
        "use a schema of coda-memory's own"
    )
    quiet = CliRunner().invoke(app, ["migrate", "--sql", "--schema", "dba_review"])
    assert quiet.stderr == ""
    # From a revision, the DDL upgrades a version table that is there already, which
    # migrate would upgrade too: the note was false.
    upgrade = CliRunner().invoke(app, ["migrate", "--sql", "--schema", "public", "--from", "0018"])
    assert upgrade.exit_code == 0, upgrade.output
    assert "UPDATE public.alembic_version" in upgrade.stdout
    assert upgrade.stderr == ""


@pytest.mark.parametrize("args", [["migrate", "--sql"], ["grant", "app", "memory_app", "--print"]])
def test_the_cli_s_printed_sql_refuses_an_empty_schema_variable(args: list[str]) -> None:
    """The commands that print SQL without a database took an empty $CODA_MEMORY_SCHEMA
    (a variable a deploy script left unset) as no variable at all, and printed the DDL
    or grants of the default schema, perhaps another tenant's, where every other command
    refuses it."""
    from typer.testing import CliRunner

    from coda_memory.cli import app

    result = CliRunner().invoke(app, args, env={"CODA_MEMORY_SCHEMA": ""})
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr == "error: $CODA_MEMORY_SCHEMA is empty: give a schema, or unset it\n"


@pytest.mark.parametrize("url", ["redis://cache:6379/0", "memory://", "postgresql://a@b:0/c"])
def test_migrate_sql_reads_no_database_url(url: str) -> None:
    """``--sql`` needs no database, but Alembic's offline run read
    $CODA_MEMORY_DATABASE_URL for its dialect, and failed on one that names no Postgres
    (a Redis deployment's, which MemoryService.from_url takes) or that the driver would
    refuse."""
    from typer.testing import CliRunner

    from coda_memory.cli import app

    result = CliRunner().invoke(app, ["migrate", "--sql"], env={"CODA_MEMORY_DATABASE_URL": url})
    assert result.exit_code == 0, result.output
    assert "CREATE TABLE coda_memory.observations" in result.stdout
    assert migration_sql() == result.stdout


async def test_cli_migrate_sql_from_a_revision_prints_the_ddl_of_the_upgrade(
    empty_pg_url: str,
) -> None:
    """``--sql`` printed the DDL from an empty schema only: applied to a schema a revision
    behind head, it failed on every table that was there already."""
    from typer.testing import CliRunner

    from coda_memory.cli import app

    await migrate_async(empty_pg_url, revision="0016")
    result = CliRunner().invoke(app, ["migrate", "--sql", "--from", "0016"])
    assert result.exit_code == 0, result.output
    assert "CREATE TABLE coda_memory.observations" not in result.stdout
    # What a DBA runs with psql: the script as it is, in one simple query.
    conn = await asyncpg.connect(empty_pg_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute(result.stdout)
        assert await conn.fetchval("SELECT version_num FROM coda_memory.alembic_version") == HEAD
        assert await conn.fetchval(
            "SELECT count(*) FROM information_schema.columns WHERE table_schema = "
            "'coda_memory' AND table_name = 'redis_imports' AND column_name = 'bad_records'"
        )
    finally:
        await conn.close()

    for args, said in (
        (["migrate", "--sql", "--from", "9999"], "error: --from '9999': not a revision"),
        (["migrate", "--sql", "--from", ""], "error: --from '': not a revision"),
        (["migrate", "--sql", "--from", "0016:0017"], "error: --from '0016:0017': not a"),
        (["migrate", "--sql", "--from", "head"], "error: --from 'head': not a revision"),
        (["migrate", "--from", "0016"], "error: --from goes with --sql"),
    ):
        refused = CliRunner().invoke(app, args)
        assert refused.exit_code == 2
        assert refused.stderr.startswith(said)


def _invalid_indexes(url: str, schema: str = "coda_memory") -> list[Any]:
    return asyncio.run(
        fetch(
            url,
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = :schema AND NOT i.indisvalid",
            schema=schema,
        )
    )


@pytest.mark.parametrize("how", ["alembic upgrade head", "coda_memory.migrate(url)"])
def test_migrations_started_together_take_turns(empty_pg_url: str, how: str) -> None:
    """Replicas that all migrate as they start: nothing serialised them, so from an
    empty database one of two failed (a deadlock, a duplicate schema or type, a table
    that already existed), and now and then a CONCURRENTLY build left an invalid index
    behind at head, which no later migrate repaired."""
    if how.startswith("alembic"):
        executable = Path(sys.executable).with_name("alembic")
        alembic_command = (
            [str(executable)] if executable.exists() else [sys.executable, "-m", "alembic"]
        )
        command = [*alembic_command, "upgrade", "head"]
    else:
        script = (
            "import os, coda_memory; coda_memory.migrate(os.environ['CODA_MEMORY_DATABASE_URL'])"
        )
        command = [sys.executable, "-c", script]
    env = {**os.environ, "CODA_MEMORY_DATABASE_URL": empty_pg_url}
    env.pop("CODA_MEMORY_SCHEMA", None)
    runs = [
        subprocess.Popen(
            command,
            cwd=REPOSITORY,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0] * 4, outputs
    assert version_in(empty_pg_url, "coda_memory") == [HEAD]
    assert _invalid_indexes(empty_pg_url) == []


async def test_an_upgrade_from_0001_waits_for_a_writer_of_facts_at_most_its_lock_timeout(
    empty_pg_url: str,
) -> None:
    """0002 builds its indexes CONCURRENTLY, each statement a transaction of its own, in
    which the migration's transaction-local lock timeout no longer held: the build
    waited for an open transaction that wrote facts for as long as it stayed open."""
    # Once released, the interrupted build is dropped and done again.
    await upgrade_from_0001_held_out(
        empty_pg_url, "LOCK TABLE coda_memory.facts IN ROW EXCLUSIVE MODE", wait=60
    )
    assert await asyncio.to_thread(_invalid_indexes, empty_pg_url) == []


def test_a_host_history_numbered_like_ours_is_refused_and_left_untouched(
    empty_pg_url: str,
) -> None:
    """A host's Alembic history may number its revisions 0001, 0002, … too: taken for
    coda-memory's, it had 0002 build two indexes on the host's own facts table, commit
    them, and then fail on a table that did not exist."""
    asyncio.run(
        superuser(
            empty_pg_url,
            "CREATE SCHEMA hostc",
            "CREATE TABLE hostc.alembic_version (version_num varchar(32) PRIMARY KEY)",
            "INSERT INTO hostc.alembic_version VALUES ('0001')",
            "CREATE TABLE hostc.facts (identity_id text, category text, subject text,"
            " confidence float8, confidence_at timestamptz, ease_factor float8)",
        )
    )
    with pytest.raises(ForeignAlembicHistory, match="holds no table of coda-memory's"):
        migrate(empty_pg_url, schema="hostc")
    indexes = asyncio.run(
        fetch(empty_pg_url, "SELECT indexname FROM pg_indexes WHERE schemaname = 'hostc'")
    )
    assert all("facts" not in name for (name,) in indexes), indexes
    assert version_in(empty_pg_url, "hostc") == ["0001"]


def test_a_newer_coda_memory_s_schema_is_named_as_one(empty_pg_url: str) -> None:
    migrate(empty_pg_url)
    asyncio.run(
        superuser(empty_pg_url, "UPDATE coda_memory.alembic_version SET version_num = '0099'")
    )
    with pytest.raises(
        ForeignAlembicHistory, match=r"or a newer coda-memory's \(upgrade this one\)"
    ):
        migrate(empty_pg_url)


def test_an_app_role_keeps_its_grants_through_a_downgrade_below_0003(empty_pg_url: str) -> None:
    """0003 gave the import ledger no grant: after a downgrade below it and an upgrade,
    the app role could no longer forget (it deletes the identity's ledger rows)."""
    migrate(empty_pg_url)
    with granted_role(empty_pg_url, "app") as role:
        assert alembic(empty_pg_url, "downgrade", "0002").returncode == 0
        migrate(empty_pg_url)
        granted = asyncio.run(
            fetch(
                empty_pg_url,
                "SELECT privilege, has_table_privilege(:role, 'coda_memory.redis_imports',"
                " privilege) FROM unnest(ARRAY['SELECT', 'DELETE', 'INSERT', 'UPDATE'])"
                " AS privilege",
                role=role,
            )
        )
        # What grant_app.sql gives, no more.
        assert dict(granted) == {"SELECT": True, "DELETE": True, "INSERT": False, "UPDATE": False}


async def test_a_migration_on_a_callers_connection_does_not_wait_inside_its_transaction(
    empty_pg_url: str,
) -> None:
    """A caller's connection (pytest-alembic, Alembic's cookbook) cannot wait for another
    migration: its transaction's snapshot would be waited for by the other's index
    builds. It says another migration is under way instead."""
    holder = await asyncpg.connect(empty_pg_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await holder.execute(
            "SELECT pg_advisory_lock(hashtextextended('coda_memory.migrate:' || $1, 0))",
            "coda_memory",
        )
        own = engine(empty_pg_url)
        try:
            async with own.connect() as connection:
                with pytest.raises(MigrationUnderWay, match="'coda_memory' is under way"):
                    await connection.run_sync(upgrade_on)
        finally:
            await own.dispose()
    finally:
        await holder.close()
    assert await fetch(empty_pg_url, "SELECT to_regclass('coda_memory.observations')") == [(None,)]


async def test_a_migration_waiting_for_another_says_so_once(empty_pg_url: str) -> None:
    """It waited for as long as the other one ran, without a word: a deploy step (or
    coda-memory migrate) behind a stuck migration seemed to hang."""
    said: list[str] = []
    waiting = asyncio.Event()

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())
            waiting.set()

    handler = Said(logging.WARNING)
    logging.getLogger("coda_memory").addHandler(handler)
    lock = "hashtextextended('coda_memory.migrate:' || $1, 0)"
    holder = await asyncpg.connect(empty_pg_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await holder.execute(f"SELECT pg_advisory_lock({lock})", "coda_memory")
        migrating = asyncio.create_task(migrate_async(empty_pg_url))
        await asyncio.wait_for(waiting.wait(), 30)
        assert not migrating.done()
        await holder.execute(f"SELECT pg_advisory_unlock({lock})", "coda_memory")
        await asyncio.wait_for(migrating, 120)
    finally:
        await holder.close()
        logging.getLogger("coda_memory").removeHandler(handler)

    assert said == [
        "coda-memory: another migration of schema 'coda_memory' is under way; waiting for it to end"
    ]
    assert await fetch(empty_pg_url, "SELECT version_num FROM coda_memory.alembic_version") == [
        (HEAD,)
    ]


@pytest.mark.parametrize("url", ["memory://", "null://", "redis://127.0.0.1:1/0"])
async def test_a_store_without_a_schema_has_nothing_to_migrate(url: str) -> None:
    """The README's start-up script with "memory://" in tests failed at migrate_async:
    "unsupported database URL scheme 'memory'"."""
    await migrate_async(url)
    await asyncio.to_thread(migrate, url)


async def test_a_callers_connection_holds_the_migration_lock_past_0002(
    empty_pg_url: str,
) -> None:
    """On a caller's connection the lock was the transaction's: 0002's own commit (around
    its CONCURRENTLY builds) released it, and every revision after ran unguarded."""
    dsn = empty_pg_url.replace("postgresql+asyncpg://", "postgresql://")
    probes: list[bool] = []

    async def probe() -> bool:
        other = await asyncpg.connect(dsn)
        try:
            key = "hashtextextended('coda_memory.migrate:' || $1, 0)"
            got = bool(await other.fetchval(f"SELECT pg_try_advisory_lock({key})", "coda_memory"))
            if got:
                await other.fetchval(f"SELECT pg_advisory_unlock({key})", "coda_memory")
            return got
        finally:
            await other.close()

    def probed(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # A table of 0005, long after 0002's commit: is the lock still held?
        if statement.startswith("\nCREATE TABLE") and "ingest_batches (" in statement:
            result: list[bool] = []
            thread = threading.Thread(target=lambda: result.append(asyncio.run(probe())))
            thread.start()
            thread.join()
            probes.extend(result)

    own = engine(empty_pg_url)
    try:
        async with own.connect() as connection:

            def upgrade(sync: Any) -> None:
                event.listen(sync, "before_cursor_execute", probed)
                upgrade_on(sync)

            await connection.run_sync(upgrade)
            await connection.commit()
    finally:
        await own.dispose()
    assert probes == [False]  # held: another migrator could not have taken it
    assert await probe()  # and released once the caller committed


#: Rows no consolidation can read, as an operator might write them by hand: (metadata,
#: created_at, the check that refuses the row).
UNREADABLE_ROWS = [
    ('\'["toolName", "t1"]\'', "now()", "ck_observations_metadata_object"),
    ("'\"hello\"'", "now()", "ck_observations_metadata_object"),
    ("'null'", "now()", "ck_observations_metadata_object"),
    ("'5'", "now()", "ck_observations_metadata_object"),
    ("'{}'", "'infinity'", "ck_observations_created_at_finite"),
    ("'{}'", "'-infinity'", "ck_observations_created_at_finite"),
]


def _insert_by_hand(metadata: str, created_at: str) -> str:
    return (
        "INSERT INTO coda_memory.observations (identity_id, type, content, metadata, "
        f"created_at) VALUES ('ana', 'query_pattern', 'q', {metadata}::jsonb, {created_at})"
    )


async def validated(url: str) -> list[tuple[str, bool]]:
    """The checks of 0019, and whether each is validated."""
    return await fetch(
        url,
        "SELECT conname, convalidated FROM pg_constraint WHERE conrelid = "
        "'coda_memory.observations'::regclass "
        "AND conname IN ('ck_observations_created_at_finite', 'ck_observations_metadata_object') "
        "ORDER BY 1",
    )


async def test_0019_refuses_rows_no_consolidation_could_read_and_finds_older_ones(
    empty_pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Such a row stopped every consolidation of its identity for good (AttributeError:
    'list' object has no attribute 'get'). Written before 0019, it stays, the upgrade
    goes on with that check not validated and says so, and VALIDATE CONSTRAINT finds it."""
    await migrate_async(empty_pg_url, revision="0018")
    await fetch(empty_pg_url, _insert_by_hand("'[]'", "now()"))
    with caplog.at_level(logging.WARNING, "coda_memory"):
        await migrate_async(empty_pg_url)
    (line,) = [r.getMessage() for r in caplog.records if "written by hand" in r.getMessage()]
    assert "ck_observations_metadata_object" in line and "VALIDATE CONSTRAINT" in line
    assert await validated(empty_pg_url) == [
        ("ck_observations_created_at_finite", True),
        ("ck_observations_metadata_object", False),
    ]
    for stored, created_at, check in UNREADABLE_ROWS:
        with pytest.raises(Exception, match=f'violates check constraint "{check}"'):
            await fetch(empty_pg_url, _insert_by_hand(stored, created_at))
    await fetch(empty_pg_url, _insert_by_hand('\'{"domain": "royalties"}\'', "now()"))
    with pytest.raises(Exception, match=r'"ck_observations_metadata_object" .* violated'):
        await fetch(
            empty_pg_url,
            "ALTER TABLE coda_memory.observations "
            "VALIDATE CONSTRAINT ck_observations_metadata_object",
        )
    await fetch(
        empty_pg_url,
        "ALTER TABLE coda_memory.observations "
        "VALIDATE CONSTRAINT ck_observations_created_at_finite",
    )
    rows = await fetch(empty_pg_url, "SELECT count(*) FROM coda_memory.observations")
    assert rows == [(2,)]
    # Mended, the row passes, and the check is validated.
    await fetch(empty_pg_url, "UPDATE coda_memory.observations SET metadata = '{}'")
    await fetch(
        empty_pg_url,
        "ALTER TABLE coda_memory.observations VALIDATE CONSTRAINT ck_observations_metadata_object",
    )
    assert all(valid for _, valid in await validated(empty_pg_url))


async def test_0019_validates_its_checks_where_no_row_fails_them(empty_pg_url: str) -> None:
    await migrate_async(empty_pg_url, revision="0018")
    await fetch(empty_pg_url, _insert_by_hand("'{}'", "now()"))
    await migrate_async(empty_pg_url)
    assert await validated(empty_pg_url) == [
        ("ck_observations_created_at_finite", True),
        ("ck_observations_metadata_object", True),
    ]


async def test_0019_validates_with_no_lock_that_appends_wait_for(empty_pg_url: str) -> None:
    """Adding a check takes the table's ACCESS EXCLUSIVE lock. Validated in the same
    transaction, the whole scan of observations ran under it: every append and read of
    the service waited for it (minutes, on a large table). The lock is committed first."""
    from sqlalchemy.util import await_only, greenlet_spawn

    held: list[list[tuple[Any, ...]]] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "VALIDATE CONSTRAINT" in statement:
            held.append(
                await_only(
                    fetch(
                        empty_pg_url,
                        "SELECT mode FROM pg_locks WHERE granted "
                        "AND relation = to_regclass('coda_memory.observations')",
                    )
                )
            )

    await migrate_async(empty_pg_url, revision="0018")
    own = engine(empty_pg_url)
    event.listen(own.sync_engine, "before_cursor_execute", before)
    try:
        await greenlet_spawn(upgrade_on, own.sync_engine)
    finally:
        await own.dispose()
    assert len(held) == 2
    assert all(("AccessExclusiveLock",) not in locks for locks in held), held
    assert await validated(empty_pg_url) == [
        ("ck_observations_created_at_finite", True),
        ("ck_observations_metadata_object", True),
    ]


VERSION = "SELECT version_num FROM coda_memory.alembic_version"


async def test_0019_cut_short_in_a_validation_runs_again(
    empty_pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A validation that a lock timeout (a manual VACUUM took the lock it needs once the
    checks were committed) or a kill cut short left the checks committed at revision
    0018: every later upgrade failed with 'constraint ... already exists'. It now leaves
    them NOT VALID and goes on; and an upgrade that finds them added adds them no more."""
    from sqlalchemy.util import await_only, greenlet_spawn

    monkeypatch.setattr(schema_module, "MIGRATION_LOCK_TIMEOUT", "200ms")
    await migrate_async(empty_pg_url, revision="0018")
    own, other = engine(empty_pg_url), engine(empty_pg_url)
    holder = await other.connect()
    await holder.begin()

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "VALIDATE CONSTRAINT" in statement:  # (taken once: the holder keeps it)
            await_only(
                holder.execute(
                    text("LOCK TABLE coda_memory.observations IN SHARE UPDATE EXCLUSIVE MODE")
                )
            )

    event.listen(own.sync_engine, "before_cursor_execute", before)
    try:
        # (To 0019: a later migration that alters observations waits for the holder.)
        await greenlet_spawn(upgrade_on, own.sync_engine, None, "0019")
    finally:
        await holder.rollback()
        await holder.close()
        await own.dispose()
        await other.dispose()
    assert await fetch(empty_pg_url, VERSION) == [("0019",)]
    assert await validated(empty_pg_url) == [
        ("ck_observations_created_at_finite", False),
        ("ck_observations_metadata_object", False),
    ]
    # As a kill between the checks' commit and the version's would leave it.
    await fetch(empty_pg_url, "UPDATE coda_memory.alembic_version SET version_num = '0018'")
    await migrate_async(empty_pg_url)
    assert await validated(empty_pg_url) == [
        ("ck_observations_created_at_finite", True),
        ("ck_observations_metadata_object", True),
    ]


async def test_0019_on_a_callers_connection_in_a_transaction(empty_pg_url: str) -> None:
    """Alembic's cookbook (``with engine.begin() as connection``): alembic's
    autocommit_block fails on a transaction it did not begin, so the checks stay NOT
    VALID there, with the statements to validate them logged."""
    await migrate_async(empty_pg_url, revision="0018")
    own = engine(empty_pg_url)
    try:
        async with own.begin() as conn:
            await conn.run_sync(upgrade_on)
    finally:
        await own.dispose()
    assert await fetch(empty_pg_url, VERSION) == [(HEAD,)]
    assert await validated(empty_pg_url) == [
        ("ck_observations_created_at_finite", False),
        ("ck_observations_metadata_object", False),
    ]
