"""The null store: memory switched off without touching the host's code.

``MemoryService.from_url("null://")`` accepts every observation and discards it
(``stats().discarded`` counts them), and ``load_memory`` returns empty results at once:
no fact is ever stored, no I/O is ever done. This is the original design's null-object
stores, behind the same port as the real ones.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from coda_memory.core.consolidation import ConsolidationInput, ConsolidationPlan
from coda_memory.core.model import Fact, FactEvent
from coda_memory.ports import AppendOutcome, Forgotten, ObservationRecord, check_plan_identity


class NullConsolidationUnit:
    """Loads nothing and writes nothing."""

    def __init__(self, identity_id: str) -> None:
        self.identity_id = identity_id
        self._loaded = False

    async def load(self) -> ConsolidationInput:
        self._loaded = True
        return ConsolidationInput(observations=[], facts=[], session_events=[])

    async def write(self, plan: ConsolidationPlan) -> None:
        if not self._loaded:
            raise RuntimeError("write() needs load() first: the plan must come from this unit")
        check_plan_identity(plan, self.identity_id)

    async def commit(self) -> None:
        return None


class NullStore:
    """A :class:`~coda_memory.ports.MemoryStore` that keeps nothing."""

    def __init__(self) -> None:
        #: Observations accepted and thrown away since the store was made.
        self.discarded = 0

    async def append(
        self,
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        self.discarded += len(records)
        return AppendOutcome(stored=0, discarded=len(records))

    @asynccontextmanager
    async def consolidation(self, identity_id: str) -> AsyncIterator[NullConsolidationUnit]:
        yield NullConsolidationUnit(identity_id)

    async def facts(self, identity_id: str) -> list[Fact]:
        return []

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        return [], False

    async def history(self, identity_id: str, subject: str | None = None) -> list[FactEvent]:
        return []

    async def forget(self, identity_id: str) -> Forgotten:
        return Forgotten()

    async def close(self) -> None:
        return None
