"""Percentiles, latency summaries and slopes."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolated between the closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def latency_summary(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "mean_ms": statistics.fmean(ms),
        "max_ms": max(ms),
    }


def loglog_slopes(points: Sequence[tuple[float, float]]) -> list[float]:
    return [
        math.log(y2 / y1) / math.log(x2 / x1) for (x1, y1), (x2, y2) in itertools.pairwise(points)
    ]


def linear_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope
