"""The decay strategies, against the figures of the original design."""

from __future__ import annotations

import itertools
import math
from datetime import datetime, timedelta

import pytest

from coda_memory import (
    AdaptiveDecay,
    DecayStrategy,
    ExponentialDecay,
    Fact,
    FactCategory,
    PowerLawDecay,
)
from coda_memory.core.decay import ease_bounds, initial_ease, reinforcing
from coda_memory.core.model import MAX_REINFORCEMENT_COUNT, replaced
from tests.helpers import T0


def make_fact(confidence: float = 0.5, ease: float | None = None, count: int = 1) -> Fact:
    return Fact(
        id="fact:tool_affinity:x",
        identity_id="u",
        category=FactCategory.TOOL_AFFINITY,
        subject="tool_affinity:x",
        content="Uses x",
        confidence=confidence,
        reinforcement_count=count,
        last_reinforced_at=T0,
        created_at=T0,
        updated_at=T0,
        ease_factor=ease,
    )


def days_until_expiry(decay: ExponentialDecay, fact: Fact) -> int:
    """The first whole day at which the fact is below the expiry threshold."""
    day = 0
    while decay.decayed(fact, T0 + timedelta(days=day)) >= decay.expiry_threshold:
        day += 1
    return day


STRATEGIES: list[DecayStrategy] = [ExponentialDecay(), AdaptiveDecay(), PowerLawDecay()]
each_strategy = pytest.mark.parametrize("decay", STRATEGIES, ids=repr)


@each_strategy
def test_every_strategy_satisfies_the_protocol(decay: DecayStrategy) -> None:
    assert isinstance(decay, DecayStrategy)


@each_strategy
def test_every_strategy_decays_from_its_anchor_and_views_decay_on_identically(
    decay: DecayStrategy,
) -> None:
    fact = decay.reinforce(make_fact(0.6, ease=initial_ease(decay)), 1.0, T0)
    days = [0.0, 0.5, 3.0, 10.0, 40.0]
    values = [decay.decayed(fact, T0 + timedelta(days=d)) for d in days]
    assert values[0] == pytest.approx(fact.confidence)
    assert all(a > b for a, b in itertools.pairwise(values))
    # A view at any instant (what the service returns) decays on exactly as the fact.
    for d in days:
        at = T0 + timedelta(days=d)
        view = fact.model_copy(update={"confidence": decay.decayed(fact, at), "confidence_at": at})
        assert decay.decayed(view, at) == pytest.approx(decay.decayed(fact, at))
        for later in (d + 1.0, d + 25.0):
            instant = T0 + timedelta(days=later)
            assert decay.decayed(view, instant) == pytest.approx(decay.decayed(fact, instant))


@each_strategy
def test_every_strategy_holds_confidence_when_the_clock_goes_back(
    decay: DecayStrategy,
) -> None:
    # Time before the anchor decays nothing, and raises nothing: a clock set back by
    # weeks neither expires a fact (which its consolidation would delete) nor lifts it.
    fact = make_fact(0.6, ease=initial_ease(decay))
    for back in (timedelta(seconds=1), timedelta(days=3), timedelta(days=3650)):
        assert decay.decayed(fact, T0 - back) == pytest.approx(0.6, rel=1e-12)
    assert decay.decayed(fact, T0 + timedelta(days=3)) < 0.6


@each_strategy
def test_every_strategy_reinforces_by_0_1_from_the_decayed_value(decay: DecayStrategy) -> None:
    fact = make_fact(0.5, ease=initial_ease(decay), count=3)
    at = T0 + timedelta(days=2)
    reinforced = decay.reinforce(fact, 1.0, at)
    assert reinforced.confidence == pytest.approx(decay.decayed(fact, at) + 0.1)
    assert reinforced.reinforcement_count == 4
    assert reinforced.last_reinforced_at == reinforced.confidence_at == at
    assert decay.reinforce(make_fact(1.0), 1.0, T0).confidence == 1.0


