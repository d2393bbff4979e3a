"""An in-memory store: the reference adapter, and a fake for the host app's own tests.

It keeps the same guarantees as the Postgres store within one process: consolidations of
one identity are serialised by a per-identity lock, and a unit of work changes nothing
unless it commits. The cursor is the insertion sequence: appends are atomic here, so an
observation appended after a unit loaded has a higher sequence and is left for the next run.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime

from coda_memory.core.consolidation import (
    REINFORCING,
    ConsolidationInput,
    ConsolidationPlan,
    ended_lives,
    lives_asked,
)
from coda_memory.core.model import Fact, FactEvent, Observation
from coda_memory.ports import (
    AppendOutcome,
    Forgotten,
    ObservationRecord,
    check_plan_identity,
    unidentified,
)


@dataclass(slots=True)
class _Identity:
    observations: dict[int, Observation] = field(default_factory=dict)
    facts: dict[str, Fact] = field(default_factory=dict)
    events: list[FactEvent] = field(default_factory=list)
    cursor: int = 0
    runs: int = 0
    #: The ``now`` of the last consolidation that wrote (None: none has).
    consolidated_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class InMemoryCheckpoint:
    """How far consolidation of one identity has got in an :class:`InMemoryStore`."""

    identity_id: str
    #: The insertion sequence of the last observation consumed.
    cursor: int
    runs: int


class InMemoryConsolidationUnit:
    """Unit of work over one identity's in-memory state; applies only on commit.

    It refuses what the Postgres unit refuses: a plan before ``load``, a plan that touches
    another identity, and any use after ``commit``.
    """

    def __init__(self, identity_id: str, state: _Identity) -> None:
        self.identity_id = identity_id
        self._state = state
        #: The sequence up to which ``load`` read; None until it has run.
        self._loaded_upto: int | None = None
        self._plan: ConsolidationPlan | None = None
        self._committed = False

    async def load(self) -> ConsolidationInput:
        self._check_open()
        state = self._state
        new = [o for seq, o in state.observations.items() if seq > state.cursor]
        self._loaded_upto = max((o.id for o in new), default=state.cursor)
        sessions = {o.session_id for o in new if o.session_id is not None}
        events = [e for e in state.events if e.session_id in sessions and e.kind in REINFORCING]
        facts = list(state.facts.values())
        asked = lives_asked(new, facts, state.consolidated_at)
        return ConsolidationInput(
            observations=new,
            facts=facts,
            session_events=events,
            ended=ended_lives(state.events, asked) if asked else [],
        )

    async def write(self, plan: ConsolidationPlan) -> None:
        self._check_open()
        if self._loaded_upto is None:
            raise RuntimeError("write() needs load() first: the plan must come from this unit")
        check_plan_identity(plan, self.identity_id)
        self._plan = plan

    async def commit(self) -> None:
        self._check_open()
        self._committed = True
        plan, state, loaded_upto = self._plan, self._state, self._loaded_upto
        if plan is None or loaded_upto is None:
            return
        for subject in plan.deletes:
            state.facts.pop(subject, None)
        for fact in plan.upserts:
            state.facts[fact.subject] = fact
        state.events.extend(plan.events)
        state.cursor = loaded_upto
        state.runs += 1
        # (Never back: a run by a clock set back does not move it, as on Postgres.)
        if state.consolidated_at is None or plan.now > state.consolidated_at:
            state.consolidated_at = plan.now
        # Retention: only observations this run loaded (or earlier runs consumed).
        for seq in [
            seq
            for seq, o in state.observations.items()
            if seq <= loaded_upto and o.created_at < plan.prune_before
        ]:
            del state.observations[seq]

    def _check_open(self) -> None:
        if self._committed:
            raise RuntimeError("this unit of work is committed; open a new one")


class InMemoryStore:
    """Everything in dictionaries; lost when the process exits."""

    def __init__(self) -> None:
        self._identities: dict[str, _Identity] = defaultdict(_Identity)
        #: Each identity's lock while anything holds or waits for it (a lock per identity
        #: ever consolidated or forgotten, kept for good, grew without bound).
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._ids = itertools.count(1)
        #: Outcomes by batch key: a retried batch is stored once.
        self._batches: dict[str, AppendOutcome] = {}

    async def append(
        self,
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        if batch_key is not None and batch_key in self._batches:
            return self._batches[batch_key]
        refused = unidentified(records)
        for record in records:
            if not record.identity_id:  # refused above
                continue
            seq = next(self._ids)
            self._identities[record.identity_id].observations[seq] = Observation(
                id=seq,
                identity_id=record.identity_id,
                type=record.type,
                content=record.content,
                metadata=record.metadata,
                session_id=record.session_id,
                created_at=record.created_at,
            )
        outcome = AppendOutcome(stored=len(records) - len(refused), refused=refused)
        if batch_key is not None:
            self._batches[batch_key] = outcome
        return outcome

    def _lock(self, identity_id: str) -> asyncio.Lock:
        """The identity's lock; the caller holds it while it holds or waits for it."""
        lock = self._locks.get(identity_id)
        if lock is None:
            lock = self._locks[identity_id] = asyncio.Lock()
        return lock

    @asynccontextmanager
    async def consolidation(self, identity_id: str) -> AsyncIterator[InMemoryConsolidationUnit]:
        async with self._lock(identity_id):
            yield InMemoryConsolidationUnit(identity_id, self._identities[identity_id])

    async def facts(self, identity_id: str) -> list[Fact]:
        state = self._identities.get(identity_id)
        return [] if state is None else sorted(state.facts.values(), key=lambda f: f.subject)

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        state = self._identities.get(identity_id)
        if state is None:
            return [], False
        pending = any(seq > state.cursor for seq in state.observations)
        return list(state.facts.values()), pending

    async def history(self, identity_id: str, subject: str | None = None) -> list[FactEvent]:
        state = self._identities.get(identity_id)
        if state is None:
            return []
        return [e for e in state.events if subject is None or e.subject == subject]

    async def observations(self, identity_id: str) -> list[Observation]:
        """Stored (not yet pruned) observations of the identity, oldest first."""
        state = self._identities.get(identity_id)
        return [] if state is None else list(state.observations.values())

    async def checkpoint(self, identity_id: str) -> InMemoryCheckpoint | None:
        """The identity's checkpoint, or None before its first consolidation."""
        state = self._identities.get(identity_id)
        if state is None or state.runs == 0:
            return None
        return InMemoryCheckpoint(identity_id, state.cursor, state.runs)

    async def forget(self, identity_id: str) -> Forgotten:
        async with self._lock(identity_id):
            state = self._identities.pop(identity_id, None)
        if state is None:
            return Forgotten()
        return Forgotten(len(state.observations), len(state.facts), len(state.events))

    async def close(self) -> None:
        return None
