"""Every method on one timeline: the baselines, each strategy with the seed's constants,
and (when asked) each strategy tuned on the fitting period."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from coda_memory.replay.harness import ReplayResult, replay_baselines, replay_decay
from coda_memory.replay.timeline import Timeline
from coda_memory.replay.tuning import FAMILIES, Family, Tuned, describe, tune


@dataclass
class Comparison:
    baselines: list[ReplayResult]
    seeds: list[ReplayResult] = field(default_factory=list)
    tuned: list[Tuned] = field(default_factory=list)

    def results(self) -> list[ReplayResult]:
        """Baselines, then the seed constants, then every tuned strategy whose search
        moved away from the seed's constants."""
        tuned = [t.best for t in self.tuned if t.best_params]
        return [*self.baselines, *self.seeds, *tuned]

    def presets(self) -> list[tuple[str, str, bool]]:
        """(strategy, tuned constants, better on the held-out period than the seed's)."""
        presets = []
        for t in self.tuned:
            if t.best_params:
                better = t.best.test.ranking.ndcg_at_10 > t.seed.test.ranking.ndcg_at_10
                presets.append((t.family.name, describe(t.best_params), better))
        return presets


async def compare(
    timeline: Timeline,
    *,
    families: Sequence[Family] = FAMILIES,
    tuned: bool = False,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> Comparison:
    """Replay every method on ``timeline`` (``options`` go to ``replay_decay``)."""
    comparison = Comparison(replay_baselines(timeline))
    for family in families:
        if progress is not None:
            progress(f"replaying {family.name}" + (" and tuning it" if tuned else ""))
        if tuned:
            result = await tune(family, timeline, **options)
            comparison.tuned.append(result)
            comparison.seeds.append(result.seed)
        else:
            decay = family.build()
            comparison.seeds.append(
                await replay_decay(timeline, decay, name=family.name, **options)
            )
    return comparison
