"""A small coordinate search over each strategy's constants, fitted on the first period.

Start from the seed's constants; for each parameter in turn, replay every value of its
grid with the others held, and keep the value with the best NDCG@10 on the fitting
period (ties keep the current value). One pass over the parameters. The held-out period
is never looked at to choose; the replays score it all the same, so the chosen
constants' held-out figures come from the same runs.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from coda_memory.core.decay import AdaptiveDecay, DecayStrategy, ExponentialDecay, PowerLawDecay
from coda_memory.replay.harness import ReplayResult, replay_decay
from coda_memory.replay.timeline import Timeline


@dataclass(frozen=True)
class Family:
    """A decay strategy, its seed constants and the grid searched for each."""

    name: str
    build: Callable[..., DecayStrategy]
    grid: Mapping[str, tuple[float, ...]]


FAMILIES: tuple[Family, ...] = (
    Family(
        "exponential",
        ExponentialDecay,
        {"base": (0.8, 0.9, 0.95, 0.98, 0.995), "reinforce_amount": (0.05, 0.1, 0.2)},
    ),
    Family(
        "adaptive",
        AdaptiveDecay,
        {
            "base": (0.8, 0.9, 0.95, 0.98, 0.995),
            "default_ease": (1.3, 2.5, 5.0),
            "reinforce_amount": (0.05, 0.1, 0.2),
        },
    ),
    Family(
        "power-law",
        PowerLawDecay,
        {
            "initial_stability": (0.05, 0.25, 1.0, 4.0),
            "growth": (0.2, 0.5, 0.8),
            "power": (0.3, 0.5, 1.0),
        },
    ),
)


def describe(params: Mapping[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in params.items()) or "seed constants"


@dataclass
class Tuned:
    """A family's seed replay, its best replay on the fitting period, and every trial."""

    family: Family
    seed: ReplayResult
    best: ReplayResult
    best_params: dict[str, float]
    trials: int


def _objective(result: ReplayResult) -> float:
    value = result.fit.ranking.ndcg_at_10
    return -math.inf if math.isnan(value) else value


async def tune(
    family: Family,
    timeline: Timeline,
    *,
    grid: Mapping[str, tuple[float, ...]] | None = None,
    **options: Any,
) -> Tuned:
    """Coordinate search of ``family`` on ``timeline`` (``options`` go to the replay)."""
    cache: dict[tuple[tuple[str, float], ...], ReplayResult] = {}

    defaults = {p.name: p.default for p in inspect.signature(family.build).parameters.values()}

    async def run(params: dict[str, float]) -> ReplayResult:
        params = {k: v for k, v in params.items() if defaults.get(k) != v}
        key = tuple(sorted(params.items()))
        if key not in cache:
            label = f"{family.name} ({describe(params)})" if params else family.name
            cache[key] = await replay_decay(timeline, family.build(**params), name=label, **options)
        return cache[key]

    seed = await run({})
    best_params: dict[str, float] = {}
    best = seed
    for parameter, values in (grid if grid is not None else family.grid).items():
        for value in values:
            trial = {**best_params, parameter: value}
            result = await run(trial)
            if _objective(result) > _objective(best) + 1e-12:
                best = result
                best_params = {k: v for k, v in trial.items() if defaults.get(k) != v}
    return Tuned(family, seed, best, best_params, len(cache))
