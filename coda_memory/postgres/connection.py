"""The one connection policy: what a dead connection is, and when work is retried.

The engine has no ``pool_pre_ping`` (see :func:`~coda_memory.postgres.engine.create_engine`),
so a connection that died while idle in the pool (server restart, terminated backend)
fails on first use. Every path of the store, maintenance and analytics reaches the
database through this module:

* :func:`run` gives work a connection. When the connection turns out to be dead, the pool
  is replaced (its siblings are presumed dead too) and *idempotent* work runs once more:
  reads, and work done in one transaction that a lost connection rolls back (append,
  forget, a prune batch, a rollup rebuild). Other work raises :class:`ConnectionLost`.
* :func:`driver_transaction` gives the consolidation unit an asyncpg connection inside a
  transaction. Beginning is retried once (nothing was done yet); once the unit has
  begun, a dead connection raises :class:`ConnectionLost` and nothing of the unit is kept.
* Once a store has :func:`released` an engine (it closes), a connection that work still
  held comes back closed rather than into the pool, and dead connections are not retried:
  ``dispose`` closes only the connections idle in the pool, and one that a call still used
  then would stay open, in a pool nothing uses, until the garbage collector found it.

:func:`is_dead_connection` recognises both asyncpg's own errors (statements sent on the
driver connection) and SQLAlchemy's wrapped ones.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar

import asyncpg
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.pool import Pool

from coda_memory.core.cancellation import run_to_end
from coda_memory.core.logs import without_argument_values
from coda_memory.core.model import MAX_INT32
from coda_memory.core.options import NONE, require_types
from coda_memory.errors import ConnectionLost
from coda_memory.postgres.engine import driver_connection, opened_connections, schema_required

T = TypeVar("T")

#: What asyncpg raises on a connection that is gone, including mid-operation, when the
#: server's termination message races the next request (InternalClientError).
_DEAD = (
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
)


def error_reason(exc: BaseException) -> str:
    """The first line of a server's, driver's or encoder's message, without SQLAlchemy's
    wrapping (no statement, no parameters) nor a query argument's value that the driver
    quotes."""
    orig = getattr(exc, "orig", None)
    cause = exc.__cause__ if orig is None else (orig.__cause__ or orig)
    lines = str(cause if cause is not None else exc).strip().splitlines()
    return without_argument_values(lines[0])[:200] if lines else type(exc).__name__


def is_dead_connection(error: BaseException) -> bool:
    """True when ``error`` (asyncpg's or SQLAlchemy's) says the connection is gone."""
    if isinstance(error, DBAPIError) and error.connection_invalidated:
        return True
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, _DEAD):
            return True
        seen = seen.__cause__ or (seen.orig if isinstance(seen, DBAPIError) else None)
    return False


#: SQLSTATE of a write refused because the session only reads (read_only_sql_transaction):
#: a hot standby, a writer that a failover demoted (Aurora, Patroni), a role or server
#: with default_transaction_read_only.
READ_ONLY = "25006"


#: After a write that the server refused for reading only, how long an engine's
#: transactions (the consolidations) fail at once, without taking a connection: a server
#: that stays read-only is asked for a new connection once in that time, not at every
#: load (one per load took 182 connections for 200 loads, and pushed loads past their
#: timeout); one that became writable again is used again after it at the latest.
READ_ONLY_PAUSE = 1.0

#: When each engine last met a server that only reads (its loop's clock).
_READ_ONLY_SEEN: weakref.WeakKeyDictionary[AsyncEngine, float] = weakref.WeakKeyDictionary()


def is_read_only(error: BaseException) -> bool:
    """True when ``error`` says the connection's session only reads: it is of no use to
    this library, and thrown away (not given back to its pool), so that the next one,
    made after a failover, reaches the server that writes now. The pool's other
    connections are not replaced with it: each one made before is thrown away when it
    fails the same way (a disposed pool would leave them open)."""
    return sqlstate(error) == READ_ONLY


def _note_read_only(engine: AsyncEngine, error: BaseException) -> None:
    if is_read_only(error):
        _READ_ONLY_SEEN[engine] = asyncio.get_running_loop().time()


def _refuse_if_read_only(engine: AsyncEngine, doing: str) -> None:
    """Raise :class:`ConnectionLost` when ``engine`` met a server that only reads less than
    :data:`READ_ONLY_PAUSE` ago."""
    seen = _READ_ONLY_SEEN.get(engine)
    if seen is None:
        return
    ago = asyncio.get_running_loop().time() - seen
    if 0 <= ago < READ_ONLY_PAUSE:
        raise ConnectionLost(
            f"the server only reads (a standby, or a failover under way) {doing}: "
            f"asked again {READ_ONLY_PAUSE - ago:.2f} s from now"
        )


def is_unusable(error: BaseException) -> bool:
    """The connection is dead (:func:`is_dead_connection`) or only reads
    (:func:`is_read_only`): thrown away, never given back to its pool."""
    return is_dead_connection(error) or is_read_only(error)


#: SQLSTATE of a lock wait that ``lock_timeout`` ended (lock_not_available).
LOCK_NOT_AVAILABLE = "55P03"
#: SQLSTATE of "permission denied" (insufficient_privilege).
INSUFFICIENT_PRIVILEGE = "42501"
#: SQLSTATE of a statement, or a lock wait, that ``statement_timeout`` ended
#: (query_canceled; also a cancel request).
QUERY_CANCELED = "57014"


#: SQLSTATEs of a server that can't serve the connection now: connection exceptions (08),
#: shutdown or restart (57P01-57P03) and too many connections.
_UNAVAILABLE = ("08", "57P", "53300")


def is_connection_error(error: BaseException) -> bool:
    """True when ``error`` says the connection (or the server behind it) is gone or not
    available now: what is worth retrying later, unlike an error in the work itself.

    That includes an error SQLAlchemy raised with no statement: the connection's own
    (connecting, to a database not accepting connections now, with a password the server
    refused), which no value of the work can have caused; unless it says a value was
    refused (a deferred constraint at COMMIT would), which retrying cannot mend."""
    if is_unusable(error):
        return True
    if isinstance(error, DBAPIError) and error.statement is None and not is_data_error(error):
        return True
    seen: BaseException | None = error
    while seen is not None:
        state = getattr(seen, "sqlstate", None)
        if isinstance(state, str) and state.startswith(_UNAVAILABLE):
            return True
        seen = seen.__cause__ or (seen.orig if isinstance(seen, DBAPIError) else None)
    return False


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a server error, raised by asyncpg or wrapped by SQLAlchemy."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            break
        state = getattr(seen, "sqlstate", None)
        if isinstance(state, str):
            return state
        seen = getattr(seen, "orig", None) or seen.__cause__
    return None


def is_data_error(exc: BaseException) -> bool:
    """True when ``exc`` says a value was refused: a data exception (SQLSTATE class 22:
    out of range, a NUL character, …), a broken constraint (class 23) or a value past a
    limit of Postgres's own (class 54: too long to index, …)."""
    return (sqlstate(exc) or "")[:2] in ("22", "23", "54")


