"""What emitting costs the caller, and how much memory a queue full of observations holds."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime
from typing import Any, cast

import psutil

from benchmarks.report import Figure, Report
from benchmarks.server import ROOT
from benchmarks.sizes import Sizes
from benchmarks.workloads import BATCH_SIZE, DEFAULT_QUEUE_SIZE
from coda_memory import MemoryService, NewObservation, ObservationType
from coda_memory.ports import AppendOutcome, ConsolidationUnit, MemoryStore, ObservationRecord


class StalledStore:
    """A store whose ``append`` never completes: the writer stalls on its first batch.
    The service only ever calls ``append`` and ``close`` on it."""

    async def append(
        self,
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def consolidation(self, identity_id: str) -> AbstractAsyncContextManager[ConsolidationUnit]:
        raise NotImplementedError

    async def facts(self, identity_id: str) -> list[Any]:
        raise NotImplementedError

    async def history(self, identity_id: str, subject: str | None = None) -> list[Any]:
        raise NotImplementedError

    async def forget(self, identity_id: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        return None


def stalled_store() -> MemoryStore:
    return cast(MemoryStore, StalledStore())


def _sample_observation() -> NewObservation:
    return NewObservation(
        type=ObservationType.TOOL_SUCCESS,
        content="get_account ok",
        metadata={"toolName": "get_account", "durationMs": 84.0},
        session_id="s-1",
    )


def _time_calls(call: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


async def emit_cost(sizes: Sizes, report: Report) -> None:
    """The caller's cost of one ``emit_observation``: microseconds per call, best of 3."""
    observation = _sample_observation()
    calls = sizes.emit_calls
    quiet = logging.getLogger("coda_memory")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        baseline_runs: list[float] = []
        for _ in range(3):
            queue: deque[tuple[str, NewObservation, datetime]] = deque()
            append = queue.append

            def bare(append: Any = append) -> None:
                append(("user-1", observation, datetime.now(UTC)))

            baseline_runs.append(_time_calls(bare, calls))
        in_loop: list[float] = []
        no_loop: list[float] = []
        for _ in range(3):
            service = MemoryService(stalled_store(), queue_size=calls + 10)
            service.emit_observation("user-1", observation)
            await asyncio.sleep(0)  # the writer starts and stalls on its first batch
            in_loop.append(
                _time_calls(
                    functools.partial(service.emit_observation, "user-1", observation), calls
                )
            )
            await service.close(timeout=0.01)
            outside = MemoryService(stalled_store(), queue_size=calls + 10)
            no_loop.append(
                await asyncio.to_thread(
                    _time_calls,
                    functools.partial(outside.emit_observation, "user-1", observation),
                    calls,
                )
            )
    finally:
        quiet.setLevel(level)
    base = min(baseline_runs)
    for name, runs in (
        ("in the event loop (writer stalled)", in_loop),
        ("on a thread with no event loop (writer not started)", no_loop),
    ):
        value = min(runs)
        report.add(
            Figure(
                "4 ingest",
                f"emit_observation cost, {name}",
                value,
                "us",
                base,
                "deque.append of (id, obs, now)",
                value / base,
                "<= 5 us",
                value <= 5.0,
                {"calls": calls, "runs_us": runs, "baseline_runs_us": baseline_runs},
            )
        )


async def memory_bound(sizes: Sizes, report: Report) -> None:
    """RSS while ``memory_emits`` observations are emitted with the database down, in a
    fresh process so nothing else this run allocated counts."""
    command = [sys.executable, "-m", "benchmarks", "--memory-child", str(sizes.memory_emits)]
    done = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, check=True, cwd=ROOT
    )
    child = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 1024 * 1024
    growth_after_full = (child["rss_end"] - child["rss_at_full"]) / mib
    peak = child["rss_peak"] / mib
    before = child["rss_before"] / mib
    report.add(
        Figure(
            "4 ingest",
            f"peak RSS, {sizes.memory_emits:,} emits with the database down",
            peak,
            "MiB",
            before,
            "RSS before emitting",
            peak / before,
            "bounded: < 16 MiB growth once the queue is full",
            growth_after_full < 16 and child["pending"] <= child["queue_size"] + BATCH_SIZE,
            {
                **child,
                "growth_after_queue_full_mib": growth_after_full,
                "bytes_per_queued_observation": (child["rss_at_full"] - child["rss_before"])
                / child["queue_size"],
            },
        )
    )


async def memory_child(emits: int) -> dict[str, Any]:
    logging.getLogger("coda_memory").setLevel(logging.CRITICAL)
    with socket.socket() as probe:  # a port nobody listens on: connections are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    service = MemoryService.from_url(f"postgresql://bench@127.0.0.1:{port}/none")
    process = psutil.Process()
    peak = [process.memory_info().rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            stop.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    rss_before = process.memory_info().rss
    sampler.start()
    rss_at_full = 0
    start = time.perf_counter()
    for n in range(emits):
        service.emit_observation(
            f"user-{n % 1_000}",
            NewObservation(
                type=ObservationType.ENTITY_ACCESS,
                content=f"accessed account {n}",
                metadata={"entityType": "account", "entityId": f"acct-{n}"},
                session_id=f"s-{n // 10}",
            ),
        )
        if n % 1_000 == 0:
            await asyncio.sleep(0)  # the writer tries, fails and backs off
        if n == 2 * DEFAULT_QUEUE_SIZE:  # the queue has been full for a while
            rss_at_full = process.memory_info().rss
    elapsed = time.perf_counter() - start
    rss_end = process.memory_info().rss
    stop.set()
    sampler.join()
    stats = service.stats()
    result = {
        "emits": emits,
        "seconds": elapsed,
        "queue_size": DEFAULT_QUEUE_SIZE,
        "rss_before": rss_before,
        "rss_at_full": rss_at_full or rss_end,
        "rss_end": rss_end,
        "rss_peak": max(peak[0], rss_end),
        "dropped": stats.dropped,
        "pending": stats.pending,
    }
    await service.close(timeout=0.01)
    return result
