"""The consolidation unit of work on Postgres, and the read-only peek before it.

This is the hot path of every agent request, so it talks to asyncpg directly, with
statements that asyncpg prepares once per connection (the consolidation's transaction also
asks the server for their generic plans, made once per connection; the peek, outside a
transaction, is planned as Postgres decides), and keeps round trips to a minimum:

* lock: one ``SELECT … FOR UPDATE`` (the first time an identity is seen, an ``INSERT … ON
  CONFLICT DO NOTHING`` and the ``SELECT`` again);
* load: the current snapshot and the new observations in one statement, the stored facts
  in a second (unless this process knows the facts of the checkpoint's version, see
  :mod:`~coda_memory.postgres.known`), the earlier fact events of the sessions that
  have some in a third, and, in the rare run where observations dated before the last
  consolidation reach facts deleted since, those facts' last lives in a fourth;
* write: every write (fact upserts and deletes, history, checkpoint, prune) in one
  statement of data-modifying CTEs (a plan that deletes more than ``DELETE_SLICE`` facts
  sends those deletes ahead, in slices of ``facts_delete.sql``, and one that records
  more than ``EVENTS_SLICE`` events sends them ahead, in slices of
  ``fact_events_insert.sql``);
* rehearse: the peek, the lock and the reads and write above once on a new connection,
  for no identity and rolled back, so that its first requests do not pay for the
  server's first runs (:func:`rehearse`; not the first lock's ``INSERT`` nor the deletes
  sent ahead, which are rare).

The statements are the named files of :mod:`coda_memory.postgres.sql`, read once per
schema; every value is a bound parameter, passed by name. The cursor's correctness
argument is in the docstring of ``store``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

from coda_memory.core.consolidation import lives_asked
from coda_memory.core.logs import identity_label
from coda_memory.core.model import Fact, FactEvent, Observation
from coda_memory.core.sessions import subjects_reached
from coda_memory.core.turns import mapped, released
from coda_memory.ports import ConsolidationInput, ConsolidationPlan, check_plan_identity
from coda_memory.postgres.documents import event_row, fact_row, rows_document
from coda_memory.postgres.known import Known, written
from coda_memory.postgres.rows import event_from_row, fact_from_row, observation_from_row
from coda_memory.postgres.sql import Query, query
from coda_memory.postgres.tenancy import SET_TENANT

#: How often to try locking a checkpoint that is missing (first consolidation) or that a
#: concurrent ``forget`` deleted between creating and locking it.
LOCK_ATTEMPTS = 3


#: Facts deleted by one statement; a plan that deletes more sends them ahead in slices.
DELETE_SLICE = 2_000
#: Events recorded by one statement; a plan that records more (a backlog of tens of
#: thousands of observations) sends them ahead in slices, each well within the request
#: pool's ``statement_timeout`` (1,000: about 20 ms of the server's), and each a short
#: pass of the event loop (its document, 0.5 ms, and its send; 5,000 took 5 ms in one go).
EVENTS_SLICE = 1_000


@dataclass(frozen=True, slots=True)
class Statements:
    """The hot-path SQL for one schema (``coda_memory/postgres/sql/<name>.sql``)."""

    lock: Query
    ensure: Query
    new_first: Query
    new_since: Query
    facts: Query
    session_events: Query
    ended: Query
    write: Query
    peek: Query
    delete: Query
    events: Query
    cap: Query

    def all(self) -> list[Query]:
        """Every hot-path statement, to prepare on a new connection (not ``cap``, which runs
        once for an identity far over its cap, nor ``events``, for a backlog)."""
        return [
            self.lock,
            self.ensure,
            self.new_first,
            self.new_since,
            self.facts,
            self.session_events,
            self.ended,
            self.write,
            self.peek,
            self.delete,
        ]

    @classmethod
    def for_schema(cls, schema: str) -> Statements:
        """Statements for ``schema`` (validated here; the files are read once)."""
        return cls(
            lock=query("checkpoint_lock", schema),
            ensure=query("checkpoint_create", schema),
            new_first=query("new_observations_first", schema),
            new_since=query("new_observations_since", schema),
            facts=query("stored_facts", schema),
            session_events=query("session_fact_events", schema),
            ended=query("ended_lives", schema),
            write=query("consolidation_write", schema),
            peek=query("peek", schema),
            delete=query("facts_delete", schema),
            events=query("fact_events_insert", schema),
            cap=query("facts_cap", schema),
        )


@dataclass(frozen=True, slots=True)
class Locked:
    """The checkpoint row as its lock was granted."""

    #: The cursor (None: never consolidated).
    snapshot: str | None
    #: The version of the identity's facts (:mod:`~coda_memory.postgres.known`).
    version: str
    #: When the identity was last consolidated (None: never).
    consolidated_at: datetime | None = None


async def stored_facts(raw: Any, statements: Statements, identity_id: str) -> list[Fact]:
    """The identity's stored facts (``stored_facts.sql``), read through ``raw``."""
    facts = statements.facts
    rows = await raw.fetch(facts.text, *facts.arguments(identity_id=identity_id))
    return await mapped(rows, partial(fact_from_row, identity_id))


