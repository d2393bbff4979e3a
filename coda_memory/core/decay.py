"""Decay strategies: how confidence fades with time and rises with reinforcement.

A fact's stored ``confidence`` is its value at ``confidence_at`` (or, when that is None,
``last_reinforced_at``). Decay is always computed from that anchor, never compounded
from a previous decayed value, so how often consolidation runs does not matter. Time
before the anchor decays nothing (:func:`elapsed_days`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol, runtime_checkable

from coda_memory.core.model import (
    MAX_REINFORCEMENT_COUNT,
    Fact,
    replaced,
    trusted_fact,
    trusted_from,
)

SECONDS_PER_DAY = 86_400.0
#: The most a reinforcement raises an ease under :class:`AdaptiveDecay` (quality 1).
EASE_STEP = 0.1
#: :class:`PowerLawDecay`'s default bounds of a stability (days, kept as the ease).
MIN_STABILITY = 0.05
MAX_STABILITY = 365.0


def ease_bounds(reinforcement_count: int) -> tuple[float, float]:
    """The lowest and highest ease factor the library's strategies, with their default
    bounds, give a fact reinforced ``reinforcement_count`` times: from
    :class:`PowerLawDecay`'s lowest stability (:class:`AdaptiveDecay`'s eases stay at
    1.3 or more) to its highest, plus :data:`EASE_STEP` for each reinforcement after the
    first, since :class:`AdaptiveDecay`'s eases have no ceiling. An import refuses an
    ease outside them: one far above never decays."""
    return MIN_STABILITY, MAX_STABILITY + EASE_STEP * (reinforcement_count - 1)


def days_after(at: datetime, days: float) -> datetime:
    """``at`` moved by ``days``, within datetime's range: a fact anchored near year 9999
    (an import may bring one) is moved to its end instead of failing every consolidation
    of its identity with OverflowError."""
    try:
        return at + timedelta(days=days)
    except OverflowError:
        edge = datetime.max if days > 0 else datetime.min
        return edge.replace(tzinfo=at.tzinfo)


def elapsed_days(since: datetime, until: datetime) -> float:
    """Days from ``since`` to ``until``, 0 when ``until`` is earlier, as the analytics
    views count them.

    An anchor later than ``until`` (a clock behind the one that reinforced the fact)
    decays nothing until that clock reaches it: a clock set back never expires, and so
    never deletes, a fact, and no confidence ever rises from it. No date the library
    writes is later than the writing clock's now (observations ahead of it by more than
    ``max_clock_skew`` are dated at now, and so are the dates ``import-redis`` copies),
    so a fact is held so by a clock ahead of the others, at most by as much, or by a
    date something else wrote (the original server's records, which the Redis store
    reads as they are), and only until a reinforcement anchors it again.
    """
    return max(0.0, (until - since).total_seconds()) / SECONDS_PER_DAY


def _check_amounts(reinforce_amount: float, expiry_threshold: float) -> None:
    """Refuse a reinforcement outside [0, 1] or an expiry threshold outside [0, 1)."""
    if not 0.0 <= reinforce_amount <= 1.0:
        raise ValueError("reinforce_amount must be in [0, 1]")
    if not 0.0 <= expiry_threshold < 1.0:
        raise ValueError("expiry_threshold must be in [0, 1)")


#: Other fields a reinforcement sets, in the same copy of the fact (see :func:`reinforcing`).
Changes = dict[str, Any] | None


def _reinforced(
    fact: Fact, confidence: float, now: datetime, ease: float | None, changes: Changes = None
) -> Fact:
    """``fact`` reinforced at ``now``: its new confidence, count (up to
    MAX_REINFORCEMENT_COUNT) and ease, and then ``changes`` (one copy)."""
    values = fact.__dict__.copy()
    values["confidence"] = confidence
    values["confidence_at"] = now
    values["reinforcement_count"] = min(fact.reinforcement_count + 1, MAX_REINFORCEMENT_COUNT)
    values["last_reinforced_at"] = now
    values["updated_at"] = now
    values["ease_factor"] = ease
    if changes:
        values.update(changes)
    return trusted_fact(values) if type(fact) is Fact else trusted_from(type(fact), values)


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
        _check_amounts(reinforce_amount, expiry_threshold)
        self.base = base
        self.reinforce_amount = reinforce_amount
        self._expiry_threshold = expiry_threshold

    @property
    def expiry_threshold(self) -> float:
        return self._expiry_threshold

    def initial_ease(self) -> float | None:
        return None

    def decayed(self, fact: Fact, now: datetime) -> float:
        # Read from the fact's dict: a load decays every fact, so attribute and property
        # lookups show up in its cost (same value as elapsed_days(fact.anchor, now)).
        values = fact.__dict__
        anchor = values["confidence_at"]
        if anchor is None:
            anchor = values["last_reinforced_at"]
        days = max(0.0, (now - anchor).total_seconds()) / SECONDS_PER_DAY
        return float(values["confidence"] * self.base**days)

    def _next_ease(self, fact: Fact, quality: float) -> float | None:
        return fact.ease_factor

    def reinforce(self, fact: Fact, quality: float, now: datetime) -> Fact:
        return self._reinforce_at(fact, self.decayed(fact, now), quality, now, None)

    def _reinforce_at(
        self, fact: Fact, current: float, quality: float, now: datetime, changes: Changes
    ) -> Fact:
        """:meth:`reinforce` of a fact whose ``decayed`` at ``now`` is ``current``, with
        ``changes`` made in the same copy (see :func:`reinforcing`)."""
        confidence = min(1.0, current + self.reinforce_amount)
        return _reinforced(fact, confidence, now, self._next_ease(fact, quality), changes)

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

    def decayed(self, fact: Fact, now: datetime) -> float:
        # ExponentialDecay.decayed with the days divided by the ease (read in place too).
        values = fact.__dict__
        anchor = values["confidence_at"]
        if anchor is None:
            anchor = values["last_reinforced_at"]
        ease = values["ease_factor"]
        if ease is None:
            ease = self.default_ease
        days = max(0.0, (now - anchor).total_seconds()) / SECONDS_PER_DAY / ease
        return float(values["confidence"] * self.base**days)

    def _next_ease(self, fact: Fact, quality: float) -> float | None:
        quality = min(1.0, max(0.0, quality))
        return max(self.min_ease, self._ease(fact) + EASE_STEP - (1.0 - quality) * 0.3)


FSRS_FACTOR = 19.0 / 81.0
"""FSRS-4.5's ``F``: with ``d = 0.5``, retrievability is 0.9 when ``t = S``."""


