"""The writer's queue keeps an observation's fields, not its model, so that what waits in
the queue is out of the cyclic garbage collector's sight (coda_memory.writer._queued)."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

from coda_memory import MemoryService
from coda_memory.core.model import NewObservation, ObservationType
from coda_memory.testing import InMemoryStore
from tests.helpers import entity, tool_ok


def test_queued_observations_leave_nothing_for_the_collector() -> None:
    """2,000 observations wait (no writer runs): after a collection, the queue adds a
    handful of tracked objects, not thousands (a model, its dicts and a tuple each)."""
    service = MemoryService(InMemoryStore(), queue_size=10_000)
    gc.collect()
    before = len(gc.get_objects())
    for n in range(2_000):
        service.emit_observation("alice", tool_ok(f"tool_{n % 7}"))
        service.emit_observation("alice", entity("account", f"account-{n}"))
    gc.collect()
    assert service.stats().pending == 4_000
    assert len(gc.get_objects()) - before < 100


async def test_what_is_not_a_plain_new_observation_is_validated_as_it_is() -> None:
    """A subclass of NewObservation and an object that only looks like one are queued as
    they are and stored like the plain models; anything else is rejected with a reason."""

    class Tagged(NewObservation):
        pass

    @dataclass
    class LooksLikeOne:
        type: str = ObservationType.TOOL_SUCCESS.value
        content: str = "duck ok"
        metadata: dict[str, Any] = field(default_factory=lambda: {"toolName": "duck"})
        session_id: str | None = "s1"
        created_at: None = None

    service = MemoryService(InMemoryStore())
    service.emit_observation("alice", tool_ok("plain"))
    service.emit_observation("alice", Tagged(**tool_ok("tagged").model_dump()))
    service.emit_observation("alice", LooksLikeOne())  # type: ignore[arg-type]
    service.emit_observation("alice", object())  # type: ignore[arg-type]
    await service.drain()
    stats = service.stats()
    assert (stats.stored, stats.rejected) == (3, 1)
    subjects = {fact.subject for fact in await service.consolidate("alice")}
    assert {"tool_affinity:plain", "tool_affinity:tagged", "tool_affinity:duck"} <= subjects
    await service.close()