@each_strategy
@pytest.mark.parametrize("quality", [0.0, 0.4, 1.0])
def test_reinforcing_from_the_decayed_confidence_is_reinforce_then_the_changes(
    decay: DecayStrategy, quality: float
) -> None:
    """What a consolidation does per reinforcement (the built-in strategies in one copy,
    from the confidence it decayed already) equals the strategy's own reinforce followed
    by a copy with the changes; the fact reinforced is left as it was."""
    fact = make_fact(0.5, ease=initial_ease(decay), count=3)
    before = fact.model_dump()
    at = T0 + timedelta(days=2)
    changes = {
        "content": "Uses x again",
        "updated_at": at + timedelta(hours=1),
        "confidence_at": at,
    }
    fast = reinforcing(decay)(fact, decay.decayed(fact, at), quality, at, dict(changes))
    assert fast.model_dump() == replaced(decay.reinforce(fact, quality, at), **changes).model_dump()
    assert fast.content == "Uses x again"
    assert fact.model_dump() == before


def test_reinforcing_calls_the_reinforce_of_any_other_strategy_a_subclass_too() -> None:
    class Generous(ExponentialDecay):
        def reinforce(self, fact: Fact, quality: float, now: datetime) -> Fact:
            return replaced(super().reinforce(fact, quality, now), confidence=1.0)

    decay = Generous()
    at = T0 + timedelta(days=2)
    changes = {"content": "Uses x again"}
    reinforced = reinforcing(decay)(
        make_fact(0.5), decay.decayed(make_fact(0.5), at), 1.0, at, changes
    )
    assert reinforced.confidence == 1.0
    assert reinforced.reinforcement_count == 2
    assert reinforced.content == "Uses x again"


@each_strategy
def test_every_strategy_keeps_the_count_at_its_largest(decay: DecayStrategy) -> None:
    """Stores keep the count as a 32-bit integer: one more would make every later write
    of the fact fail, and with it every consolidation of its identity."""
    fact = make_fact(0.5, ease=initial_ease(decay), count=MAX_REINFORCEMENT_COUNT)
    at = T0 + timedelta(days=1)
    reinforced = decay.reinforce(fact, 1.0, at)
    assert reinforced.reinforcement_count == MAX_REINFORCEMENT_COUNT
    assert reinforced.last_reinforced_at == at
    assert decay.reinforce(
        make_fact(count=MAX_REINFORCEMENT_COUNT - 1), 1.0, at
    ).reinforcement_count == (MAX_REINFORCEMENT_COUNT)


def test_half_life_is_about_13_5_days() -> None:
    decay = ExponentialDecay()
    assert decay.half_life_days() == pytest.approx(13.51, abs=0.01)
    fact = make_fact(1.0)
    assert decay.decayed(fact, T0 + timedelta(days=decay.half_life_days())) == pytest.approx(0.5)
    assert (
        decay.decayed(fact, T0 + timedelta(days=13))
        > 0.5
        > decay.decayed(fact, T0 + timedelta(days=14))
    )


def test_new_fact_expires_after_about_31_days_and_full_one_after_about_45() -> None:
    decay = ExponentialDecay()
    assert days_until_expiry(decay, make_fact(0.5)) == 32  # 0.5 * 0.95^31.4 = 0.1
    assert days_until_expiry(decay, make_fact(1.0)) == 45  # 0.95^44.9 = 0.1
    assert math.log(0.1 / 0.5) / math.log(0.95) == pytest.approx(31.38, abs=0.01)
    assert math.log(0.1) / math.log(0.95) == pytest.approx(44.89, abs=0.01)


def test_decay_is_computed_from_confidence_at_not_compounded() -> None:
    decay = ExponentialDecay()
    fact = make_fact(0.8)
    at_10 = decay.decayed(fact, T0 + timedelta(days=10))
    assert at_10 == pytest.approx(0.8 * 0.95**10)
    view = fact.model_copy(update={"confidence": at_10, "confidence_at": T0 + timedelta(days=10)})
    # A view at day 10 decays on from day 10, giving the same value at day 20.
    assert decay.decayed(view, T0 + timedelta(days=20)) == pytest.approx(0.8 * 0.95**20)
    # Applying decay to a view at its own instant changes nothing.
    assert decay.decayed(view, T0 + timedelta(days=10)) == pytest.approx(at_10)


