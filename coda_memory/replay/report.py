"""The replay's results as a table, and the reliability diagram."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from coda_memory.replay.harness import ReplayResult

HEADER = (
    "method",
    "sessions",
    "hit@5",
    "NDCG@10",
    "Brier",
    "Brier, base rate",
    "log-loss",
    "facts held",
)


#: A cell of :func:`values`: the method's name, a count, a score, or None (not scored).
Value = str | int | float | None


def values(results: Sequence[ReplayResult], *, held_out: bool = True) -> list[list[Value]]:
    """One row per method, in :data:`HEADER`'s order: its scores on the held-out (or
    fitting) period, None where there is none (a method without confidences has no
    calibration; a NaN score is None).

    "Brier, base rate" is the Brier score of a constant prediction, the method's own
    positive rate on the fitting period, on the same pairs: a calibrated confidence
    beats it."""
    table: list[list[Value]] = []
    for result in results:
        scores = result.period(held_out)
        calibration = scores.calibration
        calibrated = result.calibrated and calibration.count > 0
        base_rate = result.fit.calibration.base_rate
        row: list[Value] = [
            result.name,
            scores.ranking.sessions,
            scores.ranking.hit_at_5,
            scores.ranking.ndcg_at_10,
            calibration.brier if calibrated else None,
            calibration.brier_of_constant(base_rate) if calibrated else None,
            calibration.log_loss if calibrated else None,
            # (A strategy whose facts had all expired holds 0, not nothing.)
            scores.facts_per_identity if scores.facts_total or result.calibrated else None,
        ]
        table.append([None if isinstance(v, float) and math.isnan(v) else v for v in row])
    return table


def rows(results: Sequence[ReplayResult], *, held_out: bool = True) -> list[list[str]]:
    """:func:`values` as the table shows them: three decimals (facts held, one), and
    nothing where there is no score."""
    table: list[list[str]] = []
    for row in values(results, held_out=held_out):
        cells: list[str] = []
        for column, value in zip(HEADER, row, strict=True):
            if value is None:
                cells.append("")
            elif isinstance(value, float):  # never NaN: values() made those None
                cells.append(f"{value:.{1 if column == 'facts held' else 3}f}")
            else:
                cells.append(str(value))
        table.append(cells)
    return table


def markdown_table(results: Sequence[ReplayResult], *, held_out: bool = True) -> str:
    lines = [
        "| " + " | ".join(HEADER) + " |",
        "| --- | " + " | ".join("---:" for _ in HEADER[1:]) + " |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows(results, held_out=held_out)]
    return "\n".join(lines)


def plot_reliability(results: Sequence[ReplayResult], path: Path, *, held_out: bool = True) -> None:
    """A reliability diagram (needs the ``plot`` extra): per confidence bin, the share of
    facts whose subject was used within the horizon, against the mean confidence.

    Drawn on a ``Figure`` with an Agg canvas of its own, not through pyplot: a host that
    imported matplotlib (a notebook, a GUI) keeps its backend and its figures."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 5.6))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1, label="calibrated")
    for result in results:
        if not result.calibrated:
            continue
        points = result.period(held_out).calibration.reliability()
        if points:
            xs, ys, _ = zip(*points, strict=True)
            axes.plot(xs, ys, marker="o", linewidth=1.5, label=result.name)
    axes.set_xlabel("confidence at the session's start")
    axes.set_ylabel("share used again within the horizon")
    axes.set_xlim(0, 1)
    axes.set_ylim(0, 1)
    axes.set_title("Reliability of confidence" + (" (held out)" if held_out else ""))
    axes.legend(fontsize=7, loc="upper left")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
