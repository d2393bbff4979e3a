"""PNG charts for the command line and the demo (matplotlib, an optional extra).

matplotlib is imported only when a chart is drawn, and drawn with the Agg canvas on a
``Figure`` of its own (no pyplot state). Without it, :class:`PlotsUnavailable` says how
to install it. The confidence curve of a fact is computed by :func:`confidence_curve`,
which needs no matplotlib.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coda_memory.core.model import Fact, FactEvent, FactEventKind, fact_id
from coda_memory.errors import CodaMemoryError

if TYPE_CHECKING:
    from coda_memory.core.decay import DecayStrategy
    from coda_memory.postgres.analytics import (
        DomainTrend,
        EntityPopularity,
        FactSummary,
        ToolEffectiveness,
    )

INSTALL_HINT = "plots need matplotlib: pip install 'coda-memory[plot]'"

#: Points drawn per decay segment between two events.
_SAMPLES = 80
_DPI = 130
_GREEN, _BLUE, _RED, _GREY = "#2e7d32", "#1565c0", "#c62828", "#757575"


class PlotsUnavailable(CodaMemoryError):
    """matplotlib is not installed."""


def _figure(width: float, height: float) -> Any:
    """A new Agg figure, or :class:`PlotsUnavailable`."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotsUnavailable(INSTALL_HINT) from exc
    figure = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure: Any, path: Path) -> Path:
    figure.savefig(path, format="png", dpi=_DPI, facecolor="white")
    return path


def _date_axis(axes: Any) -> None:
    dates: Any = importlib.import_module("matplotlib.dates")
    locator = dates.AutoDateLocator()
    axes.xaxis.set_major_locator(locator)
    axes.xaxis.set_major_formatter(dates.ConciseDateFormatter(locator))


def _style(axes: Any) -> None:
    axes.grid(True, alpha=0.3, linewidth=0.6)
    axes.set_axisbelow(True)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)


# -- a fact's confidence over time ------------------------------------------------------


@dataclass
class ConfidenceCurve:
    """A fact's confidence over time, rebuilt from its history with a decay strategy."""

    #: Continuous decay segments: (times, confidences) from one event to the next.
    segments: list[tuple[list[datetime], list[float]]] = field(default_factory=list)
    #: (time, confidence before, confidence after) of each reinforcement.
    jumps: list[tuple[datetime, float, float]] = field(default_factory=list)
    #: (time, confidence, kind) of each event.
    marks: list[tuple[datetime, float, FactEventKind]] = field(default_factory=list)
    #: When the fact, left alone after its last event, falls below the threshold
    #: (None when that is after ``until`` or the fact already expired).
    projected_expiry: datetime | None = None


def _state(event: FactEvent) -> Fact:
    """The fact as the event left it, enough for ``decay.decayed``."""
    assert event.confidence_after is not None
    return Fact(
        id=fact_id(event.subject),
        identity_id=event.identity_id,
        category=event.category,
        subject=event.subject,
        content="",
        confidence=event.confidence_after,
        reinforcement_count=event.count_after or 1,
        last_reinforced_at=event.at,
        created_at=event.at,
        updated_at=event.at,
        ease_factor=event.ease_after,
        confidence_at=event.at,
    )


def crossing(fact: Fact, decay: DecayStrategy, until: datetime) -> datetime | None:
    """When ``fact`` decays below the expiry threshold, if that happens before ``until``
    (bisection on ``decay.decayed``, so any strategy works)."""
    threshold = decay.expiry_threshold
    if decay.decayed(fact, until) >= threshold:
        return None
    low, high = fact.anchor, until
    while high - low > timedelta(minutes=1):
        middle = low + (high - low) / 2
        if decay.decayed(fact, middle) >= threshold:
            low = middle
        else:
            high = middle
    return high


def _segment(
    fact: Fact, decay: DecayStrategy, start: datetime, end: datetime
) -> tuple[list[datetime], list[float]]:
    step = (end - start) / _SAMPLES
    times = [start + step * i for i in range(_SAMPLES)] + [end]
    return times, [decay.decayed(fact, t) for t in times]


