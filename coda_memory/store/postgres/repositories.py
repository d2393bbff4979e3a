"""Repositories: set-based statements over one :class:`AsyncConnection`.

Repositories never begin, commit or roll back; whoever owns the connection owns the
transaction. Every statement is built from the Core tables, so the engine's
``schema_translate_map`` places it in the configured schema, and every value is a bound
parameter. Rows become pydantic models here, once, with tz-aware UTC datetimes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import (
    Boolean,
    ColumnElement,
    Table,
    Text,
    any_,
    bindparam,
    cast,
    column,
    delete,
    func,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.selectable import Select, TableValuedAlias

from coda_memory.model import (
    Fact,
    FactEvent,
    FactEventKind,
    Observation,
    UtcDatetime,
)
from coda_memory.store.postgres.schema import (
    PgSnapshot,
    checkpoints,
    fact_events,
    facts,
    observations,
)
from coda_memory.store.postgres.unit import event_from_row, fact_from_row

#: Event kinds that record a session's reinforcement of a fact.
REINFORCING_KINDS = (FactEventKind.CREATED, FactEventKind.REINFORCED, FactEventKind.EXTENDED)


class Checkpoint(BaseModel):
    """How far consolidation of one identity has got."""

    model_config = ConfigDict(frozen=True)

    identity_id: str
    #: The ``pg_snapshot`` (text form) of the last consolidation; None before the first.
    snapshot: str | None
    consolidated_at: UtcDatetime | None
    runs: int
    observations_consumed: int


def _snapshot(value: str, name: str) -> ColumnElement[Any]:
    # asyncpg has no pg_snapshot codec: the value travels as text and is cast server-side.
    return cast(bindparam(name, value, type_=Text), PgSnapshot())


def _visible_in(xid: ColumnElement[Any], snapshot: ColumnElement[Any]) -> ColumnElement[bool]:
    return func.pg_visible_in_snapshot(xid, snapshot, type_=Boolean)


def _unnest(table: Table, columns: Mapping[str, Sequence[Any]]) -> TableValuedAlias:
    """``unnest(:a, :b, …) WITH ORDINALITY AS rows(a, b, …, ord)``, one array per column."""
    arrays = [
        bindparam(name, list(values), type_=ARRAY(table.c[name].type))
        for name, values in columns.items()
    ]
    names = [column(name, table.c[name].type) for name in columns]
    return (
        func.unnest(*arrays).table_valued(*names, with_ordinality="ord").render_derived(name="rows")
    )


#: Everything but ``xid``, which only the cursor's conditions use.
_OBSERVATION_COLUMNS = [c for c in observations.c if c.name != "xid"]


def _observation(row: RowMapping) -> Observation:
    return Observation(
        id=row["id"],
        identity_id=row["identity_id"],
        type=row["type"],
        content=row["content"],
        metadata=row["metadata"],
        session_id=row["session_id"],
        created_at=row["created_at"],
    )


def _fact(row: RowMapping) -> Fact:
    return fact_from_row(row["identity_id"], row)


_EVENT_FIELDS = (
    "identity_id",
    "subject",
    "category",
    "kind",
    "session_id",
    "at",
    "confidence_before",
    "confidence_after",
    "count_before",
    "count_after",
    "ease_before",
    "ease_after",
    "quality",
    "hits",
    "trials",
)


def _event(row: RowMapping) -> FactEvent:
    return event_from_row(row["identity_id"], row)


def new_observations(identity_id: str, current: str, previous: str | None) -> Select[Any]:
    """The cursor's query (the module docstring of ``store`` argues for it)."""
    xid = observations.c.xid
    cur = _snapshot(current, "current")
    conditions = [
        observations.c.identity_id == identity_id,
        # Range bounds on (identity_id, xid): every xid visible in a snapshot is below its
        # xmax, and every xid below the previous snapshot's xmin was visible in it.
        xid < func.pg_snapshot_xmax(cur),
        _visible_in(xid, cur),
    ]
    if previous is not None:
        prev = _snapshot(previous, "previous")
        conditions += [xid >= func.pg_snapshot_xmin(prev), ~_visible_in(xid, prev)]
    return select(*_OBSERVATION_COLUMNS).where(*conditions).order_by(observations.c.id)