@pytest.mark.parametrize("decay", [ExponentialDecay(), AdaptiveDecay()])
def test_days_count_from_the_anchor_as_the_analytics_views_count_them(
    decay: ExponentialDecay,
) -> None:
    # greatest(0, now - anchor) in the views (and in the cap's SQL): 0 before the
    # anchor, the days since it after.
    fact = make_fact(0.8)
    assert decay.decayed(fact, T0 - timedelta(days=3)) == 0.8
    ease = 1.0 if type(decay) is ExponentialDecay else 2.5
    after = decay.decayed(fact, T0 + timedelta(days=3))
    assert after == pytest.approx(0.8 * 0.95 ** (3 / ease))


def test_reinforcement_adds_0_1_to_the_decayed_value_and_caps_at_1() -> None:
    decay = ExponentialDecay()
    at = T0 + timedelta(days=2)
    reinforced = decay.reinforce(make_fact(0.5, count=3), 1.0, at)
    assert reinforced.confidence == pytest.approx(0.5 * 0.95**2 + 0.1)
    assert reinforced.reinforcement_count == 4
    assert reinforced.last_reinforced_at == at
    assert reinforced.ease_factor is None
    assert decay.reinforce(make_fact(0.95), 1.0, T0).confidence == 1.0
    assert decay.reinforce(make_fact(1.0), 1.0, T0).confidence == 1.0


@pytest.mark.parametrize(
    ("quality", "expected_ease"),
    [(1.0, 2.6), (0.67, 2.5), (0.0, 2.3)],
)
def test_adaptive_ease_adjustments(quality: float, expected_ease: float) -> None:
    reinforced = AdaptiveDecay().reinforce(make_fact(0.5, ease=2.5), quality, T0)
    assert reinforced.ease_factor == pytest.approx(expected_ease, abs=0.001)


def test_adaptive_ease_never_drops_below_1_3() -> None:
    decay = AdaptiveDecay()
    fact = make_fact(0.5, ease=1.4)
    for _ in range(5):
        fact = decay.reinforce(fact, 0.0, T0)
    assert fact.ease_factor == pytest.approx(1.3)


def test_adaptive_decay_stretches_time_by_ease() -> None:
    decay = AdaptiveDecay()
    fact = make_fact(1.0, ease=2.5)
    assert decay.decayed(fact, T0 + timedelta(days=25)) == pytest.approx(0.95 ** (25 / 2.5))
    assert decay.half_life_days(2.5) == pytest.approx(33.78, abs=0.01)
    assert decay.half_life_days(1.3) == pytest.approx(17.56, abs=0.01)
    # A fact without an ease factor decays as if it had the default ease.
    assert decay.decayed(make_fact(1.0), T0 + timedelta(days=5)) == pytest.approx(0.95**2)


@pytest.mark.parametrize(
    "kwargs", [{"base": 1.0}, {"base": 0.0}, {"reinforce_amount": -0.1}, {"expiry_threshold": 1}]
)
def test_bad_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ExponentialDecay(**kwargs)


def test_power_law_follows_the_fsrs_curve() -> None:
    decay = PowerLawDecay()
    fact = make_fact(1.0, ease=4.0)
    # R(t) = (1 + 19/81 · t/S) ** -0.5: 0.9 after S days, by FSRS's definition of stability.
    assert decay.decayed(fact, T0 + timedelta(days=4)) == pytest.approx(0.9)
    assert decay.decayed(fact, T0 + timedelta(days=30)) == pytest.approx(
        (1 + 19 / 81 * 30 / 4) ** -0.5
    )
    # A fact at 0.5 sits where R = 0.5 on the same curve (3·S/F days in) and goes on from there.
    half = make_fact(0.5, ease=4.0)
    offset = 3 * 4 / (19 / 81)
    assert decay.decayed(half, T0 + timedelta(days=10)) == pytest.approx(
        (1 + 19 / 81 * (offset + 10) / 4) ** -0.5
    )
    # Fast at first, slow later: a heavier tail than an exponential of the same half-life.
    days = decay.half_life_days(4.0)
    assert decay.decayed(fact, T0 + timedelta(days=days)) == pytest.approx(0.5)
    exponential = ExponentialDecay(base=0.5 ** (1 / days))
    later = T0 + timedelta(days=4 * days)
    assert decay.decayed(fact, later) > exponential.decayed(fact, later)
    # A fact without a stability has the initial one: a new fact (0.5) halves in 12.8 days.
    assert decay.half_life_days(confidence=0.5) == pytest.approx(12.79, abs=0.01)
    assert decay.decayed(make_fact(1.0), T0 + timedelta(days=0.25)) == pytest.approx(0.9)


