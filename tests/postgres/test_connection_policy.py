"""The connection policy: a dead connection is retried once for idempotent work only,
and every path of the store, maintenance and analytics goes through it.

Connections are killed for real, with ``pg_terminate_backend`` (waiting until the backend
is gone), while they sit idle in the store's pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import make_url, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from coda_memory.core.logs import short_error
from coda_memory.errors import ConnectionLost
from coda_memory.postgres import PostgresStore
from coda_memory.postgres.analytics import rebuild_rollups, tool_effectiveness
from coda_memory.postgres.connection import error_reason, is_connection_error, run
from coda_memory.postgres.engine import driver_connection
from coda_memory.postgres.maintenance import (
    pending_identities,
    pending_observations,
    prune_consolidated,
    store_stats,
)
from tests.postgres.helpers import (
    NOW,
    backends_once_closed,
    consolidate,
    event,
    fact,
    fetch,
    record,
)


async def kill_pooled_connections(store: PostgresStore, admin_url: str) -> None:
    """Leave a connection idle in the store's pool, then terminate it (and any other of
    the store's database), returning once the backends are gone."""
    await store.facts("alice")
    assert await terminate_backends(store, admin_url) >= 1


async def terminate_backends(store: PostgresStore, admin_url: str) -> int:
    """Terminate every backend of the store's database, returning once they are gone;
    how many there were."""
    killed = await fetch(
        admin_url,
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) "
        "FROM pg_stat_activity WHERE datname = :db AND pid <> pg_backend_pid()",
        db=store.engine.url.database,
    )
    return int(killed[0][0])


async def through_sqlalchemy(conn: AsyncConnection) -> int:
    return int((await conn.execute(text("SELECT 1"))).scalar_one())


async def through_asyncpg(conn: AsyncConnection) -> int:
    return int(await (await driver_connection(conn)).fetchval("SELECT 1"))


WORK = [through_sqlalchemy, through_asyncpg]


async def dividing_by_zero(conn: AsyncConnection) -> None:
    await conn.execute(text("SELECT 1 / 0"))


@dataclass
class Counted:
    """``statement`` as the work given to :func:`run`, counting the attempts made."""

    statement: Callable[[AsyncConnection], Awaitable[Any]]
    attempts: int = 0

    async def __call__(self, conn: AsyncConnection) -> Any:
        self.attempts += 1
        return await self.statement(conn)


@pytest.mark.parametrize("statement", WORK, ids=["sqlalchemy", "asyncpg"])
async def test_idempotent_work_on_a_dead_connection_runs_once_more(
    pg_store: PostgresStore, admin_url: str, statement: Callable[..., Awaitable[int]]
) -> None:
    work = Counted(statement)
    await kill_pooled_connections(pg_store, admin_url)
    assert await run(pg_store.engine, pg_store.schema, work, idempotent=True) == 1
    assert work.attempts == 2


async def test_connections_found_dead_together_replace_the_pool_once(
    pg_url: str, admin_url: str
) -> None:
    """Each of three peeks that found its connection dead replaced the pool: the second
    replacement dropped the pool the first had made, with the connection made in it
    meanwhile still open, left to the garbage collector (store.close() could not reach
    it)."""
    store = PostgresStore.from_url(pg_url, pool_size=3)
    try:
        await store.start()  # three connections in the request pool
        assert await terminate_backends(store, admin_url) >= 3
        await asyncio.gather(*(store.peek(f"user-{n}") for n in range(3)))
    finally:
        await store.close()
    assert await backends_once_closed(admin_url, store.engine.url.database) == 0


@pytest.mark.parametrize("statement", WORK, ids=["sqlalchemy", "asyncpg"])
async def test_other_work_on_a_dead_connection_is_not_retried(
    pg_store: PostgresStore, admin_url: str, statement: Callable[..., Awaitable[int]]
) -> None:
    work = Counted(statement)
    await kill_pooled_connections(pg_store, admin_url)
    with pytest.raises(ConnectionLost):
        await run(pg_store.engine, pg_store.schema, work, idempotent=False)
    assert work.attempts == 1
    # The dead pool was replaced: the next work runs at the first attempt.
    assert await run(pg_store.engine, pg_store.schema, work, idempotent=False) == 1


async def test_an_error_that_is_not_a_dead_connection_is_not_retried(
    pg_store: PostgresStore,
) -> None:
    work = Counted(dividing_by_zero)
    with pytest.raises(Exception, match="division by zero"):
        await run(pg_store.engine, pg_store.schema, work, idempotent=True)
    assert work.attempts == 1


async def consolidation(store: PostgresStore) -> Any:
    return await consolidate(store)


