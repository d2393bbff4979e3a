"""The host-shaped workload of issue 9: requests of an agent server, each emitting one
session's observations for a random identity and then loading its memory; and the
event-loop lag ticker that measures what the library leaves of the loop meanwhile."""

from __future__ import annotations

import asyncio
import gc
import itertools
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from benchmarks.server import quiesce
from benchmarks.stats import percentile
from benchmarks.workloads import Database, names, new_observations, seed_identities
from coda_memory import MemoryService
from coda_memory.service import ANSWER_BY

#: Observations each request emits: one session of an agent's tool calls.
OBSERVATIONS_PER_REQUEST = 10


async def seed_host(db: Database, prefix: str, identities: int, facts: int) -> list[str]:
    """``identities`` identities with ``facts`` facts each (COPY), vacuumed and analyzed."""
    chosen = names(prefix, identities)
    await seed_identities(
        db.conn, chosen, facts, datetime.now(UTC) - timedelta(hours=1), random.Random(91)
    )
    await quiesce(db.conn)
    return chosen


def timed_out(service: MemoryService, seconds: float) -> bool:
    """Whether a load of ``seconds`` outlived its consolidation's wait: it answered from
    the facts at hand (``load_stale``) or empty (``load_timeouts``). Both come at
    ``ANSWER_BY`` of the timeout; an answer of the load's own comes before."""
    return seconds >= service.load_timeout * ANSWER_BY


@dataclass
class Requests:
    """What a run of requests saw: load_memory latencies, empty loads, wall time."""

    seconds: list[float] = field(default_factory=list)
    empty: int = 0
    wall: float = 0.0

    @property
    def count(self) -> int:
        return len(self.seconds)

    @property
    def rate(self) -> float:
        return self.count / self.wall if self.wall else 0.0


class HostRequests:
    """Requests for random identities, numbered so each has a session of its own."""

    def __init__(self, identities: Sequence[str], facts: int, seed: int) -> None:
        self.identities = list(identities)
        self.facts = facts
        self.rng = random.Random(seed)
        self.numbers = itertools.count()
        #: How many facts the last load answered with.
        self.last_facts = 0

    async def one(self, service: MemoryService, identity: str | None = None) -> tuple[float, bool]:
        """Emit one session's observations, then load_memory: (seconds, came back empty)."""
        who = identity or self.rng.choice(self.identities)
        session = f"r{next(self.numbers)}-"
        for observation in new_observations(
            who,
            self.facts,
            OBSERVATIONS_PER_REQUEST,
            1,
            datetime.now(UTC),
            self.rng,
            session_prefix=session,
        ):
            service.emit_observation(who, observation)
        start = time.perf_counter()
        loaded = await service.load_memory(who)
        self.last_facts = len(loaded.facts)
        return time.perf_counter() - start, not loaded.facts

    async def run(self, service: MemoryService, requests: int, concurrency: int) -> Requests:
        """``requests`` requests, ``concurrency`` of them in flight at any time."""
        seen = Requests()
        left = iter(range(requests))

        async def client() -> None:
            for _ in left:
                seconds, empty = await self.one(service)
                seen.seconds.append(seconds)
                seen.empty += empty

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        seen.wall = time.perf_counter() - start
        return seen


class LagTicker:
    """A task that sleeps ``interval`` seconds in a loop and records how late it wakes:
    the time the event loop was busy with something else."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval)
            self.lags.append(time.perf_counter() - start - self.interval)

    def start(self) -> None:
        self.lags.clear()
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def summary(self) -> dict[str, Any]:
        ms = [max(0.0, lag) * 1000 for lag in self.lags]
        return {
            "ticks": len(ms),
            "p50_ms": percentile(ms, 50),
            "p99_ms": percentile(ms, 99),
            "max_ms": max(ms, default=0.0),
            "over_5_ms": sum(1 for lag in ms if lag > 5),
            "over_20_ms": sum(1 for lag in ms if lag > 20),
        }


@dataclass
class CollectorPauses:
    """The cyclic garbage collector's runs while a :func:`collector_pauses` block ran:
    (generation, milliseconds) each. A collection stalls the event loop for as long."""

    runs: list[tuple[int, float]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        full = [ms for generation, ms in self.runs if generation == 2]
        return {
            "gc_runs": len(self.runs),
            "gc_full_runs": len(full),
            "gc_max_pause_ms": max((ms for _, ms in self.runs), default=0.0),
            "gc_max_full_pause_ms": max(full, default=0.0),
        }


@contextmanager
def collector_pauses() -> Iterator[CollectorPauses]:
    """Record every collection of the garbage collector in the block (``gc.callbacks``)."""
    pauses = CollectorPauses()
    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.runs.append((info["generation"], (time.perf_counter() - started.pop()) * 1000))

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)
