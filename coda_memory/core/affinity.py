"""Tool affinities from facts, and the ranking boost they give a tool catalogue.

The boost is a tiebreaker: a fully confident affinity adds ``AFFINITY_WEIGHT`` (2.0)
to a tool's relevance score, a fully confident avoidance subtracts it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from coda_memory.core.model import TOOL_NAME_PATTERN, Fact, FactCategory

AFFINITY_WEIGHT = 2.0

_SIGNS: Mapping[FactCategory, float] = {
    FactCategory.TOOL_AFFINITY: 1.0,
    FactCategory.TOOL_AVOIDANCE: -1.0,
}
_PREFIXES: Mapping[FactCategory, str] = {category: f"{category.value}:" for category in _SIGNS}
_tool_name = TOOL_NAME_PATTERN.fullmatch


def extract_tool_affinities(facts: Iterable[Fact]) -> dict[str, float]:
    """Net affinity per tool: + confidence per tool_affinity fact, - per tool_avoidance.

    The tool is the subject without its ``"<category>:"`` prefix; facts of other
    categories, facts whose subject lacks that prefix or whose tool is not a tool name
    (:data:`~coda_memory.core.model.TOOL_NAME_PATTERN`: the names a host may show or put in
    a prompt; a fact from outside, such as an imported Redis one, may hold any text) and
    facts with a non-finite confidence are ignored.
    """
    affinities: dict[str, float] = {}
    for fact in facts:
        sign = _SIGNS.get(fact.category)
        if sign is None:
            continue
        prefix = _PREFIXES[fact.category]
        if not fact.subject.startswith(prefix):
            continue
        tool = fact.subject.removeprefix(prefix)
        if not _tool_name(tool) or not math.isfinite(fact.confidence):
            continue
        affinities[tool] = affinities.get(tool, 0.0) + sign * fact.confidence
    return affinities


def boost_tool_scores(
    scores: Mapping[str, float],
    affinities: Mapping[str, float],
    weight: float = AFFINITY_WEIGHT,
) -> dict[str, float]:
    """``score + affinity * weight`` for each tool in ``scores``.

    Tools without an affinity keep their score; affinities of tools not in ``scores``
    are ignored.
    """
    return {
        tool: score + affinities[tool] * weight if tool in affinities else score
        for tool, score in scores.items()
    }


def rank_tools(
    scores: Mapping[str, float],
    affinities: Mapping[str, float],
    weight: float = AFFINITY_WEIGHT,
) -> list[tuple[str, float]]:
    """Tools with their boosted scores, best first (equal scores by tool name)."""
    boosted = boost_tool_scores(scores, affinities, weight)
    return sorted(boosted.items(), key=lambda item: (-item[1], item[0]))
