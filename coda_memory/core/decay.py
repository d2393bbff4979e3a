"""Decay strategies: how confidence fades with time and rises with reinforcement.

A fact's stored ``confidence`` is its value at ``confidence_at`` (or, when that is None,
``last_reinforced_at``). Decay is always computed from that anchor, never compounded
from a previous decayed value, so how often consolidation runs does not matter.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Protocol, runtime_checkable

from coda_memory.core.model import Fact

SECONDS_PER_DAY = 86_400.0


def elapsed_days(since: datetime, until: datetime) -> float:
    """Days between ``since`` and ``until``, as a distance: never negative.

    An anchor later than ``until`` (a clock that went back, or a future-dated fact
    stored before dates were bounded) decays by its distance too, so no date can pin
    a fact at its confidence; a skew of minutes costs a negligible amount.
    """
    return abs((until - since).total_seconds()) / SECONDS_PER_DAY


@runtime_checkable
class DecayStrategy(Protocol):
    """How a fact's confidence evolves."""

    @property
    def expiry_threshold(self) -> float:
        """A fact whose current confidence is below this is expired."""
        ...

    def decayed(self, fact: Fact, now: datetime) -> float:
        """The fact's confidence at ``now``, decayed from its anchor."""
        ...

    def reinforce(self, fact: Fact, quality: float, now: datetime) -> Fact:
        """The fact reinforced at ``now`` with ``quality`` in [0, 1]."""
        ...


def initial_ease(decay: DecayStrategy) -> float | None:
    """The ease factor a new fact starts with under ``decay`` (None if it has none).

    Strategies may define ``initial_ease()``; it is optional in the protocol.
    """
    method = getattr(decay, "initial_ease", None)
    if method is None:
        return None
    value = method()
    return None if value is None else float(value)


class ExponentialDecay:
    """``confidence * base ** days``; the default (half-life about 13.5 days)."""

    def __init__(
        self,
        base: float = 0.95,
        reinforce_amount: float = 0.1,
        expiry_threshold: float = 0.1,
    ) -> None:
        if not 0.0 < base < 1.0:
            raise ValueError("base must be in (0, 1)")
        if not 0.0 <= reinforce_amount <= 1.0:
            raise ValueError("reinforce_amount must be in [0, 1]")
        if not 0.0 <= expiry_threshold < 1.0:
            raise ValueError("expiry_threshold must be in [0, 1)")
        self.base = base
        self.reinforce_amount = reinforce_amount
        self._expiry_threshold = expiry_threshold

    @property
    def expiry_threshold(self) -> float:
        return self._expiry_threshold

    def initial_ease(self) -> float | None:
        return None

    def _days_scale(self, fact: Fact) -> float:
        return 1.0

    def decayed(self, fact: Fact, now: datetime) -> float:
        days = elapsed_days(fact.anchor, now) / self._days_scale(fact)
        return float(fact.confidence * self.base**days)

    def _next_ease(self, fact: Fact, quality: float) -> float | None:
        return fact.ease_factor

    def reinforce(self, fact: Fact, quality: float, now: datetime) -> Fact:
        confidence = min(1.0, self.decayed(fact, now) + self.reinforce_amount)
        return fact.model_copy(
            update={
                "confidence": confidence,
                "confidence_at": now,
                "reinforcement_count": fact.reinforcement_count + 1,
                "last_reinforced_at": now,
                "updated_at": now,
                "ease_factor": self._next_ease(fact, quality),
            }
        )

    def half_life_days(self, ease: float = 1.0) -> float:
        """Days for confidence to halve without reinforcement."""
        return ease * math.log(0.5) / math.log(self.base)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base={self.base}, reinforce_amount={self.reinforce_amount})"


class AdaptiveDecay(ExponentialDecay):
    """SM-2 inspired: ``confidence * base ** (days / ease)``, ease moved by quality.

    Quality is in [0, 1]: for a tool affinity it is the share of the tool's calls in the
    session that succeeded, for a tool avoidance the share that failed, otherwise 1.0.
    Each reinforcement sets ``ease = max(min_ease, ease + 0.1 - (1 - quality) * 0.3)``.
    """

    def __init__(
        self,
        base: float = 0.95,
        reinforce_amount: float = 0.1,
        expiry_threshold: float = 0.1,
        default_ease: float = 2.5,
        min_ease: float = 1.3,
    ) -> None:
        super().__init__(base, reinforce_amount, expiry_threshold)
        if min_ease <= 0 or default_ease < min_ease:
            raise ValueError("need 0 < min_ease <= default_ease")
        self.default_ease = default_ease
        self.min_ease = min_ease

    def initial_ease(self) -> float | None:
        return self.default_ease

    def _ease(self, fact: Fact) -> float:
        return fact.ease_factor if fact.ease_factor is not None else self.default_ease

    def _days_scale(self, fact: Fact) -> float:
        return self._ease(fact)

    def _next_ease(self, fact: Fact, quality: float) -> float | None:
        quality = min(1.0, max(0.0, quality))
        return max(self.min_ease, self._ease(fact) + 0.1 - (1.0 - quality) * 0.3)
