"""Builders of port-level values (records, facts, events, plans) and one-run helpers,
for tests that talk to a store through its port."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from coda_memory.core.model import (
    Fact,
    FactCategory,
    FactEvent,
    FactEventKind,
    Observation,
    ObservationType,
    fact_id,
)
from coda_memory.ports import ConsolidationInput, ConsolidationPlan, MemoryStore, ObservationRecord

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def record(
    content: str = "called get_account",
    *,
    identity_id: str = "alice",
    type: ObservationType = ObservationType.TOOL_SUCCESS,
    metadata: dict[str, Any] | None = None,
    session_id: str | None = "s1",
    created_at: datetime = NOW,
) -> ObservationRecord:
    return ObservationRecord(
        identity_id=identity_id,
        type=type,
        content=content,
        metadata={"toolName": "get_account"} if metadata is None else metadata,
        session_id=session_id,
        created_at=created_at,
    )


def fact(
    subject: str = "tool_affinity:get_account",
    *,
    identity_id: str = "alice",
    confidence: float = 0.5,
    count: int = 1,
    at: datetime = NOW,
    confidence_at: datetime | None = None,
    ease_factor: float | None = None,
) -> Fact:
    return Fact(
        id=fact_id(subject),
        identity_id=identity_id,
        category=FactCategory(subject.split(":", 1)[0]),
        subject=subject,
        content=f"uses {subject}",
        confidence=confidence,
        reinforcement_count=count,
        last_reinforced_at=at,
        created_at=at,
        updated_at=at,
        ease_factor=ease_factor,
        confidence_at=confidence_at,
    )


def event(
    subject: str = "tool_affinity:get_account",
    *,
    identity_id: str = "alice",
    kind: FactEventKind = FactEventKind.CREATED,
    session_id: str | None = "s1",
    at: datetime = NOW,
) -> FactEvent:
    return FactEvent(
        identity_id=identity_id,
        subject=subject,
        category=FactCategory(subject.split(":", 1)[0]),
        kind=kind,
        session_id=session_id,
        at=at,
        confidence_before=None,
        confidence_after=0.5,
        count_before=None,
        count_after=1,
        ease_before=None,
        ease_after=2.5,
        quality=1.0,
        hits=1,
        trials=1,
    )


def plan(
    identity_id: str = "alice",
    *,
    consumed: int = 0,
    now: datetime = NOW,
    upserts: Sequence[Fact] = (),
    deletes: Sequence[str] = (),
    events: Sequence[FactEvent] = (),
    prune_before: datetime = EPOCH,
) -> ConsolidationPlan:
    return ConsolidationPlan(
        identity_id=identity_id,
        now=now,
        upserts=list(upserts),
        deletes=list(deletes),
        events=list(events),
        prune_before=prune_before,
        active=list(upserts),
        consumed=consumed,
    )


async def consolidate(
    store: MemoryStore,
    identity_id: str = "alice",
    *,
    now: datetime = NOW,
    retention: timedelta | None = None,
    upserts: Sequence[Fact] = (),
    events: Sequence[FactEvent] = (),
) -> ConsolidationInput:
    """One committed run that consumes whatever it loads; returns what it loaded."""
    async with store.consolidation(identity_id) as unit:
        loaded = await unit.load()
        prune_before = EPOCH if retention is None else now - retention
        await unit.write(
            plan(
                identity_id,
                consumed=len(loaded.observations),
                now=now,
                upserts=upserts,
                events=events,
                prune_before=prune_before,
            )
        )
        await unit.commit()
    return loaded


def contents(observations: Sequence[Observation]) -> list[str]:
    return [o.content for o in observations]
