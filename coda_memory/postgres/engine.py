"""Connecting: URL normalisation, the async engine, and the "schema not migrated" error."""

from __future__ import annotations

import asyncio
import functools
import inspect
import weakref
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import asyncpg
from sqlalchemy import event
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from coda_memory.core.urls import refuse_whitespace
from coda_memory.errors import SchemaNotMigrated
from coda_memory.postgres.schema import schema_translate_map

_POSTGRES_DRIVERS = {"postgresql", "postgres", "postgresql+asyncpg"}

#: SQLSTATEs that mean our tables (or their schema) are missing.
_MISSING_RELATION = {"42P01", "3F000"}


def asyncpg_url(url: str | URL) -> URL:
    """Return ``url`` as a ``postgresql+asyncpg`` URL.

    Accepts ``postgresql://``, ``postgres://`` and ``postgresql+asyncpg://``, in any
    case; a unix socket goes in the query (``postgresql://user@/db?host=/run/postgresql``),
    and a libpq ``sslmode`` becomes asyncpg's ``ssl``.
    """
    if isinstance(url, str):
        refuse_whitespace(url, "the database URL")
    try:
        parsed = make_url(url)
    except ValueError:
        # (Not chained: SQLAlchemy's int() quotes what it took for the port, the rest of
        # a password past an unencoded "@": "postgresql://app:p@ss:word@host/db".)
        raise ValueError(
            "the port is not a number (an '@' in the user name or password must be written %40)"
        ) from None
    # (A scheme is case-insensitive, RFC 3986: POSTGRESQL:// is postgresql://, as
    # REDIS:// and MEMORY:// are taken; SQLAlchemy looks its dialect up as written.)
    parsed = parsed.set(drivername=parsed.drivername.lower())
    if parsed.drivername not in _POSTGRES_DRIVERS:
        raise ValueError(
            f"unsupported database URL scheme {parsed.drivername!r}: "
            "use postgresql://, postgres:// or postgresql+asyncpg://"
        )
    _check_parts(parsed)
    if isinstance(url, str):
        _check_database_name(url, parsed)
    parsed = parsed.set(drivername="postgresql+asyncpg")
    if "sslmode" in parsed.query:
        sslmode = parsed.query["sslmode"]
        parsed = parsed.difference_update_query(["sslmode"])
        if "ssl" not in parsed.query:
            parsed = parsed.update_query_dict({"ssl": sslmode})
    return parsed


@functools.cache
def _query_parameters() -> frozenset[str]:
    """What a URL's query may set: asyncpg's connection parameters, libpq's ``sslmode``
    (see above) and the dialect's statement cache size."""
    taken = set(inspect.signature(asyncpg.connect).parameters)
    taken -= {"dsn", "loop", "connection_class", "record_class"}
    return frozenset(taken | {"sslmode", "prepared_statement_cache_size"})


def _check_parts(parsed: URL) -> None:
    """Refuse what the driver would only refuse when connecting, with a reason that says
    how to write it."""
    if parsed.host is not None and "@" in parsed.host:
        raise ValueError(
            "the host holds an '@': an '@' in the user name or password must be written %40"
        )
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise ValueError(f"the port must be from 1 to 65535, not {parsed.port}")
    # Several hosts: ?host=h1,h2&port=p1,p2 (SQLAlchemy's int() refused a bad one only
    # when the engine was made, in a line naming no URL).
    ports = parsed.query.get("port", ())
    for given in (ports,) if isinstance(ports, str) else ports:
        for port in given.split(","):
            if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
                raise ValueError(f"the port must be from 1 to 65535, not {port!r}")
    unknown = sorted(set(parsed.query) - _query_parameters())
    if unknown:
        raise ValueError(
            f"unknown URL parameter {unknown[0]!r} (asyncpg's connection parameters are "
            f"taken, with sslmode: {', '.join(sorted(_query_parameters()))})"
        )
    for name, value in parsed.query.items():
        if name in _CHECKED_VALUES:
            if not isinstance(value, str):
                raise ValueError(f"the URL parameter {name!r} is given more than once")
            _check_value(name, value)


def _check_database_name(url: str, parsed: URL) -> None:
    """Refuse a URL whose database name holds an '@' as written (not ``%40``): the host
    part ended early, at a '/' or '@' of the password (``app:pa@ss/word@db/app`` read as
    host ``ss`` and database ``word@db/app``), and the connection would go to a host
    named by a piece of the password. The message quotes no part of the URL."""
    database = parsed.database or ""
    if "@" in database and database in url.partition("?")[0]:
        raise ValueError(
            "the database name holds an '@': the password (or user name) must be "
            "percent-encoded, an '@' written %40 and a '/' %2F (and a database name "
            "that holds an '@' is written with %40 too)"
        )