class ObservationRepository:
    """The observation log of each identity."""

    def __init__(self, conn: AsyncConnection) -> None:
        self._conn = conn

    async def new(self, identity_id: str, current: str, previous: str | None) -> list[Observation]:
        """Observations whose writing transaction is visible in ``current`` but was not
        visible in ``previous`` (every visible one when ``previous`` is None)."""
        result = await self._conn.execute(new_observations(identity_id, current, previous))
        return [_observation(row) for row in result.mappings()]

    async def prune(self, identity_id: str, before: datetime, current: str) -> int:
        """Delete observations older than ``before`` whose transaction ``current`` saw."""
        statement = delete(observations).where(
            observations.c.identity_id == identity_id,
            observations.c.created_at < before,
            _visible_in(observations.c.xid, _snapshot(current, "current")),
        )
        result = await self._conn.execute(statement)
        return result.rowcount

    async def stored(self, identity_id: str) -> list[Observation]:
        """Every stored observation of the identity, in insertion order."""
        statement = (
            select(*_OBSERVATION_COLUMNS)
            .where(observations.c.identity_id == identity_id)
            .order_by(observations.c.id)
        )
        result = await self._conn.execute(statement)
        return [_observation(row) for row in result.mappings()]

    async def delete_identity(self, identity_id: str) -> None:
        await self._conn.execute(
            delete(observations).where(observations.c.identity_id == identity_id)
        )


class FactRepository:
    """Facts in stored form: ``confidence`` at ``confidence_at`` (the fact's anchor)."""

    def __init__(self, conn: AsyncConnection) -> None:
        self._conn = conn

    async def stored(self, identity_id: str) -> list[Fact]:
        """The identity's facts, by subject."""
        statement = (
            select(facts).where(facts.c.identity_id == identity_id).order_by(facts.c.subject)
        )
        result = await self._conn.execute(statement)
        return [_fact(row) for row in result.mappings()]

    async def upsert(self, identity_id: str, items: Sequence[Fact]) -> None:
        """Insert or overwrite ``items`` (all of ``identity_id``) in one statement."""
        if not items:
            return
        rows = _unnest(
            facts,
            {
                "subject": [f.subject for f in items],
                "category": [f.category.value for f in items],
                "content": [f.content for f in items],
                "confidence": [f.confidence for f in items],
                "reinforcement_count": [f.reinforcement_count for f in items],
                "last_reinforced_at": [f.last_reinforced_at for f in items],
                "confidence_at": [f.anchor for f in items],
                "created_at": [f.created_at for f in items],
                "updated_at": [f.updated_at for f in items],
                "ease_factor": [f.ease_factor for f in items],
            },
        )
        names = [c.name for c in rows.c if c.name != "ord"]
        source = select(
            bindparam("identity_id", identity_id, type_=Text),
            *(rows.c[name] for name in names),
        ).order_by(rows.c.ord)
        statement = insert(facts).from_select(["identity_id", *names], source)
        statement = statement.on_conflict_do_update(
            index_elements=[facts.c.identity_id, facts.c.subject],
            set_={name: statement.excluded[name] for name in names if name != "subject"},
        )
        await self._conn.execute(statement)

    async def delete(self, identity_id: str, subjects: Collection[str]) -> None:
        """Delete the identity's facts with these subjects."""
        if not subjects:
            return
        statement = delete(facts).where(
            facts.c.identity_id == identity_id,
            facts.c.subject == any_(bindparam("subjects", list(subjects), ARRAY(Text))),
        )
        await self._conn.execute(statement)

    async def delete_identity(self, identity_id: str) -> None:
        await self._conn.execute(delete(facts).where(facts.c.identity_id == identity_id))


