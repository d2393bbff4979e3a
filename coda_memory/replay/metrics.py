"""Scores of a ranking against what was used, and of confidences as probabilities."""

from __future__ import annotations

import math
from collections.abc import Sequence, Set
from dataclasses import dataclass, field

#: Probabilities are clipped to [EPSILON, 1 - EPSILON] for the log-loss.
EPSILON = 1e-6


def hit_at(ranked: Sequence[str], used: Set[str], k: int = 5) -> float:
    """1 when one of the first ``k`` ranked subjects was used, else 0."""
    return 1.0 if any(subject in used for subject in ranked[:k]) else 0.0


def ndcg_at(ranked: Sequence[str], used: Set[str], k: int = 10) -> float:
    """Normalised discounted cumulative gain of the first ``k``, binary relevance."""
    if not used:
        return 0.0
    dcg = sum(1.0 / math.log2(i + 2) for i, s in enumerate(ranked[:k]) if s in used)
    ideal = sum(1.0 / math.log2(i + 2) for i in range(min(len(used), k)))
    return dcg / ideal


@dataclass
class RankingScore:
    """Mean hit@k and NDCG@k over scored sessions."""

    sessions: int = 0
    hits: float = 0.0
    ndcg: float = 0.0

    def add(self, ranked: Sequence[str], used: Set[str]) -> None:
        self.sessions += 1
        self.hits += hit_at(ranked, used)
        self.ndcg += ndcg_at(ranked, used)

    @property
    def hit_at_5(self) -> float:
        return self.hits / self.sessions if self.sessions else math.nan

    @property
    def ndcg_at_10(self) -> float:
        return self.ndcg / self.sessions if self.sessions else math.nan


@dataclass
class Calibration:
    """Confidence taken as the probability that the subject is used within the horizon.

    Keeps the Brier score, the log-loss and ten reliability bins (mean predicted
    probability against the observed frequency)."""

    bins: int = 10
    count: int = 0
    brier_sum: float = 0.0
    log_loss_sum: float = 0.0
    positives: int = 0
    bin_count: list[int] = field(default_factory=list)
    bin_predicted: list[float] = field(default_factory=list)
    bin_observed: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bin_count = [0] * self.bins
        self.bin_predicted = [0.0] * self.bins
        self.bin_observed = [0.0] * self.bins

    def add(self, probability: float, outcome: bool) -> None:
        y = 1.0 if outcome else 0.0
        p = min(1.0 - EPSILON, max(EPSILON, probability))
        self.count += 1
        self.positives += int(outcome)
        self.brier_sum += (probability - y) ** 2
        self.log_loss_sum -= y * math.log(p) + (1.0 - y) * math.log(1.0 - p)
        index = min(self.bins - 1, int(probability * self.bins))
        self.bin_count[index] += 1
        self.bin_predicted[index] += probability
        self.bin_observed[index] += y

    @property
    def brier(self) -> float:
        return self.brier_sum / self.count if self.count else math.nan

    @property
    def log_loss(self) -> float:
        return self.log_loss_sum / self.count if self.count else math.nan

    @property
    def base_rate(self) -> float:
        return self.positives / self.count if self.count else math.nan

    def brier_of_constant(self, rate: float) -> float:
        """The Brier score a constant prediction of ``rate`` would get on the same pairs."""
        if not self.count:
            return math.nan
        positives = self.positives
        return (positives * (1 - rate) ** 2 + (self.count - positives) * rate**2) / self.count

    def reliability(self) -> list[tuple[float, float, int]]:
        """(mean predicted, observed frequency, pairs) of each non-empty bin."""
        return [
            (self.bin_predicted[i] / n, self.bin_observed[i] / n, n)
            for i, n in enumerate(self.bin_count)
            if n
        ]
