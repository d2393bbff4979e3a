"""The decay strategies, against the figures of the original design."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from coda_memory import AdaptiveDecay, DecayStrategy, ExponentialDecay, Fact, FactCategory
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


def test_both_strategies_satisfy_the_protocol() -> None:
    assert isinstance(ExponentialDecay(), DecayStrategy)
    assert isinstance(AdaptiveDecay(), DecayStrategy)


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


def test_time_going_backwards_never_raises_confidence() -> None:
    # Elapsed time is a distance: an anchor 3 days ahead decays like one 3 days behind.
    backwards = ExponentialDecay().decayed(make_fact(0.6), T0 - timedelta(days=3))
    assert backwards == pytest.approx(0.6 * 0.95**3)
    assert backwards <= 0.6


@pytest.mark.parametrize("decay", [ExponentialDecay(), AdaptiveDecay()])
def test_a_future_anchor_cannot_pin_a_fact(decay: ExponentialDecay) -> None:
    # A fact stored with a date ten years ahead is expired now, not held at 1.0.
    pinned = make_fact(1.0)
    assert decay.decayed(pinned, T0 - timedelta(days=3650)) < decay.expiry_threshold
    # A few minutes of clock skew between servers cost next to nothing.
    assert decay.decayed(pinned, T0 - timedelta(minutes=5)) == pytest.approx(1.0, abs=1e-3)


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
