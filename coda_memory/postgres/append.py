"""Appending observations: one statement per batch, exactly once, with bisection when a
row is refused.

The whole batch goes in one transaction, with the rollup of the rows it stored (see
:mod:`~coda_memory.postgres.rollup`) and the batch's idempotency key (see
:mod:`~coda_memory.postgres.batch_keys`: a lock on one of its two tables does not stop
the append either).
A retry of a batch whose outcome the caller could not learn (the connection died around
the COMMIT) finds the key and stores nothing again: it returns the outcome recorded with
it. A connection error propagates; anything else the server blames on the data (a row's
value, a constraint, an error raised by a trigger, in the insert or in the rollup) rolls
the transaction back, and the batch is stored again in halves, each half with its rollup
under a savepoint, until every refused row is isolated; the good rows, their rollup and
the key commit together.

A lock on a rollup table does not stop the append: the rollup waits at most
:data:`~coda_memory.postgres.rollup_owed.ROLLUP_LOCK_TIMEOUT` for its table locks, and
when one is held the batch records that it owes its rollup instead, in the same
transaction; a later append folds it in (:mod:`~coda_memory.postgres.rollup_owed`, which
the store's :class:`~coda_memory.postgres.rollup_owed.RollupDebt` tells when). The
bisection path does not defer: a lock met there fails the append, which is retried.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy.ext.asyncio import AsyncConnection

from coda_memory.core.turns import SLICE
from coda_memory.ports import AppendOutcome, ObservationRecord, unidentified
from coda_memory.postgres import batch_keys
from coda_memory.postgres.connection import error_reason, sqlstate
from coda_memory.postgres.documents import NotJson, document, instant
from coda_memory.postgres.rollup_batch import batch_statements, write_rollup_part
from coda_memory.postgres.rollup_owed import Folded, RollupDebt, fold_owed, rollup_or_owe
from coda_memory.postgres.sql import query

#: A document longer than this (characters) is sent in parts: the server's jsonb holds at
#: most 256 MB, and a batch of large observations with a large ``batch_size`` could reach it.
MAX_DOCUMENT_CHARS = 32 * 1024 * 1024
#: How JSON writes NUL, which no Postgres text or jsonb string can hold.
_NUL_ESCAPE = "\\u0000"

#: SQLSTATE classes that blame the system rather than a batch's rows: connection,
#: operator intervention, resources, syntax or access (a missing table, a privilege),
#: invalid schema, authorisation, unsupported feature, transaction state, rollback
#: (deadlock, serialisation) and internal errors. Any other server error is blamed on
#: the rows, and bisected.
_SYSTEM_ERROR_CLASSES = frozenset(
    {"08", "57", "53", "42", "3F", "28", "0A", "25", "40", "XX", "58", "55", "F0"}
)


class _Row(NamedTuple):
    """One row of a batch (a tuple: a frozen dataclass took longer to make than orjson
    takes to write the row)."""

    #: Its place in the batch.
    position: int
    #: identity_id, type, content, metadata, session_id and created_at (see
    #: :func:`~coda_memory.postgres.documents.instant`): one element of the batch's JSON
    #: document.
    values: tuple[str, str, str, dict[str, Any], str | None, str | datetime]


def _is_row_error(exc: BaseException) -> bool:
    """True when ``exc`` blames the rows rather than the connection or the schema."""
    state = sqlstate(exc)
    if isinstance(state, str):
        return state[:2] not in _SYSTEM_ERROR_CLASSES
    # Raised by asyncpg's encoders before the row reaches the server (e.g. a lone
    # surrogate cannot be encoded as UTF-8); asyncpg's own DataError is a ValueError.
    return isinstance(exc, ValueError | TypeError | OverflowError)


def _values(record: ObservationRecord) -> tuple[str, str, str, Any, str | None, str | datetime]:
    return (
        record.identity_id,
        record.type,  # a StrEnum, written as its value; anything else meets the CHECK
        record.content,
        record.metadata,
        record.session_id,
        instant(record.created_at),
    )


def _has_nul(value: object) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(key) or _has_nul(item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(item) for item in value)
    return False


def _encode(
    records: Sequence[ObservationRecord], start: int = 0
) -> tuple[list[_Row], list[tuple[int, str]], str]:
    """The records as rows (their places in the batch counted from ``start``), those
    refused before the server sees them (metadata that is not JSON, text holding NUL),
    and the JSON document of the rows. The records are encoded at once; only when that
    fails or holds an escaped NUL are they encoded row by row."""
    rows = [
        _Row(index, _values(record))
        for index, record in enumerate(records, start)
        if record.identity_id
    ]
    # (Only when one was left out: a second pass over every batch otherwise.)
    empty = unidentified(records, start) if len(rows) < len(records) else []
    try:
        text = document([row.values for row in rows])
    except NotJson:
        text = _NUL_ESCAPE  # find the culprits below
    if _NUL_ESCAPE not in text:
        return rows, empty, text
    kept: list[_Row] = []
    parts: list[str] = []
    refused: list[tuple[int, str]] = empty
    for row in rows:
        try:
            part = document(row.values)
        except NotJson as exc:
            refused.append((row.position, f"not JSON: {error_reason(exc)}"))
            continue
        if _NUL_ESCAPE in part and _has_nul(row.values):
            refused.append((row.position, "text holds NUL (0x00), which Postgres can't store"))
            continue
        kept.append(row)
        parts.append(part)
    refused.sort()
    return kept, refused, f"[{','.join(parts)}]"


@dataclass(frozen=True, slots=True)
class Encoded:
    """A batch encoded for the server (:func:`encode`): made once, whatever the attempts."""

    #: The records' count.
    total: int
    #: The rows that go to the server.
    rows: list[_Row]
    #: (place in the batch, reason) of the records refused before the server saw them.
    refused: list[tuple[int, str]]
    #: The JSON document of ``rows``.
    text: str


async def encode(records: Sequence[ObservationRecord]) -> Encoded:
    """The batch encoded (see :func:`_encode`), :data:`~coda_memory.core.turns.SLICE`
    records at a time with a turn of the event loop between two slices: a batch of
    5,000 takes about 10 ms, which requests would otherwise wait for at once."""
    if len(records) <= SLICE:
        return Encoded(len(records), *_encode(records))
    rows: list[_Row] = []
    refused: list[tuple[int, str]] = []
    texts: list[str] = []
    for start in range(0, len(records), SLICE):
        if start:
            await asyncio.sleep(0)
        part_rows, part_refused, part_text = _encode(records[start : start + SLICE], start)
        rows.extend(part_rows)
        refused.extend(part_refused)
        if part_rows:
            texts.append(part_text[1:-1])  # the rows, without the array's brackets
    return Encoded(len(records), rows, refused, f"[{','.join(texts)}]")


def _documents(rows: Sequence[_Row], text: str | None = None) -> list[str]:
    """The JSON document of ``rows`` (``text`` when already made), in parts of at most
    :data:`MAX_DOCUMENT_CHARS` characters unless a single row is longer."""
    if text is None:
        text = document([row.values for row in rows])
    if len(text) <= MAX_DOCUMENT_CHARS or len(rows) == 1:
        return [text]
    middle = len(rows) // 2
    return [*_documents(rows[:middle]), *_documents(rows[middle:])]


def prepared_statements(schema: str) -> list[str]:
    """The statements an append sends through asyncpg's statement cache (the insert and
    the batch's rollup), for :meth:`PostgresStore.start` to prepare on each writer
    connection: the first append on it then skips their Parse round trips."""
    return [query("observations_insert", schema).text, *(c.sql for c in batch_statements(schema))]


async def _insert(driver: Any, schema: str, rows: Sequence[_Row], text: str) -> None:
    statement = query("observations_insert", schema)
    for part in _documents(rows, text):
        await driver.execute(statement.text, *statement.arguments(rows=part))


async def _insert_returning_ids(driver: Any, schema: str, rows: Sequence[_Row]) -> list[int]:
    statement = query("observations_insert", schema)
    ids: list[int] = []
    for part in _documents(rows):
        returned = await driver.fetch(
            statement.text + " RETURNING id", *statement.arguments(rows=part)
        )
        ids.extend(int(r["id"]) for r in returned)
    return ids


def _pairs(rows: Sequence[_Row]) -> list[tuple[str, str]]:
    return [(row.values[0], row.values[1]) for row in rows]


async def _bisect(
    conn: AsyncConnection, driver: Any, schema: str, shard: int, rows: list[_Row]
) -> list[tuple[int, str]]:
    """Store ``rows`` and their rollup under a savepoint; on an error blamed on the rows,
    split until each refused row is isolated. The rollup of a part counts that part's
    rows only (by id), not the rest of the transaction's."""
    try:
        async with conn.begin_nested():
            ids = await _insert_returning_ids(driver, schema, rows)
            await write_rollup_part(conn, shard, _pairs(rows), ids)
    except Exception as exc:
        if not _is_row_error(exc):
            raise
        if len(rows) == 1:
            return [(rows[0].position, error_reason(exc))]
        middle = len(rows) // 2
        return [
            *await _bisect(conn, driver, schema, shard, rows[:middle]),
            *await _bisect(conn, driver, schema, shard, rows[middle:]),
        ]
    return []


