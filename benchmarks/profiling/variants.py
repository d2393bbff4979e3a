"""Profiling: variants in alternating blocks, and the garbage collector."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from benchmarks.stats import latency_summary, percentile


async def interleaved(
    variants: dict[str, tuple[Callable[[str], Awaitable[Any]], Sequence[str]]],
    block: int = 10,
) -> dict[str, dict[str, float]]:
    """Latencies of each variant (operation, identities), run in alternating blocks so
    that all of them see the same background load on a shared machine."""
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    longest = max(len(identities) for _, identities in variants.values())
    for offset in range(0, longest, block):
        for name, (operation, identities) in variants.items():
            for identity in identities[offset : offset + block]:
                start = time.perf_counter()
                await operation(identity)
                seconds[name].append(time.perf_counter() - start)
    return {name: latency_summary(values) for name, values in seconds.items()}


async def collections(
    operation: Callable[[str], Awaitable[Any]], identities: Sequence[str], freeze: bool = False
) -> dict[str, Any]:
    """Latencies of ``operation`` with every garbage collection inside them timed (through
    ``gc.callbacks``): how often each generation is collected, what a full (generation 2)
    collection costs, and the p99 of the runs that had none. With ``freeze``,
    ``gc.freeze()`` first moves everything alive to a generation that is never scanned."""
    passes: list[tuple[int, float]] = []
    started: list[float] = [0.0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            passes.append((int(info["generation"]), time.perf_counter() - started[0]))

    if freeze:
        gc.collect()
        gc.freeze()
    gc.callbacks.append(timed)
    runs: list[tuple[float, bool]] = []
    try:
        for identity in identities:
            before = len(passes)
            start = time.perf_counter()
            await operation(identity)
            elapsed = time.perf_counter() - start
            runs.append((elapsed, any(g == 2 for g, _ in passes[before:])))
    finally:
        gc.callbacks.remove(timed)
        gc.unfreeze()
    full = [d * 1000 for g, d in passes if g == 2]
    quiet = [r for r, had_full in runs if not had_full]
    return {
        **latency_summary([r for r, _ in runs]),
        "tracked_objects": len(gc.get_objects()),
        "collections_per_run": {
            str(generation): sum(1 for g, _ in passes if g == generation) / len(runs)
            for generation in (0, 1, 2)
        },
        "gc_ms_per_run": sum(d for _, d in passes) * 1000 / len(runs),
        "full_collections": len(full),
        "full_collection_ms_mean": statistics.fmean(full) if full else 0.0,
        "full_collection_ms_max": max(full) if full else 0.0,
        "p99_ms_of_runs_without_full_collection": percentile([r * 1000 for r in quiet], 99),
    }
