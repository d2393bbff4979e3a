"""The rank of a fact: ``confidence * reinforcement_count``, highest first, then subject.

The prompt section lists facts in this order, and the cap on facts per identity keeps the
best ranked (:func:`~coda_memory.core.consolidation.plan_consolidation`)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from coda_memory.core.model import Fact


def rank_key(fact: Fact) -> tuple[float, str]:
    """The sort key of the rank (a score that is not finite ranks last)."""
    # score_key(fact.confidence, fact), inline: the prompt section sorts every fact.
    values = fact.__dict__
    score = values["confidence"] * values["reinforcement_count"]
    return (-score if math.isfinite(score) else math.inf, values["subject"])


def score_key(confidence: float, fact: Fact) -> tuple[float, str]:
    """:func:`rank_key` of ``fact`` seen with ``confidence`` (without building that view)."""
    score = confidence * fact.reinforcement_count
    return (-score if math.isfinite(score) else math.inf, fact.subject)


def ranked_facts(facts: Iterable[Fact]) -> list[Fact]:
    """``facts`` best ranked first."""
    return sorted(facts, key=rank_key)