@dataclass(frozen=True, slots=True)
class DecayFormula:
    """The ``decayed`` of :class:`ExponentialDecay` and :class:`AdaptiveDecay` as data, so
    that a store can compute it where the facts are (the cap on facts per identity, see
    :class:`~coda_memory.core.caps.FactCap`): ``confidence * base ** (days / ease)``, days
    those from the fact's anchor (0 before it, see :func:`elapsed_days`)."""

    base: float
    expiry_threshold: float
    #: The ease of a fact that has none; None: the formula has no ease (it is 1).
    default_ease: float | None

    @property
    def max_exponent(self) -> float:
        """The exponent past which ``base ** exponent`` is below 1e-300, far below any
        expiry threshold: a store caps the exponent there, since a power that leaves the
        floats is an error in SQL (Postgres: "underflow") where Python's is 0.0."""
        return math.log(1e-300) / math.log(self.base)


def decay_formula(decay: DecayStrategy) -> DecayFormula | None:
    """``decay``'s formula as data; None for any other strategy (a subclass too, which
    may decay otherwise)."""
    if type(decay) is AdaptiveDecay:
        return DecayFormula(decay.base, decay.expiry_threshold, decay.default_ease)
    if type(decay) is ExponentialDecay:
        return DecayFormula(decay.base, decay.expiry_threshold, None)
    return None