async def rebuilt(store: PostgresStore) -> Any:
    await rebuild_rollups(store)
    url = store.engine.url.render_as_string(hide_password=False)
    return await fetch(url, "SELECT sum(successes) FROM coda_memory.tool_daily")


SUBJECT = "tool_affinity:get_account"

#: Each path, and what it gives on the data of the test below (alice: one observation
#: consumed by a run that wrote one fact and its event, one observation waiting): a
#: path that swallowed the error and answered empty would not give it.
PATHS: dict[str, tuple[Callable[[PostgresStore], Awaitable[Any]], Callable[[Any], Any], Any]] = {
    "append": (lambda store: store.append([record("after")]), lambda r: r.stored, 1),
    "consolidation": (
        consolidation,
        lambda r: ([o.content for o in r.observations], [f.subject for f in r.facts]),
        (["pending"], [SUBJECT]),
    ),
    # No facts when observations wait, and that some do (see PostgresStore.peek).
    "peek": (lambda store: store.peek("alice"), lambda r: (r[0], r[1]), ([], True)),
    "facts": (lambda store: store.facts("alice"), lambda r: [f.subject for f in r], [SUBJECT]),
    "history": (lambda store: store.history("alice"), lambda r: [e.subject for e in r], [SUBJECT]),
    "observations": (
        lambda store: store.observations("alice"),
        lambda r: [o.content for o in r],
        ["before", "pending"],
    ),
    "checkpoint": (
        lambda store: store.checkpoint("alice"),
        lambda r: (r.runs, r.observations_consumed),
        (1, 1),
    ),
    "forget": (
        lambda store: store.forget("alice"),
        lambda r: (r.observations, r.facts, r.fact_events),
        (2, 1, 1),
    ),
    "pending_identities": (pending_identities, list, ["alice"]),
    "pending_observations": (pending_observations, int, 1),
    "prune_consolidated": (
        lambda store: prune_consolidated(store, before=NOW - timedelta(days=7)),
        lambda r: (r.identities, r.deleted),
        (1, 0),
    ),
    "store_stats": (
        store_stats,
        lambda r: (r.identities, r.observations, r.pending_observations, r.facts, r.fact_events),
        (1, 2, 1, 1, 1),
    ),
    "tool_effectiveness": (
        lambda store: tool_effectiveness(store, min_users=1, now=NOW),
        lambda r: [(t.tool_name, t.successes) for t in r],
        [("get_account", 2)],
    ),
    "rebuild_rollups": (rebuilt, lambda r: r[0][0], 2),
}


@pytest.mark.parametrize("path", sorted(PATHS))
async def test_every_path_recovers_from_a_dead_pooled_connection(
    pg_store: PostgresStore, admin_url: str, path: str
) -> None:
    await pg_store.append([record("before")])
    await consolidate(pg_store, upserts=[fact(SUBJECT)], events=[event(SUBJECT)])
    await pg_store.append([record("pending", session_id="s2")])
    await kill_pooled_connections(pg_store, admin_url)
    work, seen, expected = PATHS[path]
    # It would raise if the dead connection were not replaced.
    assert seen(await work(pg_store)) == expected


async def test_the_admin_pool_has_a_command_timeout_of_its_own(pg_url: str) -> None:
    """A statement past command_timeout fails on the request and writer pools; the admin
    pool, whose rebuilds and analytics scan whole tables, waits admin_command_timeout."""
    store = PostgresStore.from_url(
        pg_url, command_timeout=0.2, admin_command_timeout=5.0, statement_timeout=None
    )

    async def sleep(conn: AsyncConnection) -> None:
        await (await driver_connection(conn)).execute("SELECT pg_sleep(0.5)")

    try:
        await run(store.engine, store.schema, sleep, idempotent=False)  # admin: fine
        for engine in (store.request_engine, store.writer_engine):
            with pytest.raises((TimeoutError, ConnectionLost)):
                await run(engine, store.schema, sleep, idempotent=False)
    finally:
        await store.close()


class _ServerError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"SQLSTATE {sqlstate}")
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("statement", "state", "transient"),
    [
        # Raised by the connection itself: connecting to a database that refuses
        # connections now, a refused password.
        (None, "55000", True),
        (None, "28P01", True),
        # ... unless it refuses a value (a deferred constraint at COMMIT): no retry mends it.
        (None, "23505", False),
        # Raised by a statement of the work: the work's own error.
        ("INSERT INTO x VALUES (1)", "55000", False),
        ("INSERT INTO x VALUES (1)", "57P01", True),
    ],
)
def test_an_error_of_the_connection_itself_is_worth_retrying(
    statement: str | None, state: str, transient: bool
) -> None:
    error = DBAPIError(statement, None, _ServerError(state))
    assert is_connection_error(error) is transient


