"""The consolidation unit of work on Postgres, and the read-only peek before it.

This is the hot path of every agent request, so it talks to asyncpg directly, with
statements that asyncpg prepares once per connection, and keeps round trips to a minimum:

* lock: one ``SELECT … FOR UPDATE`` (plus an ``INSERT … ON CONFLICT DO NOTHING`` the first
  time an identity is seen);
* load: the current snapshot and the new observations in one statement, the stored facts
  in a second, and the sessions' earlier fact events in a third when there are sessions;
* apply: every write (fact upserts and deletes, history, checkpoint, prune) in one
  statement of data-modifying CTEs.

The cursor's correctness argument is in the docstring of ``store``. The schema name is
validated once (``validate_schema_name``) and quoted into the statements; every value is
a bound parameter.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from coda_memory.core.model import (
    Fact,
    FactCategory,
    FactEvent,
    FactEventKind,
    Observation,
    ObservationType,
    fact_id,
    gc_paused,
    trusted,
)
from coda_memory.ports import ConsolidationInput, ConsolidationPlan

_FACT_COLUMNS = (
    "subject, category, content, confidence, reinforcement_count, last_reinforced_at, "
    "confidence_at, created_at, updated_at, ease_factor"
)
_EVENT_COLUMNS = (
    "subject, category, kind, session_id, at, confidence_before, confidence_after, "
    "count_before, count_after, ease_before, ease_after, quality, hits, trials"
)


def _qualified(alias: str, columns: str) -> str:
    return ", ".join(f"{alias}.{name.strip()}" for name in columns.split(","))


@dataclass(frozen=True, slots=True)
class Statements:
    """The hot-path SQL for one schema."""

    lock: str
    ensure: str
    new_first: str
    new_since: str
    facts: str
    session_events: str
    apply: str
    peek: str

    @classmethod
    def for_schema(cls, schema: str) -> Statements:
        """Statements for ``schema``, which the caller has validated as an identifier."""
        s = f'"{schema}"'
        new = (
            # The statement's own snapshot: taken after the row lock was granted (the lock
            # was a statement of its own), and the same one this statement reads rows with.
            "WITH snap AS (SELECT pg_current_snapshot() AS s) "
            "SELECT snap.s::text AS snapshot, o.id, o.type, o.content, o.metadata::text "
            "AS metadata, o.session_id, o.created_at "
            f"FROM snap LEFT JOIN {s}.observations o ON o.identity_id = $1 "
            "AND o.xid < pg_snapshot_xmax(snap.s) AND pg_visible_in_snapshot(o.xid, snap.s) "
        )
        return cls(
            lock=f"SELECT snapshot FROM {s}.checkpoints WHERE identity_id = $1 FOR UPDATE",
            ensure=(
                f"INSERT INTO {s}.checkpoints (identity_id) VALUES ($1) "
                "ON CONFLICT (identity_id) DO NOTHING"
            ),
            new_first=new + "ORDER BY o.id",
            new_since=new + "AND o.xid >= pg_snapshot_xmin($2::text::pg_snapshot) "
            "AND NOT pg_visible_in_snapshot(o.xid, $2::text::pg_snapshot) ORDER BY o.id",
            facts=f"SELECT {_FACT_COLUMNS} FROM {s}.facts WHERE identity_id = $1",
            session_events=(
                f"SELECT {_EVENT_COLUMNS} FROM {s}.fact_events "
                "WHERE identity_id = $1 AND session_id = ANY($2::text[]) "
                "AND kind IN ('created', 'reinforced', 'extended') ORDER BY id"
            ),
            apply=(
                # Facts the plan created or reinforced, in stored form.
                f"WITH upserted AS (INSERT INTO {s}.facts (identity_id, {_FACT_COLUMNS}) "
                "SELECT $1, * FROM unnest($2::text[], $3::text[], $4::text[], $5::float8[], "
                "$6::int[], $7::timestamptz[], $8::timestamptz[], $9::timestamptz[], "
                "$10::timestamptz[], $11::float8[]) "
                "ON CONFLICT (identity_id, subject) DO UPDATE SET "
                "category = EXCLUDED.category, content = EXCLUDED.content, "
                "confidence = EXCLUDED.confidence, "
                "reinforcement_count = EXCLUDED.reinforcement_count, "
                "last_reinforced_at = EXCLUDED.last_reinforced_at, "
                "confidence_at = EXCLUDED.confidence_at, created_at = EXCLUDED.created_at, "
                "updated_at = EXCLUDED.updated_at, ease_factor = EXCLUDED.ease_factor "
                "RETURNING 1), "
                # Facts that expired (never among the upserts).
                f"deleted AS (DELETE FROM {s}.facts WHERE identity_id = $1 "
                "AND subject = ANY($12::text[]) RETURNING 1), "
                # The history, in the plan's order: ids follow ORDER BY ord.
                f"recorded AS (INSERT INTO {s}.fact_events (identity_id, recorded_at, "
                f"{_EVENT_COLUMNS}) SELECT $1, $13, e.subject, e.category, e.kind, "
                "e.session_id, e.at, e.confidence_before, e.confidence_after, e.count_before, "
                "e.count_after, e.ease_before, e.ease_after, e.quality, e.hits, e.trials "
                "FROM unnest($14::text[], $15::text[], $16::text[], $17::text[], "
                "$18::timestamptz[], $19::float8[], $20::float8[], $21::int[], $22::int[], "
                "$23::float8[], $24::float8[], $25::float8[], $26::int[], $27::int[]) "
                "WITH ORDINALITY AS e(subject, category, kind, session_id, at, "
                "confidence_before, confidence_after, count_before, count_after, ease_before, "
                "ease_after, quality, hits, trials, ord) ORDER BY e.ord RETURNING 1), "
                # The cursor moves to this run's snapshot.
                f"advanced AS (UPDATE {s}.checkpoints SET snapshot = $28, "
                "consolidated_at = $13, runs = runs + 1, "
                "observations_consumed = observations_consumed + $29 "
                "WHERE identity_id = $1 RETURNING 1), "
                # Retention: only rows this run's snapshot saw.
                f"pruned AS (DELETE FROM {s}.observations WHERE identity_id = $1 "
                "AND created_at < $30 AND pg_visible_in_snapshot(xid, $28::text::pg_snapshot) "
                "RETURNING 1) "
                "SELECT (SELECT count(*) FROM upserted), (SELECT count(*) FROM deleted), "
                "(SELECT count(*) FROM recorded), (SELECT count(*) FROM advanced), "
                "(SELECT count(*) FROM pruned)"
            ),
            peek=(
                # Is anything committed that the stored snapshot did not see? Plus the
                # facts, in the same statement and snapshot. No lock is taken.
                f"WITH cp AS (SELECT snapshot::pg_snapshot AS s FROM {s}.checkpoints "
                "WHERE identity_id = $1), "
                "pending AS (SELECT EXISTS (SELECT 1 FROM "
                f"{s}.observations o LEFT JOIN cp ON true WHERE o.identity_id = $1 AND "
                "(cp.s IS NULL OR (o.xid >= pg_snapshot_xmin(cp.s) "
                "AND NOT pg_visible_in_snapshot(o.xid, cp.s)))) AS p) "
                f"SELECT pending.p AS pending, {_qualified('f', _FACT_COLUMNS)} "
                # Facts only when nothing waits: otherwise the locked run reads them.
                f"FROM pending LEFT JOIN {s}.facts f ON f.identity_id = $1 AND NOT pending.p"
            ),
        )


def fact_from_row(identity_id: str, row: Any) -> Fact:
    """A stored fact from a trusted row (asyncpg gives tz-aware UTC datetimes)."""
    return trusted(
        Fact,
        id=fact_id(row["subject"]),
        identity_id=identity_id,
        category=FactCategory(row["category"]),
        subject=row["subject"],
        content=row["content"],
        confidence=row["confidence"],
        reinforcement_count=row["reinforcement_count"],
        last_reinforced_at=row["last_reinforced_at"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        ease_factor=row["ease_factor"],
        confidence_at=row["confidence_at"],
    )


def event_from_row(identity_id: str, row: Any) -> FactEvent:
    """A fact event from a trusted row."""
    return trusted(
        FactEvent,
        identity_id=identity_id,
        subject=row["subject"],
        category=FactCategory(row["category"]),
        kind=FactEventKind(row["kind"]),
        session_id=row["session_id"],
        at=row["at"],
        confidence_before=row["confidence_before"],
        confidence_after=row["confidence_after"],
        count_before=row["count_before"],
        count_after=row["count_after"],
        ease_before=row["ease_before"],
        ease_after=row["ease_after"],
        quality=row["quality"],
        hits=row["hits"],
        trials=row["trials"],
    )


def observation_from_row(identity_id: str, row: Any) -> Observation:
    """A stored observation from a trusted row."""
    return trusted(
        Observation,
        id=row["id"],
        identity_id=identity_id,
        type=ObservationType(row["type"]),
        content=row["content"],
        metadata=json.loads(row["metadata"]),
        session_id=row["session_id"],
        created_at=row["created_at"],
    )


def apply_arguments(plan: ConsolidationPlan, snapshot: str) -> list[Any]:
    """The parameters of :attr:`Statements.apply`, in order."""
    upserts, events = plan.upserts, plan.events
    return [
        plan.identity_id,
        [f.subject for f in upserts],
        [f.category.value for f in upserts],
        [f.content for f in upserts],
        [f.confidence for f in upserts],
        [f.reinforcement_count for f in upserts],
        [f.last_reinforced_at for f in upserts],
        [f.anchor for f in upserts],
        [f.created_at for f in upserts],
        [f.updated_at for f in upserts],
        [f.ease_factor for f in upserts],
        list(plan.deletes),
        plan.now,
        [e.subject for e in events],
        [e.category.value for e in events],
        [e.kind.value for e in events],
        [e.session_id for e in events],
        [e.at for e in events],
        [e.confidence_before for e in events],
        [e.confidence_after for e in events],
        [e.count_before for e in events],
        [e.count_after for e in events],
        [e.ease_before for e in events],
        [e.ease_after for e in events],
        [e.quality for e in events],
        [e.hits for e in events],
        [e.trials for e in events],
        snapshot,
        plan.consumed,
        plan.prune_before,
    ]


class PostgresConsolidationUnit:
    """A unit of work over one identity: it holds the checkpoint row lock and the
    transaction (owned by the store), and writes nothing visible until :meth:`commit`."""

    def __init__(
        self,
        raw: Any,
        statements: Statements,
        identity_id: str,
        stored_snapshot: str | None,
        commit: Callable[[], Awaitable[None]],
    ) -> None:
        """Use :meth:`open`; ``raw`` is an asyncpg connection inside a transaction whose
        lock on the identity's checkpoint row is held, and ``commit`` commits it."""
        self._raw = raw
        self._sql = statements
        self.identity_id = identity_id
        #: The cursor as it was when the lock was granted (None: never consolidated).
        self.stored_snapshot = stored_snapshot
        self._snapshot: str | None = None
        self._commit = commit
        self._committed = False

    @classmethod
    async def open(
        cls,
        raw: Any,
        statements: Statements,
        identity_id: str,
        commit: Callable[[], Awaitable[None]],
    ) -> PostgresConsolidationUnit:
        """Lock the identity's checkpoint row (creating it first if needed); ``raw`` must
        already be inside the transaction that ``commit`` commits."""
        for _ in range(3):
            row = await raw.fetchrow(statements.lock, identity_id)
            if row is not None:
                return cls(raw, statements, identity_id, row["snapshot"], commit)
            # First consolidation (or a concurrent forget removed the row): create it.
            await raw.execute(statements.ensure, identity_id)
        raise RuntimeError(f"could not lock the checkpoint of {identity_id!r}")

    async def load(self) -> ConsolidationInput:
        self._check_open()
        identity_id = self.identity_id
        if self.stored_snapshot is None:
            rows = await self._raw.fetch(self._sql.new_first, identity_id)
        else:
            rows = await self._raw.fetch(self._sql.new_since, identity_id, self.stored_snapshot)
        self._snapshot = rows[0]["snapshot"]
        fact_rows = await self._raw.fetch(self._sql.facts, identity_id)
        with gc_paused():
            new = [observation_from_row(identity_id, r) for r in rows if r["id"] is not None]
            stored = [fact_from_row(identity_id, r) for r in fact_rows]
        sessions = sorted({o.session_id for o in new if o.session_id is not None})
        events = (
            [
                event_from_row(identity_id, r)
                for r in await self._raw.fetch(self._sql.session_events, identity_id, sessions)
            ]
            if sessions
            else []
        )
        return ConsolidationInput(observations=new, facts=stored, session_events=events)

    async def apply(self, plan: ConsolidationPlan) -> None:
        self._check_open()
        if self._snapshot is None:
            raise RuntimeError("apply() needs load() first: the plan must come from this unit")
        self._check_identity(plan)
        await self._raw.fetchrow(self._sql.apply, *apply_arguments(plan, self._snapshot))

    async def commit(self) -> None:
        self._check_open()
        await self._commit()
        self._committed = True

    def _check_open(self) -> None:
        if self._committed:
            raise RuntimeError("this unit of work is committed; open a new one")

    def _check_identity(self, plan: ConsolidationPlan) -> None:
        owners = {plan.identity_id}
        owners.update(f.identity_id for f in plan.upserts)
        owners.update(e.identity_id for e in plan.events)
        if owners != {self.identity_id}:
            raise ValueError(
                f"the plan touches identities {sorted(owners)!r}, "
                f"but this unit consolidates {self.identity_id!r}"
            )


def peek_result(identity_id: str, rows: list[Any]) -> tuple[list[Fact], bool]:
    """Stored facts and whether new observations wait, from :attr:`Statements.peek` rows
    (no facts when observations wait)."""
    pending = bool(rows[0]["pending"]) if rows else False
    with gc_paused():
        facts = [fact_from_row(identity_id, r) for r in rows if r["subject"] is not None]
    return facts, pending