def confidence_curve(
    events: Sequence[FactEvent], decay: DecayStrategy, until: datetime
) -> ConfidenceCurve:
    """Rebuild one fact's confidence from its events up to ``until``.

    Each created, reinforced or extended event anchors the fact at its
    ``confidence_after``; between events the confidence follows ``decay``. An expired
    event ends the curve at the threshold, and a fact left alone after its last event is
    drawn until it crosses the threshold or ``until``.
    """
    curve = ConfidenceCurve()
    threshold = decay.expiry_threshold
    state: Fact | None = None
    for event in sorted(events, key=lambda e: e.at):
        if state is not None and event.at > state.anchor:
            end = crossing(state, decay, event.at) or event.at
            curve.segments.append(_segment(state, decay, state.anchor, end))
        if event.kind is FactEventKind.EXPIRED:
            curve.marks.append((event.at, threshold, event.kind))
            state = None
            continue
        if event.confidence_after is None:
            continue
        before = decay.decayed(state, event.at) if state is not None else None
        if before is not None and before >= threshold:
            curve.jumps.append((event.at, before, event.confidence_after))
        curve.marks.append((event.at, event.confidence_after, event.kind))
        state = _state(event)
    if state is not None and until > state.anchor:
        curve.projected_expiry = crossing(state, decay, until)
        last = curve.projected_expiry or until
        curve.segments.append(_segment(state, decay, state.anchor, last))
    return curve


_MARKERS: dict[FactEventKind, tuple[str, str, str]] = {
    FactEventKind.CREATED: ("o", _GREEN, "created"),
    FactEventKind.REINFORCED: ("^", _BLUE, "reinforced"),
    FactEventKind.EXTENDED: ("D", "#6a1b9a", "extended (same session, later)"),
    FactEventKind.EXPIRED: ("X", _RED, "expired"),
}


def plot_fact_history(
    events: Sequence[FactEvent],
    decay: DecayStrategy,
    path: Path,
    *,
    until: datetime,
    title: str,
) -> Path:
    """Draw a fact's confidence over time, its reinforcements and the expiry threshold."""
    figure = _figure(10, 5)
    axes = figure.add_subplot()
    curve = confidence_curve(events, decay, until)
    for number, (times, values) in enumerate(curve.segments):
        axes.plot(
            times,
            values,
            color=_BLUE,
            linewidth=2,
            label="confidence (decaying)" if number == 0 else None,
        )
    for at, before, after in curve.jumps:
        axes.plot([at, at], [before, after], color=_BLUE, linewidth=1, linestyle=":")
    seen: set[FactEventKind] = set()
    for at, value, kind in curve.marks:
        marker, colour, label = _MARKERS[kind]
        axes.scatter(
            [at],
            [value],
            marker=marker,
            s=70 if kind is FactEventKind.EXPIRED else 36,
            color=colour,
            zorder=3,
            label=None if kind in seen else label,
        )
        seen.add(kind)
        if kind is FactEventKind.EXPIRED:
            axes.annotate(
                f"expired {at:%b %d}",
                (at, value),
                xytext=(-8, 10),
                textcoords="offset points",
                ha="right",
                color=_RED,
                fontsize=9,
            )
    if curve.projected_expiry is not None:
        axes.scatter(
            [curve.projected_expiry],
            [decay.expiry_threshold],
            marker="X",
            s=70,
            facecolors="none",
            edgecolors=_RED,
            zorder=3,
            label="below threshold (not yet consolidated)",
        )
    axes.axvline(until, color=_GREY, linestyle=":", linewidth=1, label=f"now ({until:%b %d})")
    axes.axhline(
        decay.expiry_threshold,
        color=_RED,
        linestyle="--",
        linewidth=1,
        label=f"expiry threshold ({decay.expiry_threshold:g})",
    )
    axes.set_ylim(0, 1.05)
    axes.set_ylabel("confidence")
    _date_axis(axes)
    axes.set_title(title, fontsize=12, loc="left")
    _style(axes)
    axes.legend(loc="upper right", fontsize=8, framealpha=0.9)
    return _save(figure, path)


# -- analytics ----------------------------------------------------------------------------


def _rate_colour(rate: float | None) -> str:
    if rate is None:
        return _GREY
    return _GREEN if rate >= 0.9 else "#ef8f00" if rate >= 0.6 else _RED


