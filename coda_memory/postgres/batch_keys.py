"""Idempotency keys of appended batches: where an append records its batch's key, and
where a retry looks for it.

Every append records its batch's key, with the outcome, in the transaction that stores
the batch; a retry of a batch whose outcome was lost (the connection died around the
COMMIT) finds the key and stores nothing again (:mod:`coda_memory.postgres.append`).

Two tables hold keys, so that a lock on either never stops ingest:

* a **first attempt** of a batch (its caller knows that no earlier attempt can have been
  stored: this is the first, or every earlier one failed before its COMMIT) claims its key
  in ``ingest_batches`` under :data:`KEY_LOCK_TIMEOUT`; when that table is locked it
  records the key in ``ingest_batches_spill`` instead, with no need to look anywhere;
* a **retry** after an unknown outcome claims the key in both tables: the earlier attempt
  may have recorded it in either, and a claim waits for an earlier attempt still
  committing. A lock on either table holds a retry back (it is rare: only a lost
  connection makes one).

Keys carry no identity and are deleted a day after their batch, from both tables, by an
append that finds the table unlocked.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from coda_memory.core.caps import LogThrottle
from coda_memory.ports import AppendOutcome
from coda_memory.postgres.connection import (
    LOCK_NOT_AVAILABLE,
    RESTORE_LOCK_TIMEOUT,
    SAVE_LOCK_TIMEOUT,
    short_locks,
    sqlstate,
    undo_savepoint,
)
from coda_memory.postgres.rollup import SHARDS
from coda_memory.postgres.sql import in_schema, query, source, strip_comments

#: How long a first attempt waits for ``ingest_batches`` before it records its key in
#: ``ingest_batches_spill`` instead.
KEY_LOCK_TIMEOUT = timedelta(milliseconds=50)

#: The tables of keys.
BATCHES = "ingest_batches"
SPILL = "ingest_batches_spill"


#: Keeps the writer's lock timeout and shortens it, for the claim of a first attempt (the
#: claim statement puts it back).
_SHORTEN = f"SELECT {SAVE_LOCK_TIMEOUT}, set_config('lock_timeout', :short, true)"

_log = LogThrottle(logging.getLogger("coda_memory"))


@dataclass(frozen=True, slots=True)
class Claim:
    """What claiming a batch's key found."""

    #: The rollup shard of this connection.
    shard: int
    #: The outcome an earlier attempt recorded (None: this attempt stores the batch).
    earlier: AppendOutcome | None
    #: The tables where this attempt recorded the key.
    tables: tuple[str, ...]

    @property
    def spilled(self) -> bool:
        """The key went to the spill table only (``ingest_batches`` was locked)."""
        return self.tables == (SPILL,)


def _statement(name: str, schema: str) -> Any:
    """``name``.sql through SQLAlchemy (its ``:name`` parameters bound by name): the claim
    runs on the append's SQLAlchemy connection, where it opens the transaction that the
    append's driver statements then join and that SQLAlchemy commits or rolls back."""
    return text(in_schema(strip_comments(source(name)), schema))


async def _claim_in(
    conn: AsyncConnection, schema: str, name: str, values: dict[str, Any]
) -> tuple[int, bool]:
    row = (await conn.execute(_statement(name, schema), values)).one()
    return int(row.shard), bool(row.claimed)


async def _earlier(conn: AsyncConnection, schema: str, key: str) -> AppendOutcome:
    row = (await conn.execute(_statement("ingest_outcome", schema), {"key": key})).one_or_none()
    if row is None:  # pragma: no cover - a unique key conflicts only with a commit
        raise RuntimeError(f"batch {key} conflicted but left no record")
    refused = [(int(index), str(reason)) for index, reason in json.loads(row.refused)]
    return AppendOutcome(stored=int(row.stored), refused=refused)


async def claim(
    conn: AsyncConnection, schema: str, key: str, expected: AppendOutcome, first_attempt: bool
) -> Claim:
    """Open the transaction and claim ``key`` with the ``expected`` outcome (see above)."""
    values = {
        "key": key,
        "stored": expected.stored,
        "refused": json.dumps(expected.refused),
        "shards": SHARDS,
    }
    if first_attempt:
        milliseconds = round(KEY_LOCK_TIMEOUT.total_seconds() * 1000)
        await conn.execute(text(_SHORTEN), {"short": f"{milliseconds}ms"})
        try:
            shard, claimed = await _claim_in(conn, schema, "ingest_claim", values)
        except DBAPIError as exc:
            if sqlstate(exc) != LOCK_NOT_AVAILABLE:
                raise
        else:
            earlier = None if claimed else await _earlier(conn, schema, key)
            return Claim(shard, earlier, (BATCHES,))
        await conn.rollback()
        _log.warning(
            "keys spilled",
            "coda-memory: %s is locked; batch keys go to %s meanwhile",
            BATCHES,
            SPILL,
        )
        shard, claimed = await _claim_in(conn, schema, "ingest_claim_spill", values)
        return Claim(shard, None if claimed else await _earlier(conn, schema, key), (SPILL,))
    shard, claimed = await _claim_in(conn, schema, "ingest_claim_spill", values)
    if not claimed:
        return Claim(shard, await _earlier(conn, schema, key), (SPILL,))
    shard, claimed = await _claim_in(conn, schema, "ingest_claim", values)
    earlier = None if claimed else await _earlier(conn, schema, key)
    return Claim(shard, earlier, (SPILL, BATCHES))


async def record(
    conn: AsyncConnection, schema: str, key: str, claimed: Claim, outcome: AppendOutcome
) -> None:
    """Record ``outcome`` (refused rows made it differ from the one claimed) with the key."""
    values = {"key": key, "stored": outcome.stored, "refused": json.dumps(outcome.refused)}
    for table in claimed.tables:
        name = "ingest_record" if table == BATCHES else "ingest_record_spill"
        await conn.execute(_statement(name, schema), values)


async def expire(driver: Any, schema: str) -> None:
    """Delete the keys of batches stored more than a day ago, from each table that is not
    locked (a locked one is left for a later append)."""
    for name in ("ingest_expire", "ingest_expire_spill"):
        try:
            await driver.execute(short_locks("coda_expire", KEY_LOCK_TIMEOUT))
            await driver.execute(query(name, schema).text)
            await driver.execute(f"{RESTORE_LOCK_TIMEOUT}; RELEASE SAVEPOINT coda_expire")
        except Exception as exc:
            if sqlstate(exc) != LOCK_NOT_AVAILABLE:
                raise
            await driver.execute(undo_savepoint("coda_expire"))