class FactEventRepository:
    """The append-only history of facts."""

    def __init__(self, conn: AsyncConnection) -> None:
        self._conn = conn

    async def append(
        self, identity_id: str, events: Sequence[FactEvent], recorded_at: datetime
    ) -> None:
        """Append ``events`` (all of ``identity_id``) in order, in one statement."""
        if not events:
            return
        columns: dict[str, Sequence[Any]] = {
            name: [getattr(e, name) for e in events] for name in _EVENT_FIELDS[1:]
        }
        columns["category"] = [e.category.value for e in events]
        columns["kind"] = [e.kind.value for e in events]
        rows = _unnest(fact_events, columns)
        names = list(columns)
        source = select(
            bindparam("identity_id", identity_id, type_=Text),
            bindparam("recorded_at", recorded_at, type_=fact_events.c.recorded_at.type),
            *(rows.c[name] for name in names),
        ).order_by(rows.c.ord)
        statement = insert(fact_events).from_select(["identity_id", "recorded_at", *names], source)
        await self._conn.execute(statement)

    async def history(self, identity_id: str, subject: str | None = None) -> list[FactEvent]:
        """The identity's events (of one subject, if given) in the order they were written."""
        statement = select(fact_events).where(fact_events.c.identity_id == identity_id)
        if subject is not None:
            statement = statement.where(fact_events.c.subject == subject)
        result = await self._conn.execute(statement.order_by(fact_events.c.id))
        return [_event(row) for row in result.mappings()]

    async def reinforcing(self, identity_id: str, session_ids: Collection[str]) -> list[FactEvent]:
        """Created/reinforced/extended events of these sessions, in the order written."""
        if not session_ids:
            return []
        statement = (
            select(fact_events)
            .where(
                fact_events.c.identity_id == identity_id,
                fact_events.c.session_id
                == any_(bindparam("sessions", list(session_ids), ARRAY(Text))),
                fact_events.c.kind.in_([kind.value for kind in REINFORCING_KINDS]),
            )
            .order_by(fact_events.c.id)
        )
        result = await self._conn.execute(statement)
        return [_event(row) for row in result.mappings()]

    async def delete_identity(self, identity_id: str) -> None:
        await self._conn.execute(
            delete(fact_events).where(fact_events.c.identity_id == identity_id)
        )


class CheckpointRepository:
    """One row per identity: the consolidation cursor, and the row that serialises runs."""

    def __init__(self, conn: AsyncConnection) -> None:
        self._conn = conn

    async def ensure(self, identity_id: str) -> None:
        """Create the identity's checkpoint if it has none."""
        statement = (
            insert(checkpoints)
            .values(identity_id=identity_id)
            .on_conflict_do_nothing(index_elements=[checkpoints.c.identity_id])
        )
        await self._conn.execute(statement)

    async def lock(self, identity_id: str) -> Checkpoint | None:
        """Lock the identity's checkpoint until the transaction ends (None: no row)."""
        statement = (
            select(checkpoints).where(checkpoints.c.identity_id == identity_id).with_for_update()
        )
        row = (await self._conn.execute(statement)).mappings().one_or_none()
        return None if row is None else Checkpoint.model_validate(dict(row))

    async def get(self, identity_id: str) -> Checkpoint | None:
        statement = select(checkpoints).where(checkpoints.c.identity_id == identity_id)
        row = (await self._conn.execute(statement)).mappings().one_or_none()
        return None if row is None else Checkpoint.model_validate(dict(row))

    async def current_snapshot(self) -> str:
        """``pg_current_snapshot()`` in text form, taken by a statement of its own."""
        result = await self._conn.execute(select(cast(func.pg_current_snapshot(), Text)))
        return str(result.scalar_one())

    async def advance(
        self, identity_id: str, snapshot: str, consolidated_at: datetime, consumed: int
    ) -> None:
        """Record a finished run: its snapshot becomes the cursor."""
        statement = (
            update(checkpoints)
            .where(checkpoints.c.identity_id == identity_id)
            .values(
                snapshot=snapshot,
                consolidated_at=consolidated_at,
                runs=checkpoints.c.runs + 1,
                observations_consumed=checkpoints.c.observations_consumed + consumed,
            )
        )
        await self._conn.execute(statement)

    async def delete(self, identity_id: str) -> None:
        await self._conn.execute(
            delete(checkpoints).where(checkpoints.c.identity_id == identity_id)
        )