class PowerLawDecay:
    """FSRS-style power-law forgetting: retrievability ``R(t) = (1 + F·t/S) ** -d``.

    ``S`` is the fact's stability in days (kept in ``ease_factor``): by FSRS's definition
    ``R(S) = 0.9`` with the default ``F = 19/81``, ``d = 0.5``. A power law forgets fast at
    first and slowly afterwards, as spaced-repetition data shows people do.

    The confidence is the retrievability: a fact of confidence ``c`` sits on its curve
    ``(c ** (-1/d) - 1)·S/F`` days after the curve's start, so ``t`` days after its anchor
    its confidence is ``(c ** (-1/d) + F·t/S) ** -d``. That depends only on the stored
    confidence, its anchor and ``S``, so a view taken at any instant decays on exactly as
    the fact would, and how often consolidation runs does not matter.

    Each reinforcement sets ``confidence = min(1, current + reinforce_amount)`` as the
    other strategies do, and ``S = clamp(S · (1 + growth · (2·quality - 1)))`` between
    ``min_stability`` and ``max_stability``: a successful session (quality 1) multiplies
    stability by ``1 + growth``, quality 0.5 leaves it, quality 0 shrinks it.

    Parameters: ``factor`` (F, 19/81), ``power`` (d, 0.5), ``initial_stability`` (S of a
    new fact, 0.25 day: a new fact at 0.5 halves in 12.8 days, as the seed's exponential
    does in 13.5), ``growth`` (0.5), ``min_stability`` (0.05 day), ``max_stability``
    (365 days), ``reinforce_amount`` (0.1) and ``expiry_threshold`` (0.1).
    """

    def __init__(
        self,
        factor: float = FSRS_FACTOR,
        power: float = 0.5,
        initial_stability: float = 0.25,
        growth: float = 0.5,
        min_stability: float = MIN_STABILITY,
        max_stability: float = MAX_STABILITY,
        reinforce_amount: float = 0.1,
        expiry_threshold: float = 0.1,
    ) -> None:
        if factor <= 0 or power <= 0:
            raise ValueError("factor and power must be positive")
        if not 0 < min_stability <= initial_stability <= max_stability:
            raise ValueError("need 0 < min_stability <= initial_stability <= max_stability")
        if not 0.0 <= growth < 1.0:
            raise ValueError("growth must be in [0, 1)")
        _check_amounts(reinforce_amount, expiry_threshold)
        self.factor = factor
        self.power = power
        self.initial_stability = initial_stability
        self.growth = growth
        self.min_stability = min_stability
        self.max_stability = max_stability
        self.reinforce_amount = reinforce_amount
        self._expiry_threshold = expiry_threshold

    @property
    def expiry_threshold(self) -> float:
        return self._expiry_threshold

    def initial_ease(self) -> float | None:
        return self.initial_stability

    def stability(self, fact: Fact) -> float:
        """The fact's stability in days (a fact without one has the initial stability)."""
        if fact.ease_factor is None or fact.ease_factor <= 0:
            return self.initial_stability
        return fact.ease_factor

    def _position(self, confidence: float) -> float:
        """``c ** (-1/d)``: where on the curve (in units of F·t/S, plus 1) ``c`` lies;
        infinite for a confidence so small that the power leaves the floats (its decayed
        value is 0.0)."""
        try:
            return float(max(confidence, 1e-300) ** (-1.0 / self.power))
        except OverflowError:
            return math.inf

    def decayed(self, fact: Fact, now: datetime) -> float:
        if fact.confidence <= 0.0:
            return 0.0
        step = self.factor * elapsed_days(fact.anchor, now) / self.stability(fact)
        return float((self._position(fact.confidence) + step) ** -self.power)

    def reinforce(self, fact: Fact, quality: float, now: datetime) -> Fact:
        return self._reinforce_at(fact, self.decayed(fact, now), quality, now, None)

    def _reinforce_at(
        self, fact: Fact, current: float, quality: float, now: datetime, changes: Changes
    ) -> Fact:
        """As :meth:`ExponentialDecay._reinforce_at`."""
        quality = min(1.0, max(0.0, quality))
        confidence = min(1.0, current + self.reinforce_amount)
        stability = self.stability(fact) * (1.0 + self.growth * (2.0 * quality - 1.0))
        ease = min(self.max_stability, max(self.min_stability, stability))
        return _reinforced(fact, confidence, now, ease, changes)

    def expires_at(self, fact: Fact) -> datetime:
        """When the fact's confidence falls below the threshold, never reinforced again."""
        threshold = self._expiry_threshold
        if fact.confidence < threshold:
            return fact.anchor
        if threshold <= 0.0:
            return datetime.max.replace(tzinfo=fact.anchor.tzinfo)
        gap = self._position(threshold) - self._position(fact.confidence)
        return days_after(fact.anchor, gap * self.stability(fact) / self.factor)

    def half_life_days(self, stability: float | None = None, confidence: float = 1.0) -> float:
        """Days for a confidence of ``confidence`` to halve without reinforcement."""
        s = self.initial_stability if stability is None else stability
        gap = self._position(confidence / 2.0) - self._position(confidence)
        return gap * s / self.factor

    def __repr__(self) -> str:
        return (
            f"PowerLawDecay(power={self.power}, initial_stability={self.initial_stability}, "
            f"growth={self.growth}, reinforce_amount={self.reinforce_amount})"
        )


#: ``reinforce(fact, current, quality, now, changes)``: see :func:`reinforcing`.
Reinforcing = Callable[[Fact, float, float, datetime, dict[str, Any]], Fact]


def reinforcing(decay: DecayStrategy) -> Reinforcing:
    """How a consolidation reinforces a fact under ``decay``, given its confidence at
    ``now`` (``current``: what ``decay.decayed(fact, now)`` returns, which the caller
    computed already) and the other fields it sets (``changes``): the built-in
    strategies reinforce from ``current`` in one copy of the fact, where
    ``replaced(decay.reinforce(fact, quality, now), **changes)`` would decay it again and
    copy it twice (a backlog of 600 observations makes about 600 reinforcements). Any
    other strategy, a subclass too (it may reinforce otherwise), is called as that."""
    if type(decay) in (ExponentialDecay, AdaptiveDecay, PowerLawDecay) and isinstance(
        decay, ExponentialDecay | PowerLawDecay
    ):
        return decay._reinforce_at

    def general(
        fact: Fact, current: float, quality: float, now: datetime, changes: dict[str, Any]
    ) -> Fact:
        return replaced(decay.reinforce(fact, quality, now), **changes)

    return general