#: The longest timeout Postgres takes: its timeouts are 32-bit milliseconds (24.8 days).
MAX_TIMEOUT = timedelta(milliseconds=MAX_INT32)


def timeout_setting(value: timedelta | None, name: str) -> str:
    """``value`` as a Postgres timeout setting, ``'<n>ms'`` (None, zero or less: ``0ms``,
    no limit; a positive value under a millisecond: ``1ms``, since Postgres reads 0 as no
    limit at all); ValueError naming ``name`` past MAX_TIMEOUT, which Postgres refuses
    (every statement that set it would fail)."""
    require_types(**{name: (value, (timedelta, NONE), "a timedelta (or None)")})
    if value is not None and value > MAX_TIMEOUT:
        raise ValueError(f"{name} must be at most {MAX_TIMEOUT} (Postgres's limit), not {value}")
    if value is None or value <= timedelta(0):
        return "0ms"
    return f"{max(1, round(value.total_seconds() * 1000))}ms"


def lock_timeout_clause(lock_timeout: timedelta | None, name: str = "lock_timeout") -> str:
    """``SET LOCAL lock_timeout`` for the current transaction (None or zero: no limit).

    The value is a formatted integer, never a value from outside.
    """
    return f"SET LOCAL lock_timeout = '{timeout_setting(lock_timeout, name)}'"


#: Where a transaction keeps its lock timeout while a shorter one applies (short_locks).
SAVED_LOCK_TIMEOUT = "coda_memory.saved_lock_timeout"
#: Keeps the current lock timeout there (an expression, for a select list).
SAVE_LOCK_TIMEOUT = f"set_config('{SAVED_LOCK_TIMEOUT}', current_setting('lock_timeout'), true)"
#: Puts back the lock timeout that short_locks kept.
RESTORE_LOCK_TIMEOUT = (
    f"SELECT set_config('lock_timeout', current_setting('{SAVED_LOCK_TIMEOUT}'), true)"
)


def short_locks(savepoint: str, lock_timeout: timedelta) -> str:
    """Open ``savepoint``, keep the current lock timeout, and shorten it to
    ``lock_timeout`` (one round trip; rolling back to the savepoint restores it too):
    for a step that does something else when a table is locked, rather than wait."""
    return f"SAVEPOINT {savepoint}; SELECT {SAVE_LOCK_TIMEOUT}; {lock_timeout_clause(lock_timeout)}"