#: Given in a URL, asyncpg gets these as strings, and refuses them at the first
#: connection whatever the value (``direct_tls=false``, a true string, turned direct TLS
#: on): they go in ``connect_args`` instead, or in the store's options of the same
#: meaning (which replaced a URL's ``timeout`` and ``command_timeout`` without a word).
_NOT_FROM_A_URL = frozenset(
    {
        "statement_cache_size",
        "max_cacheable_statement_size",
        "max_cached_statement_lifetime",
        "timeout",
        "command_timeout",
        "direct_tls",
        "server_settings",
    }
)
#: The store's option for a URL parameter that asyncpg cannot take from a URL.
_STORE_OPTIONS = {"timeout": "connect_timeout", "command_timeout": "command_timeout"}
_SSL_MODES = (
    "disable",
    "allow",
    "prefer",
    "require",
    "verify-ca",
    "verify_ca",
    "verify-full",
    "verify_full",
)
#: URL parameters that take one of a few words (asyncpg's spellings).
_WORDS: dict[str, tuple[str, ...]] = {
    "sslmode": _SSL_MODES,
    "ssl": _SSL_MODES,
    "target_session_attrs": (
        "any",
        "primary",
        "standby",
        "read-write",
        "read-only",
        "prefer-standby",
    ),
}
#: The URL parameters whose value is checked.
_CHECKED_VALUES = frozenset({"prepared_statement_cache_size", *_NOT_FROM_A_URL, *_WORDS})


def _check_value(name: str, value: str) -> None:
    """Refuse a URL parameter's value that the driver would refuse (or misuse) later."""
    if name == "prepared_statement_cache_size" and not (value.isascii() and value.isdigit()):
        # A negative size made SQLAlchemy's statement cache spin on the event loop.
        raise ValueError(f"the URL parameter {name!r} must be a whole number, not {value!r}")
    if name in _NOT_FROM_A_URL:
        option = _STORE_OPTIONS.get(name)
        instead = f"connect_args={{{name!r}: …}}"
        if option is not None:
            instead = f"the store's {option}=… (seconds), or {instead},"
        raise ValueError(
            f"the URL parameter {name!r} reaches asyncpg as a string, which it refuses: "
            f"pass {instead} instead"
        )
    words = _WORDS.get(name)
    if words is not None and value not in words:
        raise ValueError(
            f"the URL parameter {name!r} must be one of {', '.join(words)}, not {value!r}"
        )


def create_engine(
    url: str | URL, *, schema: str, pool_size: int = 5, **engine_kwargs: Any
) -> AsyncEngine:
    """An asyncpg engine whose tables resolve to ``schema``.

    No ``pool_pre_ping`` by default: with asyncpg it costs three round trips per checkout,
    more than a consolidation's own statements. A connection that died while idle
    (server restart, terminated backend) fails on first use instead, and the connection
    policy (:mod:`coda_memory.postgres.connection`) replaces the pool and retries
    idempotent work once. Pass ``pool_pre_ping=True`` to trade those
    round trips for checking every checkout.

    ``hide_parameters`` by default: SQLAlchemy's errors (which ``facts``, ``history`` and
    ``forget`` raise to the host, and hosts log) and its statement log would otherwise
    end with the statement's parameters, an identity among them.
    """
    options = dict(engine_kwargs.pop("execution_options", {}))
    options["schema_translate_map"] = schema_translate_map(schema)
    engine_kwargs.setdefault("hide_parameters", True)
    engine = create_async_engine(
        asyncpg_url(url),
        pool_size=pool_size,
        execution_options=options,
        **engine_kwargs,
    )
    opened: weakref.WeakSet[Any] = weakref.WeakSet()
    _OPENED[engine.sync_engine] = opened
    openings: set[asyncio.Task[Any]] = set()
    _OPENINGS[engine.sync_engine] = openings

    def connected(dbapi_connection: Any, _record: Any) -> None:
        opened.add(dbapi_connection.driver_connection)

    def opening_runs_to_its_end(_dialect: Any, _record: Any, _cargs: Any, cparams: Any) -> None:
        """Have the driver open each connection of the engine with :func:`_opened`."""
        cparams.setdefault("async_creator_fn", functools.partial(_opened, openings))

    # On the engine, so that the pools that replace this one keep it.
    event.listen(engine.sync_engine, "connect", connected)
    event.listen(engine.sync_engine, "do_connect", opening_runs_to_its_end)
    return engine


