"""Copying one identity into Postgres from another store (``coda-memory import-redis``).

The caller reads and validates the identity's records inside the copy's transaction,
giving its observations to a :class:`CopyWriter` a page at a time, which writes each as
it comes (a read started again takes back what it wrote, to a savepoint); this module
writes them in one transaction that takes the identity's checkpoint lock once the read is
done (so no consolidation runs during the writes that follow, and none is held off for the
read; another run's copy finished meanwhile is found in the ledger then, and this one's
writes are taken back) and ends with a ledger row in ``redis_imports``: a rerun skips
what a finished transaction copied, and a killed one left nothing behind, so the copy
resumes where it stopped. Observations keep whether the source had consumed them: consumed ones are
written under transaction id 3, which every checkpoint snapshot sees (see
``redis_import_consumed.sql``), so the next consolidation here reinforces nothing twice;
the others are new to it. All of them go into the analytics rollup, as appends do.
"""

from __future__ import annotations

import functools
import json
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.expression import Executable

from coda_memory.core.model import Fact, FactEvent, FactEventKind, ObservationType
from coda_memory.core.sanitize import ObservationRecord
from coda_memory.postgres.connection import lock_timeout_clause
from coda_memory.postgres.documents import event_row, fact_row, rows_document
from coda_memory.postgres.durability import flush_commits
from coda_memory.postgres.engine import driver_connection
from coda_memory.postgres.rollup import (
    TOOL_TYPES,
    connection_shard,
    domain_rollup,
    entity_rollup,
    tool_rollup,
)
from coda_memory.postgres.sql import query
from coda_memory.postgres.store import PostgresStore
from coda_memory.postgres.unit import Statements, lock_identity


@dataclass(frozen=True, slots=True)
class IdentityCopy:
    """One identity's records as the source held them, validated, but for its
    observations (which the copy writes a page at a time, see :class:`CopyWriter`)."""

    identity_id: str
    #: Where they come from (for Redis: the key prefix); the ledger is kept per source.
    source: str
    facts: Sequence[Fact]
    events: Sequence[FactEvent]
    #: The source's checkpoint (None: never consolidated there).
    checkpoint_at: datetime | None
    #: Records of the identity left out of the copy (kept in the ledger).
    bad_records: int = 0


class CopiedFromAnotherSource(Exception):
    """The identity was copied from another source (another Redis key prefix) already:
    copying this one too would merge two deployments' users of one name."""

    def __init__(self, source: str) -> None:
        super().__init__(source)
        self.source = source


@dataclass(frozen=True, slots=True)
class CopyCounts:
    """Rows one identity's copy wrote."""

    observations: int
    consumed_observations: int
    facts: int
    fact_events: int
    checkpoints: int


async def copied_identities(store: PostgresStore, source: str) -> dict[str, int]:
    """Identities the ledger says were copied from ``source``, with the records each
    copy left out."""
    ledger = query("redis_import_ledger", store.schema)

    async def read(conn: AsyncConnection) -> dict[str, int]:
        driver = await driver_connection(conn)
        rows = await driver.fetch(ledger.text, *ledger.arguments(source=source))
        return {row["identity_id"]: row["bad_records"] for row in rows}

    return await store.run(read)


def _observation_arguments(records: Sequence[ObservationRecord]) -> dict[str, object]:
    return {
        "types": [r.type.value for r in records],
        "contents": [r.content for r in records],
        "metadata": [json.dumps(r.metadata, separators=(",", ":")) for r in records],
        "session_ids": [r.session_id for r in records],
        "created_ats": [r.created_at for r in records],
    }


#: The ids of consumed observations marked by one statement.
_MARK_PAGE = 10_000


class CopyWriter:
    """Writes one identity's observations into the copy's transaction as they are read,
    a page at a time: the copy holds no more of them than the page it is given (and the
    ids of the consumed ones written, 8 bytes each, marked once the rollup has read
    them). :meth:`restart` voids what was written since the copy began to read."""

    def __init__(self, driver: Any, schema: str, identity_id: str) -> None:
        self._driver = driver
        self._insert = query("redis_import_observations", schema)
        self._identity = identity_id
        self._begun = False
        self.consumed_ids = array("q")
        self.observations = 0
        self.types: set[ObservationType] = set()

    async def write(
        self, consumed: Sequence[ObservationRecord], pending: Sequence[ObservationRecord]
    ) -> None:
        """One page's observations: those the source had consumed, and the others."""
        if not self._begun:
            await self._driver.execute("SAVEPOINT redis_import_read")
            self._begun = True
        for records, is_consumed in ((consumed, True), (pending, False)):
            if not records:
                continue
            rows = await self._driver.fetch(
                self._insert.text,
                *self._insert.arguments_from(
                    {"identity_id": self._identity, **_observation_arguments(records)}
                ),
            )
            if is_consumed:
                self.consumed_ids.extend(row["id"] for row in rows)
            self.observations += len(records)
            self.types.update(r.type for r in records)

    async def restart(self) -> None:
        """Takes back every observation written so far: the source is read again."""
        if self._begun:
            await self._driver.execute("ROLLBACK TO SAVEPOINT redis_import_read")
        self.consumed_ids = array("q")
        self.observations = 0
        self.types = set()