async def test_a_value_the_driver_refused_is_not_quoted_in_a_logged_reason(
    pg_store: PostgresStore,
) -> None:
    """asyncpg quotes the start of a refused argument's value on its message's first
    line, which the log lines keep: it may be a tenant's data."""
    value = "alice@example.com (her notes)"

    async def refused(conn: AsyncConnection) -> None:
        await conn.execute(text("SELECT CAST(:n AS integer)"), {"n": value})

    with pytest.raises(DBAPIError) as wrapped:
        await run(pg_store.engine, pg_store.schema, refused, idempotent=True)
    driver_error = wrapped.value.orig.__cause__  # type: ignore[union-attr]
    assert driver_error is not None and "alice" in str(driver_error)  # asyncpg quotes it
    for reason in (
        error_reason(wrapped.value),
        error_reason(driver_error),
        short_error(driver_error),
        short_error(wrapped.value),
    ):
        assert "alice" not in reason and "notes" not in reason, reason
    assert "invalid input for query argument $1: <value> (" in short_error(driver_error)


async def _consolidation(store: PostgresStore) -> None:
    async with store.consolidation("alice"):
        pass


#: Each call of the store, on the store given.
STORE_CALLS: dict[str, Callable[[PostgresStore], Awaitable[Any]]] = {
    "facts": lambda store: store.facts("alice"),
    "peek": lambda store: store.peek("alice"),
    "history": lambda store: store.history("alice"),
    "forget": lambda store: store.forget("alice"),
    "append": lambda store: store.append([record("alice")]),
    "consolidation": _consolidation,
}


@pytest.mark.parametrize(
    ("url", "where"),
    [
        ("postgresql://postgres@[::1]:1/app", "[::1]:1"),
        ("postgresql://postgres@/app?host=/nonexistent-socket-dir", "/nonexistent-socket-dir"),
        (
            "postgresql://postgres@/app?host=/nonexistent-socket-dir&port=6543",
            "/nonexistent-socket-dir port 6543",
        ),
        (
            "postgresql://postgres@/app?host=127.0.0.1,127.0.0.1&port=1,2",
            "127.0.0.1,127.0.0.1 port 1,2",
        ),
    ],
)
async def test_a_server_out_of_reach_is_named_as_the_url_gives_it(url: str, where: str) -> None:
    """A unix socket's directory or several hosts, given in the query, were named
    "localhost:5432", which the store never tried; an IPv6 host ran into its port."""
    store = PostgresStore.from_url(url)
    try:
        with pytest.raises(ConnectionLost) as raised:
            await store.facts("alice")
        assert f"cannot reach the database at {where} (" in str(raised.value)
    finally:
        await store.close()


@pytest.mark.parametrize("server", ["closed port", "no such database"])
async def test_every_call_of_a_store_that_cannot_connect_raises_connection_lost(
    pg_url: str, server: str
) -> None:
    """As from the Redis store, and from start(): a ConnectionLost naming the server and
    its reason, not the driver's bare ConnectionRefusedError (nor its
    InvalidCatalogNameError), which a host could not tell from a bug."""
    real = make_url(pg_url)
    if server == "closed port":
        url, where, reason = (
            "postgresql://postgres@127.0.0.1:1/app",
            "127.0.0.1:1",
            "ConnectionRefusedError",
        )
    else:
        missing = real.set(database="coda_memory_no_such_database")
        url = missing.render_as_string(hide_password=False)
        # A unix socket (the embedded server's) is named by its directory.
        socket = real.query.get("host")
        where = (
            socket if isinstance(socket, str) else f"{real.host or 'localhost'}:{real.port or 5432}"
        )
        reason = 'database "coda_memory_no_such_database" does not exist'
    store = PostgresStore.from_url(url)
    try:
        for name, call in STORE_CALLS.items():
            with pytest.raises(ConnectionLost) as raised:
                await call(store)
            message = str(raised.value)
            assert f"cannot reach the database at {where} (" in message, name
            assert reason in message, name
    finally:
        await store.close()


async def test_start_after_the_pools_connections_died_opens_new_ones(
    pg_url: str, admin_url: str
) -> None:
    """start() on pools whose connections the server had ended (a restart, terminated
    backends) raised ConnectionLost saying it could not reach the database, which
    answered: the host logged that memory was not warmed up, and the first requests paid
    for it. It warms new connections instead, as every other call replaces them."""
    store = PostgresStore.from_url(pg_url, pool_size=2, writer_pool_size=1)
    try:
        await store.start()
        assert await terminate_backends(store, admin_url) >= 3
        await store.start()
        assert await store.peek("alice") == ([], False)
    finally:
        await store.close()