async def _opened(openings: set[asyncio.Task[Any]], *args: Any, **kwargs: Any) -> Any:
    """``asyncpg.connect(*args, **kwargs)`` in a task of its own (in ``openings`` until it
    ends), which a cancellation of the caller does not cut short: the caller's
    cancellation is raised at once, and the connection the task opens all the same is
    closed as it comes (it reached no pool). When the task itself is cancelled
    (:func:`cancel_openings`) and the caller is not, the caller gets a
    ConnectionAbortedError, not the cancellation of a task that nobody cancelled.

    Cut short between the socket's connection and its protocol's start (under the
    default ``sslmode``, prefer), asyncpg's TLS negotiation was left with a future that
    failed with ``ConnectionError('unexpected connection_lost() call')`` and that nobody
    read: asyncio logged "Future exception was never retrieved" when it was freed, once
    for each connection that a cancelled call was opening (many after the server ended
    the connections, as every call opens a new one)."""
    opening = asyncio.ensure_future(asyncpg.connect(*args, **kwargs))
    openings.add(opening)
    opening.add_done_callback(openings.discard)
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        caller = asyncio.current_task()
        if opening.cancelled() and caller is not None and not caller.cancelling():
            raise ConnectionAbortedError(
                "the connection was being opened as its store closed"
            ) from None
        opening.add_done_callback(_close_unclaimed)
        raise


def _close_unclaimed(opening: asyncio.Future[Any]) -> None:
    """Close the connection that ``opening`` opened for a caller that is gone; its error,
    if it failed, is read (it has no caller to raise it to)."""
    if opening.cancelled() or opening.exception() is not None:
        return
    opening.result().terminate()


#: The asyncpg connections that each engine of :func:`create_engine` opened.
_OPENED: weakref.WeakKeyDictionary[Engine, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()
#: The tasks of :func:`_opened` that each engine of :func:`create_engine` is opening
#: connections in.
_OPENINGS: weakref.WeakKeyDictionary[Engine, set[asyncio.Task[Any]]] = weakref.WeakKeyDictionary()


async def cancel_openings(engines: Collection[AsyncEngine], timeout: float) -> None:
    """Cancel the connections that ``engines`` are opening on the running loop, and wait
    for the openings to end, ``timeout`` seconds at most. Each goes on after its caller is
    cancelled (see :func:`_opened`), for as long as the connect timeout allows when the
    server accepted the connection and never answered: left pending as the loop closed,
    asyncio reported it as a task destroyed while pending, and its socket as unclosed.
    (One cancelled in the turns between its socket's connection and its protocol's start
    still leaves asyncpg's unread future, as :func:`_opened` tells: a service closing
    itself at its loop's end cancels them after ``CLOSE_AT_LOOP_END``, past that step.)"""
    loop = asyncio.get_running_loop()
    pending = [
        opening
        for engine in engines
        for opening in _OPENINGS.get(engine.sync_engine, ())
        if not opening.done() and opening.get_loop() is loop
    ]
    for opening in pending:
        opening.cancel()
    if pending:
        await asyncio.wait(pending, timeout=timeout)


def opened_connections(engine: AsyncEngine) -> list[Any]:
    """The asyncpg connections that ``engine`` (made by :func:`create_engine`) opened and
    that are still referenced: in its pool, in use, or closed but not yet collected (one
    being closed counts as closed in asyncpg's ``is_closed``)."""
    return list(_OPENED.get(engine.sync_engine, ()))


async def driver_connection(conn: AsyncConnection) -> Any:
    """The asyncpg connection under ``conn``, for COPY and the prepared hot-path statements."""
    raw = await conn.get_raw_connection()
    return raw.driver_connection


def is_missing_relation(exc: BaseException) -> bool:
    """True when ``exc`` (a driver or SQLAlchemy error) says a table or schema is missing."""
    if isinstance(exc, DBAPIError):
        exc = exc.orig if exc.orig is not None else exc
    return getattr(exc, "sqlstate", None) in _MISSING_RELATION


@contextmanager
def schema_required(schema: str) -> Iterator[None]:
    """Turn "relation does not exist" into :class:`SchemaNotMigrated`."""
    try:
        yield
    except Exception as exc:
        if is_missing_relation(exc):
            raise SchemaNotMigrated(
                f"coda-memory tables are missing from schema {schema!r}; create them with "
                "`coda-memory migrate`, coda_memory.migrate(url) or `alembic upgrade head`"
            ) from exc
        raise
