"""Builders (shared with the contract suite) and direct SQL for the Postgres tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import pool, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

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
    "record",
]


def engine(url: str) -> AsyncEngine:
    """An engine of its own (no pool), for connections the store must not share."""
    return create_async_engine(url, poolclass=pool.NullPool)


async def fetch(url: str, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """Run one statement with bound parameters on a new connection; return the rows."""
    own = engine(url)
    try:
        async with own.begin() as conn:
            result = await conn.execute(text(sql), params)
            return [tuple(row) for row in result] if result.returns_rows else []
    finally:
        await own.dispose()


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
