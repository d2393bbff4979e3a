"""Connecting: URL normalisation, the async engine, and the "schema not migrated" error."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from coda_memory.errors import SchemaNotMigrated
from coda_memory.postgres.schema import schema_translate_map

_POSTGRES_DRIVERS = {"postgresql", "postgres", "postgresql+asyncpg"}

#: SQLSTATEs that mean our tables (or their schema) are missing.
_MISSING_RELATION = {"42P01", "3F000"}


def asyncpg_url(url: str | URL) -> URL:
    """Return ``url`` as a ``postgresql+asyncpg`` URL.

    Accepts ``postgresql://``, ``postgres://`` and ``postgresql+asyncpg://``; a unix
    socket goes in the query (``postgresql://user@/db?host=/run/postgresql``), and a libpq
    ``sslmode`` becomes asyncpg's ``ssl``.
    """
    parsed = make_url(url)
    if parsed.drivername not in _POSTGRES_DRIVERS:
        raise ValueError(
            f"unsupported database URL scheme {parsed.drivername!r}: "
            "use postgresql://, postgres:// or postgresql+asyncpg://"
        )
    parsed = parsed.set(drivername="postgresql+asyncpg")
    if "sslmode" in parsed.query:
        sslmode = parsed.query["sslmode"]
        parsed = parsed.difference_update_query(["sslmode"])
        if "ssl" not in parsed.query:
            parsed = parsed.update_query_dict({"ssl": sslmode})
    return parsed


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
    return create_async_engine(
        asyncpg_url(url),
        pool_size=pool_size,
        execution_options=options,
        **engine_kwargs,
    )


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
                "coda_memory.migrate(url) or `alembic upgrade head`"
            ) from exc
        raise