def undo_savepoint(savepoint: str) -> str:
    """Roll back to ``savepoint`` (what short_locks opened) and release it."""
    return f"ROLLBACK TO SAVEPOINT {savepoint}; RELEASE SAVEPOINT {savepoint}"


#: The engines of stores that closed (see :func:`released`).
_RELEASED: weakref.WeakSet[AsyncEngine] = weakref.WeakSet()


def released(engine: AsyncEngine) -> None:
    """Mark ``engine`` as released by its store (before it is disposed): from then on, a
    connection that work gives back is closed, not pooled, and none is retried."""
    _RELEASED.add(engine)


#: Seconds :func:`dispose` waits for the server to answer the close of its connections.
GRACEFUL_CLOSE = 1.0


async def dispose(engines: Collection[AsyncEngine], graceful: float | None = None) -> None:
    """Close the pooled connections of ``engines``, all at once. A server that does not
    answer within ``graceful`` seconds (None: :data:`GRACEFUL_CLOSE`), or a caller
    cancelled meanwhile, has the engines' connections ended from this side: their sockets
    are closed, and the disposal ends at once. Cut short instead, it left a connection
    half-closed and SQLAlchemy's pool logged an error with its traceback."""
    if graceful is None:
        graceful = GRACEFUL_CLOSE
    tasks = [asyncio.ensure_future(engine.dispose()) for engine in engines]
    for task in tasks:
        # Read even when nobody awaits it any more (a caller cancelled twice).
        task.add_done_callback(_retrieved)
    try:
        await asyncio.wait(tasks, timeout=graceful)
    finally:
        if not all(task.done() for task in tasks):
            for engine in engines:
                for driver in opened_connections(engine):
                    driver.terminate()  # does nothing to one already closed
            # Each close now finds its connection closed (or its wait ended), at once.
            await asyncio.shield(asyncio.wait(tasks, timeout=graceful))
    for task in tasks:
        if task.done() and not task.cancelled():
            task.result()


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def calls_for_new_pool(engine: AsyncEngine, error: BaseException) -> bool:
    """Whether ``error`` calls for a fresh pool (and idempotent work for another
    attempt): the connection died, and the engine's store has not released it."""
    return is_dead_connection(error) and engine not in _RELEASED


async def _replace_pool(engine: AsyncEngine, pool: Pool) -> None:
    """A fresh pool for ``engine`` in place of ``pool``, whose connection died (its
    other connections likely with it), unless a concurrent failure replaced it already:
    replaced again, the fresh pool would be dropped with the connections made in it
    meanwhile still open (SQLAlchemy's ``dispose(close=False)`` closes none)."""
    if engine.pool is pool:
        await engine.dispose(close=False)


def unreachable(engine: AsyncEngine, error: BaseException) -> str:
    """What a failure to connect says: the server, and its reason (a refused connection,
    ``database "app" does not exist``, a password, a server that only reads)."""
    where = f"the database at {shown_server(engine.url)}"
    what = f"{where} only reads" if is_read_only(error) else f"cannot reach {where}"
    return f"{what} ({type(error).__name__}: {error_reason(error)})"


def shown_server(url: URL) -> str:
    """Where ``url`` connects, for people: ``host:port``, an IPv6 host in brackets; the
    hosts (a unix socket's directory, or several) and ports of its query as it gives
    them. Such a URL has no host part, and was shown as localhost:5432, which it never
    tried."""
    if url.host:
        host = f"[{url.host}]" if ":" in url.host else url.host
        return f"{host}:{url.port or 5432}"
    hosts = _query_values(url, "host")
    if not hosts:
        return f"localhost:{url.port or 5432}"
    ports = _query_values(url, "port") or (str(url.port) if url.port else "")
    return f"{hosts} port {ports}" if ports else hosts


def _query_values(url: URL, name: str) -> str:
    """The query parameter ``name`` of ``url``, its values joined with commas."""
    value = url.query.get(name, ())
    return value if isinstance(value, str) else ",".join(value)


def cannot_connect(error: BaseException) -> bool:
    """Whether ``error`` is a server that could not be reached or used: a connection
    error, or the socket's own (a refused connection, a server that never answered, a
    bare ``TimeoutError``)."""
    return is_connection_error(error) or isinstance(error, OSError | TimeoutError)


async def connect(engine: AsyncEngine) -> AsyncConnection:
    """A connection of ``engine``'s pool, or :class:`ConnectionLost` saying why none could
    be made (:func:`unreachable`), as from every other call that meets an unusable server:
    the driver's bare ``ConnectionRefusedError`` or ``gaierror`` names neither."""
    try:
        return await engine.connect().start()
    except Exception as error:
        if cannot_connect(error):
            raise ConnectionLost(unreachable(engine, error)) from error
        raise