async def lock_identity(raw: Any, statements: Statements, identity_id: str) -> Locked:
    """Lock the identity's checkpoint row until the transaction ``raw`` (an asyncpg
    connection) is in ends, creating the row first if needed; return its snapshot and
    version. The transaction's ``lock_timeout`` bounds each wait."""
    lock, ensure = statements.lock, statements.ensure
    for _ in range(LOCK_ATTEMPTS):
        row = await raw.fetchrow(lock.text, *lock.arguments(identity_id=identity_id))
        if row is not None:
            return Locked(row["snapshot"], row["version"], row["consolidated_at"])
        # First consolidation (or a concurrent forget removed the row): create it.
        await raw.execute(ensure.text, *ensure.arguments(identity_id=identity_id))
    raise RuntimeError(f"could not lock the checkpoint of {identity_label(identity_id)}")


async def waiting_rows(
    raw: Any, statements: Statements, identity_id: str, stored_snapshot: str | None
) -> list[Any]:
    """The identity's observations that the stored snapshot (the cursor; None: never
    consolidated) did not consume and the transaction's snapshot sees, read through
    ``raw`` under the checkpoint row's lock; the first row carries that snapshot
    (``new_observations_first.sql``, ``new_observations_since.sql``)."""
    if stored_snapshot is None:
        new = statements.new_first
        return list(await raw.fetch(new.text, *new.arguments(identity_id=identity_id)))
    new = statements.new_since
    arguments = new.arguments(identity_id=identity_id, stored_snapshot=stored_snapshot)
    return list(await raw.fetch(new.text, *arguments))


async def waiting_observations(identity_id: str, rows: Sequence[Any]) -> list[Observation]:
    """The observations of :func:`waiting_rows` (a row without an id only carries the
    snapshot), made in slices with turns of the loop between them, in the load's turn:
    a held table leaves hundreds, or thousands, waiting."""
    read = [r for r in rows if r["id"] is not None]
    return await mapped(read, partial(observation_from_row, identity_id))


async def subjects_waiting(
    raw: Any, statements: Statements, identity_id: str, locked: Locked
) -> list[str]:
    """The subjects whose facts the observations waiting for the identity's next
    consolidation may change (:func:`~coda_memory.core.sessions.subjects_reached`), read
    under the checkpoint row's lock ``locked``."""
    rows = await waiting_rows(raw, statements, identity_id, locked.snapshot)
    return sorted(subjects_reached(await waiting_observations(identity_id, rows)))


async def write_arguments(
    statement: Query,
    plan: ConsolidationPlan,
    snapshot: str,
    deletes: Sequence[str],
    events: Sequence[FactEvent] | None = None,
) -> list[Any]:
    """The arguments of ``consolidation_write.sql`` for ``plan``, by parameter name; the
    facts it deletes are ``deletes`` (those of the plan not sent ahead in slices), and
    the events it records ``events`` (None: the plan's; those not sent ahead). The
    facts and events go as JSON documents of rows (see the statement), made in slices
    with turns of the event loop between them (the plan of a backlog of 600 observations
    has about 250 facts and 600 events: 1 to 3 ms in one go)."""
    facts = await mapped(plan.upserts, fact_row)
    rows = await mapped(plan.events if events is None else events, event_row)
    return statement.arguments(
        identity_id=plan.identity_id,
        facts=rows_document(facts),
        deleted_subjects=list(deletes),
        now=plan.now,
        events=rows_document(rows),
        snapshot=snapshot,
        consumed=plan.consumed,
        prune_before=plan.prune_before,
    )