async def copy_identity(
    store: PostgresStore,
    identity_id: str,
    source: str,
    read: Callable[[CopyWriter], Awaitable[IdentityCopy]],
    now: datetime,
) -> CopyCounts | None:
    """Copy one identity in one transaction; None when the ledger says it was copied
    before from ``source``. ``read(writer)`` reads the identity from the source, inside
    that transaction: it gives its observations to ``writer`` a page at a time (and
    restarts it when it reads them again), and returns the rest."""
    schema = store.schema
    statements = Statements.for_schema(schema)
    identity = identity_id

    async def work(conn: AsyncConnection) -> CopyCounts | None:
        async with conn.begin() as transaction:
            # A crash may lose the last copies with their ledger rows: a rerun redoes them.
            await conn.exec_driver_sql(lock_timeout_clause(store.lock_timeout))
            # Only the lock waits are bounded: a statement_timeout that the role or the
            # database sets (a managed server's parameter group) cut a large identity's
            # copy on every run, which then read as a lock held by live traffic.
            await conn.exec_driver_sql("SET LOCAL statement_timeout = 0")
            # Nor by an idle_in_transaction_session_timeout: the work between two of the
            # copy's statements (reading the next page from the source, and its
            # arguments) takes time, and a shorter one ended the copy at every attempt.
            await conn.exec_driver_sql("SET LOCAL idle_in_transaction_session_timeout = 0")
            await conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
            driver = await driver_connection(conn)
            done = query("redis_import_done", schema)
            arguments = done.arguments(identity_id=identity, source=source)
            ledger = await driver.fetchrow(done.text, *arguments)
            if ledger["done"]:
                return None
            if ledger["other"] is not None:
                raise CopiedFromAnotherSource(ledger["other"])
            writer = CopyWriter(driver, schema, identity)
            copy = await read(writer)
            # The identity's lock once the source is read, not across the read: a live
            # server's consolidation of the identity waited for all of it (a large one
            # takes a minute). The rows written so far are this transaction's alone.
            await lock_identity(driver, statements, identity)
            # Another run may have copied the identity meanwhile: what this one wrote
            # goes with its transaction.
            ledger = await driver.fetchrow(done.text, *arguments)
            if ledger["done"] or ledger["other"] is not None:
                await transaction.rollback()
                if ledger["done"]:
                    return None
                raise CopiedFromAnotherSource(ledger["other"])
            if writer.observations:
                # Reads the rows this transaction wrote, before some of them move to xid 3.
                await _write_rollup(conn, identity, writer.types)
            mark = query("redis_import_consumed", schema)
            ids = writer.consumed_ids
            for start in range(0, len(ids), _MARK_PAGE):
                await driver.execute(
                    mark.text,
                    *mark.arguments(
                        identity_id=identity, ids=ids[start : start + _MARK_PAGE].tolist()
                    ),
                )
            rest = query("redis_import_rest", schema)
            row = await driver.fetchrow(rest.text, *rest.arguments_from(_rest(copy, writer, now)))
            return CopyCounts(
                observations=writer.observations,
                consumed_observations=len(ids),
                facts=row["facts"],
                fact_events=row["fact_events"],
                checkpoints=row["checkpoints"],
            )

    # One transaction, which a lost connection rolls back: retried once.
    return await store.run(work)


#: The prefix of the WAL message that :func:`settle_copies` writes (a logical decoding
#: consumer of the database sees it, and may ignore it).
SETTLE_MESSAGE_PREFIX = "coda_memory.import"


async def settle_copies(store: PostgresStore) -> None:
    """Make the copies committed so far durable, as the server's ``synchronous_commit``
    makes any write: they commit with it off (a crash may lose the last of them, which a
    rerun redoes), and a run that ended with them still unflushed reported identities as
    copied that a crash or a failover right after took back, with nothing to say a rerun
    was needed. A commit that waits for its WAL to reach disk takes every earlier one's
    with it, but only a transaction that wrote WAL waits: this one writes a transactional
    WAL message, which needs no row of any table. (It rewrote a ledger row of the source,
    and wrote nothing when a forget had erased every one of them, or held and erased the
    one it chose.)"""

    await flush_commits(store, SETTLE_MESSAGE_PREFIX)


@functools.cache
def _rollup_statements(shard: int) -> dict[str, Executable]:
    """The rollup statements for one identity, built once per shard (building them costs
    more than running them); the identity is bound when they run."""
    one = ["identity"]
    return {
        "tool": tool_rollup(one, shard),
        "entity": entity_rollup(one),
        "domain": domain_rollup(one, shard),
    }


async def _write_rollup(
    conn: AsyncConnection, identity_id: str, types: set[ObservationType]
) -> None:
    """As :func:`~coda_memory.postgres.rollup_batch.write_rollup` for one identity."""
    statements = _rollup_statements(await connection_shard(conn))
    wanted = [
        ("tool", bool(types.intersection(TOOL_TYPES))),
        ("entity", ObservationType.ENTITY_ACCESS in types),
        ("domain", ObservationType.QUERY_PATTERN in types),
    ]
    for kind, present in wanted:  # the order every writer follows
        if present:
            await conn.execute(statements[kind], {"identities": [identity_id]})


def _rest(copy: IdentityCopy, writer: CopyWriter, now: datetime) -> dict[str, object]:
    facts, events = copy.facts, copy.events
    return {
        "identity_id": copy.identity_id,
        "source": copy.source,
        "imported_at": now,
        "observation_count": writer.observations,
        "consumed_count": len(writer.consumed_ids),
        "checkpoint_at": copy.checkpoint_at,
        "last_expiry": max((e.at for e in events if e.kind is FactEventKind.EXPIRED), default=None),
        "has_consumed": bool(writer.consumed_ids),
        "bad_records": copy.bad_records,
        "facts": rows_document([fact_row(f) for f in facts]),
        "events": rows_document([event_row(e) for e in events]),
    }
