"""Rollup deferral: an append stores its rows even when a rollup table is locked, and
owes their rollup until a later append folds it in.

A lock held on a rollup table (a ``LOCK TABLE``, a long ``ALTER``, a rollup rebuild) must
not stop ingest. So the append takes the table locks its rollup needs first, in a
savepoint and under :data:`ROLLUP_LOCK_TIMEOUT` (the writer's own lock timeout is put back
right after, for the row locks of the statements themselves). When a lock is not
granted in time (``lock_not_available``) or a deadlock picks the append
(``deadlock_detected``), in that step or in the rollup statements, the savepoint is
rolled back and the transaction records instead that it owes the rollup: one row of
``rollup_owed`` per identity of the batch, with the transaction's id (``xid``) and the
kinds of rollup (tools, entities, domains). The rollup statements read back "this
transaction's rows" by ``(identity_id, xid)``, so the same statements, given the owed
``(identity_id, xid)`` pairs instead, fold the owed rows later. The observations, the
owed record and the batch's idempotency key commit together: nothing is lost, and a retry
of the batch finds the key and stores (and owes) nothing again.

Paying: an append whose own rollup went through folds owed records when its store knows
it recorded one (:class:`RollupDebt`), and on every :data:`FOLD_EVERY`-th append anyway,
for records of other processes (or of one that stopped). :func:`fold_owed` claims up to
:data:`FOLD_ROWS` records with ``FOR UPDATE SKIP LOCKED`` (concurrent writers take
different records, never the same twice), and folds them all at once in a savepoint,
deleting them in the same savepoint: one statement per kind of rollup and one delete,
whatever the number of owed transactions (a 10 s lock leaves hundreds). A record is
folded exactly once, when the transaction that deletes it commits. When that folding
meets an error other than a lock, each owed transaction is folded in a savepoint of its
own, so that one cannot hold the others back. The whole folding runs under
:data:`ROLLUP_LOCK_TIMEOUT`: while the tables stay locked the records stay, and the
append goes on. Reading other transactions' observations needs the writer policy
``writer_owed_read`` (migration 0006; 0008 lets it name several), which allows the rows
of the transactions listed, comma-separated, in the ``coda_memory.rollup_xid`` setting;
the folding sets it for its own subtransaction.

Until folded, the analytics lag by the owed rows. Neither ``coda-memory prune`` (which
folds first) nor a consolidation's own pruning (``retention``) deletes an observation
whose rollup is owed. ``forget`` folds the identity's records before it deletes its
rows, and deletes those a lock still keeps from folding (their counts are lost); a
rebuild empties the table, since it recomputes everything; and the folding tolerates
rows that are gone (it counts what is still stored).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from coda_memory.core.caps import LogThrottle
from coda_memory.postgres.connection import (
    LOCK_NOT_AVAILABLE,
    RESTORE_LOCK_TIMEOUT,
    short_locks,
    sqlstate,
    undo_savepoint,
)
from coda_memory.postgres.rollup_batch import (
    KIND_DOMAINS,
    KIND_ENTITIES,
    KIND_TOOLS,
    fold_rollup,
    kinds_of,
    write_rollup,
)
from coda_memory.postgres.schema import (
    domain_daily,
    domain_users,
    entity_daily,
    entity_users,
    tool_daily,
    tool_durations,
    tool_users,
)
from coda_memory.postgres.sql import in_schema, query
from coda_memory.postgres.tenancy import ROLLUP_XID_SETTING

#: How long the rollup waits for a table lock before the append owes it instead. Short:
#: a writer otherwise waits (and holds its connection) for ``writer_lock_timeout``.
ROLLUP_LOCK_TIMEOUT = timedelta(milliseconds=50)
#: Every this many appends, a store folds owed records even when it knows of none.
FOLD_EVERY = 100
#: Owed records one append claims at most (one per identity and owed transaction).
FOLD_ROWS = 1_000

#: lock_not_available (lock_timeout) and deadlock_detected: the rollup is owed.
_DEFERRABLE = frozenset({LOCK_NOT_AVAILABLE, "40P01"})
#: Names the owed transactions whose rows the folding may read (comma-separated xids).
_SET_XIDS = f"SELECT set_config('{ROLLUP_XID_SETTING}', $1, true)"

#: The tables each kind of rollup writes, in the order its statement locks them.
_KIND_TABLES = (
    (KIND_TOOLS, (tool_users, tool_daily, tool_durations)),
    (KIND_ENTITIES, (entity_users, entity_daily)),
    (KIND_DOMAINS, (domain_users, domain_daily)),
)

_log = LogThrottle(logging.getLogger("coda_memory"))


@functools.cache
def _lock_tables(schema: str, kinds: int) -> str:
    """``LOCK TABLE`` of the rollup tables of ``kinds``, in the mode their upserts take
    anyway (ROW EXCLUSIVE: writers never conflict with each other on it)."""
    names = [f"{{schema}}.{t.name}" for kind, ts in _KIND_TABLES if kinds & kind for t in ts]
    return in_schema(f"LOCK TABLE {', '.join(names)} IN ROW EXCLUSIVE MODE", schema)


async def rollup_or_owe(
    driver: Any, schema: str, shard: int, stored: list[tuple[str, str]]
) -> bool:
    """Fold the rows this transaction stored, given as (identity_id, type), into the
    rollup; when a lock stands in the way, record the rollup as owed instead. True when
    it is owed. Any other error propagates (the transaction is then unusable)."""
    kinds = kinds_of(stored)
    if not kinds:
        return False
    try:
        # The table locks under the short timeout, then the writer's timeout again.
        await driver.execute(
            f"{short_locks('coda_rollup', ROLLUP_LOCK_TIMEOUT)}; "
            f"{_lock_tables(schema, kinds)}; {RESTORE_LOCK_TIMEOUT}"
        )
        await write_rollup(driver, schema, shard, stored)
        await driver.execute("RELEASE SAVEPOINT coda_rollup")
        return False
    except Exception as exc:
        if sqlstate(exc) not in _DEFERRABLE:
            raise
        _log.warning("rollup deferred", "coda-memory: rollup deferred: %s", _described(exc))
    await driver.execute(undo_savepoint("coda_rollup"))
    owe = query("rollup_owe", schema)
    identities = sorted({identity_id for identity_id, _ in stored})
    await driver.execute(owe.text, *owe.arguments(kinds=kinds, identities=identities))
    return True


@dataclass(frozen=True, slots=True)
class Folded:
    """What one :func:`fold_owed` did."""

    #: Owed transactions folded (their records deleted).
    transactions: int
    #: Records claimed.
    claimed: int
    #: A lock or an error stopped it before every claimed record was folded.
    blocked: bool
    #: The claim was full: more records may wait.
    full: bool

    @property
    def settled(self) -> bool:
        """True when no record it could reach is left (records other transactions were
        folding at the time are theirs)."""
        return not self.blocked and not self.full


async def fold_owed(
    driver: Any,
    schema: str,
    shard: int,
    *,
    limit: int = FOLD_ROWS,
    identity_id: str | None = None,
    kinds: int | None = None,
) -> Folded:
    """Fold up to ``limit`` owed records into the rollup (``identity_id``'s only, when
    given), in the caller's transaction (the writer's, a forget's, or the owner's across
    identities): all of them in one savepoint, and when that meets an error other than a
    lock, each owed transaction in a savepoint of its own. Every lock wait is bounded by
    :data:`ROLLUP_LOCK_TIMEOUT`. Records whose folding meets a lock or an error stay.
    Connection errors propagate.

    ``kinds``: fold only these kinds of rollup (``KIND_*`` bits) of the records, and keep
    the records (a forget folds one kind at a time, and deletes the records itself)."""
    await driver.execute(short_locks("coda_owed", ROLLUP_LOCK_TIMEOUT))
    try:
        claim = query("rollup_owed_claim", schema)
        rows = await driver.fetch(
            claim.text, *claim.arguments(limit=limit, identity_id=identity_id)
        )
    except Exception as exc:
        if sqlstate(exc) is None:
            raise
        await driver.execute(undo_savepoint("coda_owed"))
        _log.warning("rollup owed", "coda-memory: owed rollups not folded: %s", _described(exc))
        return Folded(0, 0, blocked=True, full=False)
    records = [(row["identity_id"], row["xid"], row["kinds"]) for row in rows]
    by_xid: dict[int, list[tuple[str, int, int]]] = {}
    for record in records:
        by_xid.setdefault(record[1], []).append(record)
    folded, blocked = 0, False
    if records:
        failure = await _fold(driver, schema, shard, records, kinds)
        if failure is None:
            folded = len(by_xid)
        elif failure in _DEFERRABLE:
            blocked = True  # still locked: every record waits for a later append
        else:
            # One owed transaction's rows may be what fails: fold the others without it.
            for owed in by_xid.values():
                failure = await _fold(driver, schema, shard, owed, kinds)
                if failure is None:
                    folded += 1
                    continue
                blocked = True
                if failure in _DEFERRABLE:
                    break
    await driver.execute(
        f"{RESTORE_LOCK_TIMEOUT}, set_config('{ROLLUP_XID_SETTING}', '', true); "
        "RELEASE SAVEPOINT coda_owed"
    )
    return Folded(folded, len(rows), blocked=blocked, full=len(rows) >= limit)


async def _fold(
    driver: Any,
    schema: str,
    shard: int,
    owed: list[tuple[str, int, int]],
    kinds: int | None = None,
) -> str | None:
    """Fold the owed records given as (identity_id, xid, kinds) and delete them, in a
    savepoint; None when done, else the SQLSTATE that undid it (the records stay).
    ``kinds``: only these kinds, and the records stay (see :func:`fold_owed`).
    Connection errors propagate."""
    try:
        await driver.execute("SAVEPOINT coda_owed_fold")
        xids = sorted({xid for _, xid, _ in owed})
        await driver.execute(_SET_XIDS, ",".join(map(str, xids)))
        if kinds is not None:
            owed = [(identity_id, xid, owes & kinds) for identity_id, xid, owes in owed]
        await fold_rollup(driver, schema, shard, owed)
        if kinds is None:
            paid = query("rollup_owed_paid", schema)
            identities = [identity_id for identity_id, _, _ in owed]
            paid_xids = [xid for _, xid, _ in owed]
            await driver.execute(paid.text, *paid.arguments(identities=identities, xids=paid_xids))
        await driver.execute("RELEASE SAVEPOINT coda_owed_fold")
        return None
    except Exception as exc:
        state = sqlstate(exc)
        if state is None:
            raise
        await driver.execute(undo_savepoint("coda_owed_fold"))
        _log.warning("rollup owed", "coda-memory: owed rollups not folded: %s", _described(exc))
        return state


def _described(exc: BaseException) -> str:
    """What a log line says of a fold's error: the first line of a lock's or a deadlock's
    message (which quote nothing), else only the error's class and SQLSTATE: a server's
    message may quote the value it refused (``invalid input syntax for type …: "…"``),
    a tenant's data, and the log carries none."""
    state = sqlstate(exc)
    if state in _DEFERRABLE:
        lines = str(exc).strip().splitlines()
        return lines[0][:200] if lines else type(exc).__name__
    return f"{type(exc).__name__} (SQLSTATE {state})"


class RollupDebt:
    """What one store knows of the rollup it owes, to fold only when worth it: whether it
    recorded owed rollups that it has not seen folded since, and its appends, counted
    for the periodic fold of :data:`FOLD_EVERY`."""

    def __init__(self, every: int = FOLD_EVERY) -> None:
        self.every = every
        #: This store recorded owed rollups not known to be folded.
        self.known = False
        self._appends = 0

    def due(self) -> bool:
        """Count an append; True when it should fold owed records."""
        self._appends += 1
        return self.known or self._appends % self.every == 0

    def committed(self, owed: bool, folded: Folded | None) -> None:
        """After an append committed: it recorded owed rollups (``owed``), or folded
        (``folded``, None when it did not try)."""
        if owed:
            self.known = True
        elif folded is not None and folded.settled:
            self.known = False