class PostgresConsolidationUnit:
    """A unit of work over one identity: it holds the checkpoint row lock and the
    transaction (owned by the store), and writes nothing visible until :meth:`commit`."""

    def __init__(
        self,
        raw: Any,
        statements: Statements,
        identity_id: str,
        locked: Locked,
        commit: Callable[[], Awaitable[None]],
        known: Known | None = None,
    ) -> None:
        """Use :meth:`open`; ``raw`` is an asyncpg connection inside a transaction whose
        lock on the identity's checkpoint row is held, and ``commit`` commits it.
        ``known`` holds the stored facts when already known (not read again)."""
        self._raw = raw
        self._sql = statements
        self.identity_id = identity_id
        #: The cursor as it was when the lock was granted (None: never consolidated).
        self.stored_snapshot = locked.snapshot
        #: The version of the identity's facts as the lock found them.
        self.locked_version = locked.version
        #: When the identity was last consolidated, as the lock found it (None: never).
        self.consolidated_at = locked.consolidated_at
        self._snapshot: str | None = None
        self._commit = commit
        self._committed = False
        #: The stored facts with their version, as this transaction sees them; after a
        #: commit, as it left them (None until known).
        self.known: Known | None = known
        #: The stored facts were read (none were known at the locked version).
        self.facts_read = False
        self._written: Known | None = None

    @classmethod
    async def open(
        cls,
        raw: Any,
        statements: Statements,
        identity_id: str,
        commit: Callable[[], Awaitable[None]],
        known: Known | None = None,
    ) -> PostgresConsolidationUnit:
        """Lock the identity's checkpoint row (creating it first if needed); ``raw`` must
        already be inside the transaction that ``commit`` commits. The facts ``known``
        to the caller are used when they go with the locked row's version."""
        locked = await lock_identity(raw, statements, identity_id)
        if known is not None and known.version != locked.version:
            known = None
        return cls(raw, statements, identity_id, locked, commit, known)

    async def load(self) -> ConsolidationInput:
        self._check_open()
        identity_id = self.identity_id
        sql = self._sql
        rows = await waiting_rows(self._raw, sql, identity_id, self.stored_snapshot)
        self._snapshot = rows[0]["snapshot"]
        if self.known is None:
            fact_rows = await self._raw.fetch(
                sql.facts.text, *sql.facts.arguments(identity_id=identity_id)
            )
            self.facts_read = True
            self.known = await Known.read(self.locked_version, identity_id, fact_rows)
        stored = await self.known.facts()
        observations = await waiting_observations(identity_id, rows)
        sessions = sorted(
            {r["session_id"] for r in rows if r["session_seen"] and r["session_id"] is not None}
        )
        # Freed in steps: a backlog's 100,000 rows took 7 to 14 ms to free in one go.
        await released(rows)
        events: list[FactEvent] = []
        if sessions:
            earlier = sql.session_events
            arguments = earlier.arguments(identity_id=identity_id, session_ids=sessions)
            events = await mapped(
                await self._raw.fetch(earlier.text, *arguments),
                partial(event_from_row, identity_id),
            )
        # The last lives of deleted facts that late observations may resume (rarely any).
        ended: list[FactEvent] = []
        asked = lives_asked(observations, stored, self.consolidated_at)
        if asked:
            lives = sql.ended
            arguments = lives.arguments(identity_id=identity_id, subjects=sorted(asked))
            ended = await mapped(
                await self._raw.fetch(lives.text, *arguments),
                partial(event_from_row, identity_id),
            )
        # The facts are new models (the kept ones are dicts): the plan may make them views.
        return ConsolidationInput(
            observations=observations,
            facts=stored,
            session_events=events,
            ended=ended,
            facts_owned=True,
        )

    async def write(self, plan: ConsolidationPlan) -> None:
        self._check_open()
        if self._snapshot is None:
            raise RuntimeError("write() needs load() first: the plan must come from this unit")
        check_plan_identity(plan, self.identity_id)
        deletes = plan.deletes
        if len(deletes) > DELETE_SLICE:
            # A cap that drops many facts: their deletes go ahead in slices (see the SQL).
            delete = self._sql.delete
            for start in range(0, len(deletes), DELETE_SLICE):
                subjects = deletes[start : start + DELETE_SLICE]
                arguments = delete.arguments(identity_id=self.identity_id, subjects=subjects)
                await self._raw.execute(delete.text, *arguments)
            deletes = []
        events = plan.events
        if len(events) > EVENTS_SLICE:
            # A backlog's history: ahead, in slices, in order (see the SQL).
            insert = self._sql.events
            for start in range(0, len(events), EVENTS_SLICE):
                rows = await mapped(events[start : start + EVENTS_SLICE], event_row)
                arguments = insert.arguments(
                    identity_id=self.identity_id, now=plan.now, events=rows_document(rows)
                )
                await self._raw.execute(insert.text, *arguments)
            events = []
        write = self._sql.write
        arguments = await write_arguments(write, plan, self._snapshot, deletes, events)
        row = await self._raw.fetchrow(write.text, *arguments)
        if self.known is not None:
            self._written = written(row["version"], self.known, plan.upserts, plan.deletes)

    async def commit(self) -> None:
        self._check_open()
        await self._commit()
        self._committed = True
        self.known = self._written

    def _check_open(self) -> None:
        if self._committed:
            raise RuntimeError("this unit of work is committed; open a new one")


