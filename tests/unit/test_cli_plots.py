"""The confidence curve behind ``history --plot``, and the charts themselves."""

from __future__ import annotations

import itertools
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from coda_memory.cli.demo.plots import confidence_curve, crossing, plot_fact_history
from coda_memory.core.decay import AdaptiveDecay, ExponentialDecay
from coda_memory.core.model import Fact, FactCategory, FactEvent, FactEventKind, fact_id

T0 = datetime(2026, 1, 1, 9, 0, tzinfo=UTC)
SUBJECT = "tool_affinity:get_account"


def event(
    kind: FactEventKind,
    at: datetime,
    before: float | None,
    after: float | None,
    count: int | None,
    ease: float | None = None,
) -> FactEvent:
    return FactEvent(
        identity_id="alice",
        subject=SUBJECT,
        category=FactCategory.TOOL_AFFINITY,
        kind=kind,
        session_id=None if kind is FactEventKind.EXPIRED else f"s-{at:%d}",
        at=at,
        confidence_before=before,
        confidence_after=after,
        count_before=None if count is None or count == 1 else count - 1,
        count_after=count,
        ease_after=ease,
    )


def fact(confidence: float, at: datetime) -> Fact:
    return Fact(
        id=fact_id(SUBJECT),
        identity_id="alice",
        category=FactCategory.TOOL_AFFINITY,
        subject=SUBJECT,
        content="Uses get_account successfully",
        confidence=confidence,
        reinforcement_count=1,
        last_reinforced_at=at,
        created_at=at,
        updated_at=at,
    )


def test_crossing_finds_when_a_fact_falls_below_the_threshold() -> None:
    decay = ExponentialDecay()
    expected = T0 + timedelta(days=math.log(0.1 / 0.8) / math.log(0.95))

    found = crossing(fact(0.8, T0), decay, T0 + timedelta(days=365))

    assert found is not None
    assert abs(found - expected) <= timedelta(minutes=1)
    assert crossing(fact(0.8, T0), decay, T0 + timedelta(days=30)) is None


def reinforced_then_expired() -> list[FactEvent]:
    second = T0 + timedelta(days=2)
    before = 0.5 * 0.95**2
    last = before + 0.1
    expired_at = second + timedelta(days=math.log(0.1 / last) / math.log(0.95))
    return [
        event(FactEventKind.CREATED, T0, None, 0.5, 1),
        event(FactEventKind.REINFORCED, second, before, last, 2),
        event(FactEventKind.EXPIRED, expired_at, 0.09, None, None),
    ]


def test_the_curve_follows_the_decay_between_events_and_ends_at_expiry() -> None:
    decay = ExponentialDecay()
    events = reinforced_then_expired()

    curve = confidence_curve(events, decay, until=T0 + timedelta(days=90))

    assert len(curve.segments) == 2
    (times, values), (later_times, later_values) = curve.segments
    assert (times[0], values[0]) == (T0, 0.5)
    assert times[-1] == events[1].at
    assert values[-1] == pytest.approx(0.5 * 0.95**2)
    assert later_values[0] == pytest.approx(events[1].confidence_after)
    assert later_times[-1] - events[2].at < timedelta(minutes=2)
    assert later_values[-1] == pytest.approx(0.1, abs=1e-4)
    assert all(a >= b for a, b in itertools.pairwise(later_values))
    [(jump_at, jump_from, jump_to)] = curve.jumps
    assert jump_at == events[1].at
    assert jump_from == pytest.approx(0.45125)
    assert jump_to == events[1].confidence_after
    assert [kind for _, _, kind in curve.marks] == [
        FactEventKind.CREATED,
        FactEventKind.REINFORCED,
        FactEventKind.EXPIRED,
    ]
    assert curve.projected_expiry is None


def test_an_active_fact_is_drawn_until_now_or_until_it_would_expire() -> None:
    decay = ExponentialDecay()
    created = [event(FactEventKind.CREATED, T0, None, 0.5, 1)]

    soon = confidence_curve(created, decay, until=T0 + timedelta(days=3))
    late = confidence_curve(created, decay, until=T0 + timedelta(days=60))

    assert soon.projected_expiry is None
    assert soon.segments[-1][0][-1] == T0 + timedelta(days=3)
    expected = T0 + timedelta(days=math.log(0.1 / 0.5) / math.log(0.95))
    assert late.projected_expiry is not None
    assert abs(late.projected_expiry - expected) < timedelta(minutes=2)
    assert late.segments[-1][0][-1] == late.projected_expiry


def test_the_curve_uses_the_strategy_it_is_given() -> None:
    decay = AdaptiveDecay()
    created = [event(FactEventKind.CREATED, T0, None, 0.5, 1, ease=2.5)]
    until = T0 + timedelta(days=10)

    curve = confidence_curve(created, decay, until=until)

    assert curve.segments[0][1][-1] == pytest.approx(0.5 * 0.95 ** (10 / 2.5))


def test_the_history_chart_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "history.png"

    plot_fact_history(
        reinforced_then_expired(),
        ExponentialDecay(),
        path,
        until=T0 + timedelta(days=40),
        title=f"{SUBJECT} for 'alice'",
    )

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