async def _attempt(engine: AsyncEngine, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
    conn = await connect(engine)
    try:
        return await work(conn)
    except Exception as error:
        # SQLAlchemy invalidates what it saw die; asyncpg errors it did not see.
        if is_unusable(error) and not conn.invalidated:
            await conn.invalidate()
        _note_read_only(engine, error)
        raise
    finally:
        # The pool rolls back the transaction SQLAlchemy began, when it takes it back.
        await let_go(engine, conn)


async def run(
    engine: AsyncEngine,
    schema: str,
    work: Callable[[AsyncConnection], Awaitable[T]],
    *,
    idempotent: bool,
) -> T:
    """Run ``work`` in a connection of ``engine``; on a dead connection, replace the pool
    and run idempotent work once more, else raise :class:`ConnectionLost`."""
    with schema_required(schema):
        pool = engine.pool
        try:
            return await _attempt(engine, work)
        except Exception as error:
            if not calls_for_new_pool(engine, error):
                raise
            await _replace_pool(engine, pool)
            if not idempotent:
                raise ConnectionLost(f"the connection died: {error!r}") from error
        return await _attempt(engine, work)


async def _end_transaction(conn: AsyncConnection, driver: Any, *, interrupted: bool) -> None:
    """Roll back what was not committed; a connection that can't is thrown away.

    After work ``interrupted`` (an exception, a cancellation), the driver's own account of
    the transaction can't be trusted: a statement cancelled in flight (the BEGIN itself)
    may have opened one that the driver has not heard of yet. So a ROLLBACK goes anyway,
    and a connection still busy with that statement refuses it, and is thrown away."""
    if driver.is_closed():
        await conn.invalidate()
        return
    if interrupted or driver.is_in_transaction():
        try:
            await driver.execute("ROLLBACK")
        except Exception:
            # A connection that cannot roll back is broken, and its transaction is gone
            # with it on the server: discard it without hiding the error being raised.
            await conn.invalidate()


async def let_go(
    engine: AsyncEngine,
    conn: AsyncConnection,
    settle: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Settle ``conn`` (``settle`` ends what the work left open on it), then give it back
    to ``engine``'s pool (closed, if the engine was released meanwhile).

    This runs to its end even when the caller is cancelled meanwhile, as anyio's cancel
    scopes (FastAPI, Starlette) do at every turn of the loop: it runs as a task of its
    own, and a cancellation of the caller is raised once it is done (as SQLAlchemy's
    ``async with engine.connect()`` does for its own close). Cancelled half-way, it gave
    a connection with its transaction open back to the pool, holding the tables' locks
    (and perhaps an identity's checkpoint row) until its next use."""

    async def settled() -> None:
        try:
            if settle is not None:
                await settle()
            if engine in _RELEASED and not conn.invalidated:
                await conn.invalidate()  # closed, not pooled
        finally:
            await conn.close()

    await run_to_end(settled())


@asynccontextmanager
async def driver_transaction(
    engine: AsyncEngine, schema: str, begin: str, doing: str
) -> AsyncIterator[Any]:
    """An asyncpg connection inside the transaction that ``begin`` opens (a simple query:
    BEGIN and its settings in one round trip); what is not committed is rolled back, even
    when the caller is cancelled meanwhile (:func:`let_go`). ``doing`` completes the
    :class:`ConnectionLost` message ("while …")."""
    _refuse_if_read_only(engine, doing)
    pool = engine.pool
    conn = await connect(engine)
    driver: Any = None
    interrupted = True
    dead = False
    try:
        driver = await driver_connection(conn)
        with schema_required(schema):
            try:
                await driver.execute(begin)
            except Exception as error:
                if not calls_for_new_pool(engine, error):
                    raise
                # Died while idle in the pool: nothing was done yet, so begin once
                # more on a fresh connection of a fresh pool.
                await conn.invalidate()
                await _replace_pool(engine, pool)
                driver = await driver_connection(conn)
                await driver.execute(begin)
        yield driver
        interrupted = False
    except Exception as error:
        if is_unusable(error):
            dead = True
            _note_read_only(engine, error)
            what = "the server only reads" if is_read_only(error) else "the connection died"
            raise ConnectionLost(f"{what} {doing}: {error!r}") from error
        raise
    finally:
        settle = (
            None
            if driver is None
            else conn.invalidate  # not given back: dead, or read-only
            if dead
            else partial(_end_transaction, conn, driver, interrupted=interrupted)
        )
        await let_go(engine, conn, settle)