@dataclass(frozen=True, slots=True)
class Peeked:
    """What :func:`peek` read, in one statement and snapshot."""

    #: The stored facts; none when observations wait (``pending``): the consolidation
    #: that follows uses the known ones, and building them here would be work lost.
    facts: list[Fact]
    pending: bool
    #: The version of the identity's facts (None: no checkpoint).
    version: str | None
    #: False when the facts are the ``known`` ones, not read again.
    read: bool
    #: The facts read, with their version, to keep (None: not read, or no version).
    known: Known | None = None
    #: The facts were not read: they are more than the ``read_limit`` of the peek.
    over: bool = False


async def peek(
    raw: Any,
    statements: Statements,
    identity_id: str,
    known: Known | None,
    read_limit: int | None = None,
) -> Peeked:
    """Whether new observations wait, the version of the identity's facts and the facts
    (left out when observations wait), in one statement and without a lock; the facts
    are read only when ``known`` does not hold those of the current version, and when
    they are at most ``read_limit`` (None: any number; more: ``over``, nothing read)."""
    statement = statements.peek
    arguments = statement.arguments(
        identity_id=identity_id,
        known_version=None if known is None else known.version,
        read_limit=read_limit,
    )
    rows = await raw.fetch(statement.text, *arguments)
    pending = bool(rows[0]["pending"]) if rows else False
    version = rows[0]["version"] if rows else None
    if rows and rows[0]["over"]:
        return Peeked([], pending, version, read=False, over=True)
    if known is not None and version == known.version:
        return Peeked([] if pending else await known.facts(), pending, version, read=False)
    fact_rows = [r for r in rows if r["subject"] is not None]
    if version is None:  # no checkpoint row: nothing to keep the facts with
        facts = await mapped(fact_rows, partial(fact_from_row, identity_id))
        return Peeked(facts, pending, version, read=True)
    read = await Known.read(version, identity_id, fact_rows)
    facts = [] if pending else await read.facts()
    return Peeked(facts, pending, version, read=True, known=read)


async def unchanged(raw: Any, statements: Statements, identity_id: str, version: str) -> bool:
    """Whether the identity's facts still have ``version`` and no observation waits: the
    peek's statement, which then sends no fact (with a read limit of 0, neither when the
    version moved)."""
    statement = statements.peek
    arguments = statement.arguments(identity_id=identity_id, known_version=version, read_limit=0)
    rows = await raw.fetch(statement.text, *arguments)
    return bool(rows) and rows[0]["version"] == version and not rows[0]["pending"]


#: The identity a rehearsal runs for: no identity is empty (``check_identity`` refuses
#: it). The app role may neither see nor write its rows; an owner, whom row-level
#: security does not bound, may find some (stores wrote them before they refused it),
#: and what its statements change of them is rolled back.
REHEARSAL_IDENTITY = ""


async def rehearse(raw: Any, statements: Statements, begin: str) -> None:
    """Run the statements of a peek and a consolidation once on ``raw`` (an asyncpg
    connection with the statements prepared, outside a transaction), for
    :data:`REHEARSAL_IDENTITY`, in a transaction that ``begin`` opens (the consolidation's
    own ``BEGIN``) and that is rolled back.

    The first run of a statement on a connection costs the server more than the runs
    after it: its backend reads the catalog entries and statistics its plan needs, and the
    consolidation's statements make their generic plans (see ``GENERIC_PLANS`` in the
    store), which later runs on the connection reuse. :meth:`PostgresStore.start` has each
    request connection rehearse, so the first requests do not pay for it (about 1 to 3 ms
    for the first consolidation on each connection of a 2-core machine)."""
    identity_id = REHEARSAL_IDENTITY
    await raw.execute(begin)
    try:
        await raw.execute(SET_TENANT, identity_id)
        await peek(raw, statements, identity_id, None)
        lock = statements.lock
        await raw.fetchrow(lock.text, *lock.arguments(identity_id=identity_id))
        rows = await waiting_rows(raw, statements, identity_id, None)
        snapshot = rows[0]["snapshot"]
        await waiting_rows(raw, statements, identity_id, snapshot)
        await stored_facts(raw, statements, identity_id)
        earlier, lives = statements.session_events, statements.ended
        await raw.fetch(earlier.text, *earlier.arguments(identity_id=identity_id, session_ids=[""]))
        await raw.fetch(lives.text, *lives.arguments(identity_id=identity_id, subjects=[""]))
        write = statements.write
        arguments = write.arguments(
            identity_id=identity_id,
            facts=rows_document([]),
            deleted_subjects=[],
            now=datetime.now(UTC),
            events=rows_document([]),
            snapshot=snapshot,
            consumed=0,
            prune_before=None,
        )
        await raw.fetchrow(write.text, *arguments)
    finally:
        await raw.execute("ROLLBACK")