@dataclass(slots=True)
class IngestCounts:
    """What a store's appends did around locks, since the store was made (reported in
    ``MemoryService.stats()``)."""

    #: Appends whose rollup was owed (a rollup table was locked).
    rollups_owed: int = 0
    #: Owed transactions whose rollup an append of this store folded in.
    rollups_folded: int = 0
    #: Appends whose key went to ``ingest_batches_spill`` (``ingest_batches`` was locked).
    keys_spilled: int = 0


@dataclass(frozen=True, slots=True)
class _Stored:
    outcome: AppendOutcome
    #: The connection's rollup shard.
    shard: int
    #: The rollup of the stored rows is owed (a rollup table was locked).
    owed: bool = False
    #: The key went to the spill table.
    spilled: bool = False


async def _store(
    conn: AsyncConnection,
    driver: Any,
    schema: str,
    key: str,
    rows: list[_Row],
    text: str,
    refused: list[tuple[int, str]],
    total: int,
    first_attempt: bool,
) -> _Stored:
    """Store ``rows`` (their JSON document ``text``) with their rollup (or the record that
    it is owed) and ``key`` in one transaction; the caller commits. ``refused``: rows
    already refused before reaching the server."""
    expected = AppendOutcome(stored=len(rows), refused=sorted(refused))
    claimed = await batch_keys.claim(conn, schema, key, expected, first_attempt)
    if claimed.earlier is not None:
        return _Stored(claimed.earlier, claimed.shard)
    try:
        # The common case: one statement for the rows, then their rollup.
        await _insert(driver, schema, rows, text)
        owed = await rollup_or_owe(driver, schema, claimed.shard, _pairs(rows))
        return _Stored(expected, claimed.shard, owed, claimed.spilled)
    except Exception as exc:
        if not _is_row_error(exc):
            raise
    await conn.rollback()
    # Reopens the transaction; nothing of this attempt was stored, so a first attempt
    # is still one.
    claimed = await batch_keys.claim(conn, schema, key, expected, first_attempt)
    if claimed.earlier is not None:  # pragma: no cover - the claim was rolled back just now
        return _Stored(claimed.earlier, claimed.shard)
    refused = sorted([*refused, *await _bisect(conn, driver, schema, claimed.shard, rows)])
    outcome = AppendOutcome(stored=total - len(refused), refused=refused)
    await batch_keys.record(conn, schema, key, claimed, outcome)
    return _Stored(outcome, claimed.shard, spilled=claimed.spilled)