@pytest.mark.parametrize(("quality", "expected_stability"), [(1.0, 3.0), (0.5, 2.0), (0.0, 1.0)])
def test_power_law_stability_grows_with_successful_reinforcement(
    quality: float, expected_stability: float
) -> None:
    reinforced = PowerLawDecay(growth=0.5).reinforce(make_fact(0.5, ease=2.0), quality, T0)
    assert reinforced.ease_factor == pytest.approx(expected_stability)


def test_power_law_stability_stays_within_its_bounds() -> None:
    decay = PowerLawDecay(initial_stability=1.0, min_stability=0.5, max_stability=10.0)
    fact = make_fact(0.5, ease=1.0)
    for _ in range(20):
        fact = decay.reinforce(fact, 1.0, T0)
    assert fact.ease_factor == pytest.approx(10.0)
    for _ in range(20):
        fact = decay.reinforce(fact, 0.0, T0)
    assert fact.ease_factor == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("decay", "quality", "furthest"),
    [
        (AdaptiveDecay(), 1.0, 2.5 + 0.1 * 4_999),  # no ceiling: past 365
        (AdaptiveDecay(), 0.0, 1.3),
        (PowerLawDecay(), 1.0, 365.0),
        (PowerLawDecay(), 0.0, 0.05),
    ],
    ids=["adaptive-good", "adaptive-bad", "power-law-good", "power-law-bad"],
)
def test_every_ease_a_strategy_makes_is_within_the_bounds_an_import_holds_to(
    decay: DecayStrategy, quality: float, furthest: float
) -> None:
    """5,000 reinforcements of one quality take a fact's ease to one end of what the
    strategy makes; the bounds an import refuses an ease outside hold it at every step."""
    fact = make_fact(0.5, ease=initial_ease(decay))
    eases = []
    for _ in range(5_000):
        low, high = ease_bounds(fact.reinforcement_count)
        assert fact.ease_factor is not None and low <= fact.ease_factor <= high, fact
        eases.append(fact.ease_factor)
        fact = decay.reinforce(fact, quality, T0)
    assert (max(eases) if quality else min(eases)) == pytest.approx(furthest)
    assert ease_bounds(1) == (0.05, 365.0)


@pytest.mark.parametrize("confidence", [0.3, 0.5, 1.0])
def test_power_law_expiry_instant_is_where_the_curve_crosses_the_threshold(
    confidence: float,
) -> None:
    decay = PowerLawDecay()
    fact = make_fact(confidence, ease=2.0)
    when = decay.expires_at(fact)
    assert decay.decayed(fact, when) == pytest.approx(decay.expiry_threshold)
    assert decay.decayed(fact, when - timedelta(hours=1)) > decay.expiry_threshold
    # The same instant from a view taken half-way.
    half = T0 + (when - T0) / 2
    view = fact.model_copy(update={"confidence": decay.decayed(fact, half), "confidence_at": half})
    assert abs((decay.expires_at(view) - when).total_seconds()) < 1e-3


@pytest.mark.parametrize(
    "kwargs",
    [{"power": 0.0}, {"growth": 1.0}, {"initial_stability": 0.01}, {"expiry_threshold": 1}],
)
def test_power_law_bad_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PowerLawDecay(**kwargs)
