"""Tool affinities from facts, and the ranking boost they give a tool catalogue.

The boost is a tiebreaker: a fully confident affinity adds ``AFFINITY_WEIGHT`` (2.0)
to a tool's relevance score, a fully confident avoidance subtracts it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping

from coda_memory.core.model import TOOL_NAME_PATTERN, Fact, FactCategory

AFFINITY_WEIGHT = 2.0

_SIGNS: Mapping[FactCategory, float] = {
    FactCategory.TOOL_AFFINITY: 1.0,
    FactCategory.TOOL_AVOIDANCE: -1.0,
}
_PREFIXES: Mapping[FactCategory, str] = {category: f"{category.value}:" for category in _SIGNS}
_tool_name = TOOL_NAME_PATTERN.fullmatch


def fact_tool(fact: Fact) -> str | None:
    """The tool a ``tool_affinity`` or ``tool_avoidance`` fact is about; None for facts of
    other categories (and for a subject without its category's prefix)."""
    prefix = _PREFIXES.get(fact.category)
    if prefix is None or not fact.subject.startswith(prefix):
        return None
    return fact.subject.removeprefix(prefix)


def outside_catalog(fact: Fact, catalog: Collection[str]) -> bool:
    """True for a tool fact whose tool ``catalog`` (the host's tools) does not hold: a
    tool the host has dropped since the fact was learnt."""
    return fact.category in _SIGNS and fact_tool(fact) not in catalog


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
        tool = fact_tool(fact)
        if tool is None or not _tool_name(tool) or not math.isfinite(fact.confidence):
            continue
        affinities[tool] = affinities.get(tool, 0.0) + _SIGNS[fact.category] * fact.confidence
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
    """Tools with their boosted scores, best first (equal scores by tool name); a score
    that is NaN (a host's relevance of 0/0) ranks last."""
    boosted = boost_tool_scores(scores, affinities, weight)
    return sorted(boosted.items(), key=_tool_rank)


def _tool_rank(item: tuple[str, float]) -> tuple[bool, float, str]:
    # A NaN compares neither above nor below anything: as a key it left the order of the
    # other tools to the sort's luck (one tool of 1.0 first, before one of 3.0).
    tool, score = item
    unordered = math.isnan(score)
    return (unordered, 0.0 if unordered else -score, tool)