def plot_tool_effectiveness(rows: Sequence[ToolEffectiveness], path: Path, *, title: str) -> Path:
    """Per-tool success rate (bars, with calls) and users (who use it, affinity,
    avoidance), best tool on top."""
    ordered = sorted(rows, key=lambda r: (r.success_rate or 0.0, r.tool_name))
    figure = _figure(11, max(3.0, 1.0 + 0.55 * len(ordered)))
    rates_axes, users_axes = figure.subplots(1, 2, sharey=True, width_ratios=[3, 2])
    names = [r.tool_name for r in ordered]
    positions = list(range(len(ordered)))
    rates = [100 * (r.success_rate or 0.0) for r in ordered]
    rates_axes.barh(
        positions,
        rates,
        color=[_rate_colour(r.success_rate) for r in ordered],
        edgecolor="white",
        height=0.6,
    )
    for y, row in zip(positions, ordered, strict=True):
        calls = row.successes + row.failures
        text = "no calls" if row.success_rate is None else f"{100 * row.success_rate:.0f}%"
        rates_axes.text(
            min(rates[y], 100) + 1.5, y, f"{text}  ({calls} calls)", va="center", fontsize=9
        )
    rates_axes.set_xlim(0, 125)
    rates_axes.set_xticks([0, 25, 50, 75, 100])
    rates_axes.set_xlabel("success rate (%)")
    rates_axes.set_yticks(positions, names)
    rates_axes.set_title("Success rate", fontsize=11, loc="left")
    height = 0.26
    series = (
        ("users", [r.users for r in ordered], _GREY),
        # (None: fewer than the database's floor, for an analyst role; drawn as none.)
        ("with affinity", [r.affinity_users or 0 for r in ordered], _GREEN),
        ("with avoidance", [r.avoidance_users or 0 for r in ordered], _RED),
    )
    for offset, (label, values, colour) in zip((height, 0.0, -height), series, strict=True):
        users_axes.barh(
            [p + offset for p in positions], values, height=height, color=colour, label=label
        )
    users_axes.set_xlabel("users")
    users_axes.xaxis.get_major_locator().set_params(integer=True)
    users_axes.set_title("Users", fontsize=11, loc="left")
    users_axes.legend(
        loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8, frameon=False
    )
    for axes in (rates_axes, users_axes):
        _style(axes)
        axes.grid(False, axis="y")
    figure.suptitle(title, fontsize=13, x=0.01, ha="left")
    return _save(figure, path)


def plot_entity_popularity(
    rows: Sequence[EntityPopularity], path: Path, *, title: str, top: int = 20
) -> Path:
    """The most used entities: users per entity (bars), with accesses."""
    ordered = sorted(rows, key=lambda r: (r.users, r.accesses), reverse=True)[:top][::-1]
    figure = _figure(10, max(3.0, 1.0 + 0.4 * len(ordered)))
    axes = figure.add_subplot()
    positions = list(range(len(ordered)))
    axes.barh(positions, [r.users for r in ordered], color=_BLUE, height=0.6)
    for y, row in zip(positions, ordered, strict=True):
        axes.text(row.users, y, f"  {row.accesses} accesses", va="center", fontsize=9)
    axes.set_yticks(positions, [f"{r.entity_type}:{r.entity_id}" for r in ordered])
    axes.set_xlabel("users")
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.margins(x=0.25)
    axes.set_title(title, fontsize=12, loc="left")
    _style(axes)
    axes.grid(False, axis="y")
    return _save(figure, path)


def plot_domain_trends(rows: Sequence[DomainTrend], path: Path, *, title: str) -> Path:
    """Queries per day, stacked by domain (a day without queries is an empty bar)."""
    figure = _figure(10, 4.5)
    axes = figure.add_subplot()
    days = sorted({row.day for row in rows})
    queries = {(row.day, row.domain): row.queries for row in rows}
    bottom = [0] * len(days)
    for domain in sorted({row.domain for row in rows}):
        values = [queries.get((day, domain), 0) for day in days]
        axes.bar(days, values, bottom=bottom, width=0.8, label=domain, edgecolor="white")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    _date_axis(axes)
    axes.yaxis.get_major_locator().set_params(integer=True)
    axes.set_ylabel("queries per day")
    axes.set_title(title, fontsize=12, loc="left")
    _style(axes)
    axes.grid(False, axis="x")
    if rows:
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return _save(figure, path)


def plot_fact_summary(rows: Sequence[FactSummary], path: Path, *, title: str) -> Path:
    """How confident the facts of each category are: stacked confidence histograms."""
    figure = _figure(10, 4.5)
    axes = figure.add_subplot()
    buckets = max((len(r.histogram) for r in rows), default=10)
    lefts = [i / buckets for i in range(buckets)]
    bottom = [0.0] * buckets
    for row in sorted(rows, key=lambda r: r.category):
        # (A bucket withheld under the database's floor, for an analyst role: drawn as none.)
        values = [float(v or 0) for v in row.histogram] + [0.0] * (buckets - len(row.histogram))
        axes.bar(
            lefts,
            values,
            width=1 / buckets,
            bottom=bottom,
            align="edge",
            edgecolor="white",
            label=f"{row.category} ({row.facts} facts)",
        )
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes.set_xlim(0, 1)
    axes.set_xticks([i / buckets for i in range(0, buckets + 1, 2)])
    axes.set_xlabel("confidence now")
    axes.set_ylabel("facts")
    axes.yaxis.get_major_locator().set_params(integer=True)
    axes.set_ylim(0, max(bottom, default=0.0) * 1.1 + 0.5)
    axes.set_title(title, fontsize=12, loc="left")
    _style(axes)
    if rows:
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return _save(figure, path)
