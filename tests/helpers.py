"""Test helpers: a controllable clock and observation builders."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Generator
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, TypeVar

import pytest

from coda_memory import NewObservation, ObservationType
from coda_memory.core import turns

T0 = datetime(2026, 1, 1, 9, 0, tzinfo=UTC)
R = TypeVar("R")


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, start: datetime = T0) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> datetime:
        self.now += timedelta(**delta)
        return self.now


def tool_ok(tool: str, session: str | None = "s1", at: datetime | None = None) -> NewObservation:
    return NewObservation(
        type=ObservationType.TOOL_SUCCESS,
        content=f"{tool} ok",
        metadata={"toolName": tool, "durationMs": 12.5},
        session_id=session,
        created_at=at,
    )


def tool_failed(
    tool: str, session: str | None = "s1", at: datetime | None = None
) -> NewObservation:
    return NewObservation(
        type=ObservationType.TOOL_FAILURE,
        content=f"{tool} failed",
        metadata={"toolName": tool, "durationMs": 40.0, "error": "boom"},
        session_id=session,
        created_at=at,
    )


def entity(
    entity_type: str,
    entity_id: str,
    name: str | None = None,
    session: str | None = "s1",
    at: datetime | None = None,
) -> NewObservation:
    meta: dict[str, Any] = {"entityType": entity_type, "entityId": entity_id}
    if name is not None:
        meta["entityName"] = name
    return NewObservation(
        type=ObservationType.ENTITY_ACCESS,
        content=f"accessed {entity_type}",
        metadata=meta,
        session_id=session,
        created_at=at,
    )


def domain(name: str, session: str | None = "s1", at: datetime | None = None) -> NewObservation:
    return NewObservation(
        type=ObservationType.QUERY_PATTERN,
        content=f"asked about {name}",
        metadata={"domain": name, "query": f"what about {name}?"},
        session_id=session,
        created_at=at,
    )


def held_collector_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The clock of the scopes that hold the garbage collector off, moved by hand:
    ``clock[0]`` (see :mod:`coda_memory.core.turns`)."""
    clock = [1000.0]
    monkeypatch.setattr(turns._HOLDS, "clock", lambda: clock[0])
    return clock


def held_collector_heap(
    monkeypatch: pytest.MonkeyPatch, noted: tuple[int, int] | None = None
) -> list[int]:
    """The heap the scopes measure, set by hand: ``heap[0]``, its blocks, and ``heap[1]``,
    the collector's objects (1,000 each to begin with); ``noted``: the two as the last
    full collection left them (None: not looked at yet)."""
    heap = [1000, 1000]
    monkeypatch.setattr(turns, "heap_size", lambda: heap[0])
    monkeypatch.setattr(turns, "tracked_objects", lambda: heap[1])
    monkeypatch.setattr(turns._HOLDS, "heap", None if noted is None else turns.Heap(*noted))
    return heap


def recorded_collections(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The generations of the collections the scopes run from now on (each still runs)."""
    collected: list[int] = []
    real_collect = gc.collect

    def collect(generation: int = 2) -> int:
        collected.append(generation)
        return real_collect(generation)

    monkeypatch.setattr(gc, "collect", collect)
    return collected


def run_counting(steps: Generator[None, None, R]) -> tuple[R, int]:
    """The result of ``steps`` (see :mod:`coda_memory.core.turns`) and how many times they
    yielded, that is, how many turns of the event loop a service would give between them."""
    yields = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: R = done.value
            return result, yields
        yields += 1


class LoopTurns:
    """The turns of the event loop while the block runs (``count``), as another task that
    yields at every turn sees them: what work that should give the loop turns gave."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)

    async def __aenter__(self) -> LoopTurns:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._task is not None
        self._task.cancel()