async def append_observations(
    conn: AsyncConnection,
    schema: str,
    records: Sequence[ObservationRecord] | Encoded,
    key: str,
    *,
    expire_keys: bool = False,
    debt: RollupDebt | None = None,
    first_attempt: bool = False,
    counts: IngestCounts | None = None,
) -> AppendOutcome:
    """Store ``records`` (or their :func:`encode`, which the caller then makes once for
    every attempt) through ``conn``'s driver connection (asyncpg), in ``schema``,
    with their rollup and the batch's idempotency ``key``, and commit; a batch whose key
    is already stored is not stored again. ``expire_keys``: also delete the keys of
    batches stored more than a day ago. ``debt``: the caller's record of owed rollups;
    when it says so, the append also folds owed rollups (none without it).
    ``first_attempt``: no earlier attempt of the batch can have been stored, so the key
    may be recorded without looking for it (see :mod:`~coda_memory.postgres.batch_keys`).
    ``counts``: where a committed append counts what it owed, folded or spilled."""
    batch = records if isinstance(records, Encoded) else Encoded(len(records), *_encode(records))
    rows, refused, text = batch.rows, batch.refused, batch.text
    if not rows:
        return AppendOutcome(stored=0, refused=refused)
    raw = await conn.get_raw_connection()
    driver: Any = raw.driver_connection  # asyncpg.Connection
    due = debt is not None and debt.due()
    folded: Folded | None = None
    try:
        stored = await _store(
            conn, driver, schema, key, rows, text, refused, batch.total, first_attempt
        )
        if due and not stored.owed:  # when it owes, the rollup tables are locked
            folded = await fold_owed(driver, schema, stored.shard)
        if expire_keys:
            await batch_keys.expire(driver, schema)
        await conn.commit()
    except BaseException as exc:
        # Anything but a server-reported error leaves the session in an unknown state.
        if sqlstate(exc) is None or driver.is_closed():
            await conn.invalidate()
        raise
    if debt is not None:
        debt.committed(stored.owed, folded)
    if counts is not None:
        counts.rollups_owed += stored.owed
        counts.rollups_folded += 0 if folded is None else folded.transactions
        counts.keys_spilled += stored.spilled
    return stored.outcome
