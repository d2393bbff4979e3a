"""Appending observations: one binary COPY, and bisection when a row is refused.

The whole batch goes in one transaction, with the rollup of the rows it stored (see
:mod:`~coda_memory.postgres.rollup`). When the server (or asyncpg's encoder) refuses
a row, that transaction is rolled back and the batch is copied again, split in halves,
each under a savepoint, until every refused row is isolated; the good rows and their
rollup commit together. A connection error propagates with nothing stored, so the caller
can retry the batch without duplicating rows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from coda_memory.ports import AppendOutcome, ObservationRecord
from coda_memory.postgres.rollup import connection_shard, write_rollup
from coda_memory.postgres.sql import query

#: The parameters of ``observations_insert.sql``, one array per column of a row's values.
_ARRAYS = ("identity_ids", "types", "contents", "metadata", "session_ids", "created_ats")

#: SQLSTATE classes that blame the data of a row: data exception, integrity constraint
#: violation (CHECK, NOT NULL) and program limit exceeded (an oversized index entry).
_ROW_ERROR_CLASSES = ("22", "23", "54")


@dataclass(frozen=True, slots=True)
class _Row:
    index: int
    values: tuple[str, str, str, str, str | None, datetime]


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a server error, raised by asyncpg or wrapped by SQLAlchemy."""
    for error in (exc, getattr(exc, "orig", None)):
        sqlstate = getattr(error, "sqlstate", None)
        if isinstance(sqlstate, str):
            return sqlstate
    return None


def _is_row_error(exc: BaseException) -> bool:
    """True when ``exc`` blames the rows rather than the connection or the schema."""
    sqlstate = _sqlstate(exc)
    if isinstance(sqlstate, str):
        return sqlstate[:2] in _ROW_ERROR_CLASSES
    # Raised by asyncpg's encoders before the row reaches the server (e.g. a lone
    # surrogate cannot be encoded as UTF-8); asyncpg's own DataError is a ValueError.
    return isinstance(exc, ValueError | TypeError | OverflowError)


def _encode(records: Sequence[ObservationRecord]) -> tuple[list[_Row], list[tuple[int, str]]]:
    rows: list[_Row] = []
    refused: list[tuple[int, str]] = []
    for index, record in enumerate(records):
        try:
            metadata = json.dumps(record.metadata, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            refused.append((index, f"metadata is not JSON: {_reason(exc)}"))
            continue
        values = (
            record.identity_id,
            str(record.type),  # a StrEnum; anything else meets the CHECK constraint
            record.content,
            metadata,
            record.session_id,
            record.created_at,
        )
        rows.append(_Row(index, values))
    return rows, refused


async def _copy(driver: Any, schema: str, rows: Sequence[_Row]) -> None:
    statement = query("observations_insert", schema)
    columns = {name: [row.values[i] for row in rows] for i, name in enumerate(_ARRAYS)}
    await driver.execute(statement.text, *statement.arguments_from(columns))


async def _bisect(driver: Any, schema: str, rows: list[_Row]) -> list[tuple[int, str]]:
    """Copy ``rows`` under a savepoint; on a row error, split until it is isolated."""
    try:
        async with driver.transaction():
            await _copy(driver, schema, rows)
    except Exception as exc:
        if not _is_row_error(exc):
            raise
        if len(rows) == 1:
            return [(rows[0].index, _reason(exc))]
        middle = len(rows) // 2
        return [
            *await _bisect(driver, schema, rows[:middle]),
            *await _bisect(driver, schema, rows[middle:]),
        ]
    return []


async def _store(
    conn: AsyncConnection, driver: Any, schema: str, rows: list[_Row]
) -> list[tuple[int, str]]:
    """Copy ``rows`` and write their rollup in one transaction; return the refused rows'
    (index, reason) pairs. The caller commits."""
    # Opens the transaction (asyncpg's COPY below does not go through SQLAlchemy).
    shard = await connection_shard(conn, writer=True)
    refused: list[tuple[int, str]] = []
    try:
        # The common case: one COPY.
        await _copy(driver, schema, rows)
    except Exception as exc:
        if not _is_row_error(exc):
            raise
        await conn.rollback()
        shard = await connection_shard(conn, writer=True)  # reopens the transaction
        refused = await _bisect(driver, schema, rows)
    blamed = {index for index, _ in refused}
    stored = [row for row in rows if row.index not in blamed]
    await write_rollup(driver, schema, shard, [(row.values[0], row.values[1]) for row in stored])
    return refused


async def append_observations(
    conn: AsyncConnection, schema: str, records: Sequence[ObservationRecord]
) -> AppendOutcome:
    """Store ``records`` through ``conn``'s driver connection (asyncpg), in ``schema``,
    with their rollup, and commit."""
    rows, refused = _encode(records)
    if rows:
        raw = await conn.get_raw_connection()
        driver: Any = raw.driver_connection  # asyncpg.Connection
        try:
            refused += await _store(conn, driver, schema, rows)
            await conn.commit()
        except BaseException as exc:
            # Anything but a server-reported error leaves the session in an unknown state.
            if _sqlstate(exc) is None or driver.is_closed():
                await conn.invalidate()
            raise
    refused.sort()
    return AppendOutcome(stored=len(records) - len(refused), refused=refused)
