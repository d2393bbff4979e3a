"""Repositories: set-based statements over one :class:`AsyncConnection`.

Repositories never begin, commit or roll back; whoever owns the connection owns the
transaction. Every statement is built from the Core tables, so the engine's
``schema_translate_map`` places it in the configured schema, and every value is a bound
parameter. Rows become pydantic models here, once, with tz-aware UTC datetimes.

These serve the reads and ``forget``; consolidation's own statements, on the hot path,
and the checkpoint lock are prepared asyncpg statements in ``unit``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from sqlalchemy import (
    delete,
    select,
)
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from coda_memory.core.model import (
    Fact,
    FactEvent,
    Observation,
    UtcDatetime,
)
from coda_memory.postgres.rows import event_from_row, fact_from_row, observation_from_mapping
from coda_memory.postgres.schema import (
    checkpoints,
    fact_events,
    facts,
    observations,
)


class Checkpoint(BaseModel):
    """How far consolidation of one identity has got."""

    model_config = ConfigDict(frozen=True)

    identity_id: str
    #: The ``pg_snapshot`` (text form) of the last consolidation; None before the first.
    snapshot: str | None
    consolidated_at: UtcDatetime | None
    runs: int
    observations_consumed: int


#: Everything but ``xid``, which only the cursor's conditions use.
_OBSERVATION_COLUMNS = [c for c in observations.c if c.name != "xid"]


def _fact(row: RowMapping) -> Fact:
    return fact_from_row(row["identity_id"], row)


def _event(row: RowMapping) -> FactEvent:
    return event_from_row(row["identity_id"], row)


class ObservationRepository:
    """The observation log of each identity."""

    def __init__(self, conn: AsyncConnection) -> None:
        self._conn = conn

    async def stored(self, identity_id: str) -> list[Observation]:
        """Every stored observation of the identity, in insertion order."""
        statement = (
            select(*_OBSERVATION_COLUMNS)
            .where(observations.c.identity_id == identity_id)
            .order_by(observations.c.id)
        )
        result = await self._conn.execute(statement)
        return [observation_from_mapping(row) for row in result.mappings()]

    async def every_stored(self) -> list[Observation]:
        """Every stored observation of every identity, in time order (for a replay)."""
        statement = select(*_OBSERVATION_COLUMNS).order_by(
            observations.c.created_at, observations.c.id
        )
        result = await self._conn.execute(statement)
        return [observation_from_mapping(row) for row in result.mappings()]

    async def delete_identity(self, identity_id: str) -> int:
        """Delete the identity's observations; how many."""
        result = await self._conn.execute(
            delete(observations).where(observations.c.identity_id == identity_id)
        )
        return result.rowcount


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

    async def delete_identity(self, identity_id: str) -> int:
        """Delete the identity's facts; how many."""
        result = await self._conn.execute(delete(facts).where(facts.c.identity_id == identity_id))
        return result.rowcount


class FactEventRepository:
    """The append-only history of facts."""

    def __init__(self, conn: AsyncConnection) -> None:
        self._conn = conn

    async def history(self, identity_id: str, subject: str | None = None) -> list[FactEvent]:
        """The identity's events (of one subject, if given) in the order they were written."""
        statement = select(fact_events).where(fact_events.c.identity_id == identity_id)
        if subject is not None:
            statement = statement.where(fact_events.c.subject == subject)
        result = await self._conn.execute(statement.order_by(fact_events.c.id))
        return [_event(row) for row in result.mappings()]

    async def delete_identity(self, identity_id: str) -> int:
        """Delete the identity's fact events; how many."""
        result = await self._conn.execute(
            delete(fact_events).where(fact_events.c.identity_id == identity_id)
        )
        return result.rowcount


class CheckpointRepository:
    """One row per identity: the consolidation cursor (``unit`` locks it)."""

    def __init__(self, conn: AsyncConnection) -> None:
        self._conn = conn

    async def get(self, identity_id: str) -> Checkpoint | None:
        statement = select(checkpoints).where(checkpoints.c.identity_id == identity_id)
        row = (await self._conn.execute(statement)).mappings().one_or_none()
        return None if row is None else Checkpoint.model_validate(dict(row))

    async def delete(self, identity_id: str) -> None:
        await self._conn.execute(
            delete(checkpoints).where(checkpoints.c.identity_id == identity_id)
        )
