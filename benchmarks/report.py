"""Figures, notes and tables of a run, and the Markdown and JSON they are written to."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("bench")


@dataclass
class Figure:
    """One measured number, its same-run baseline, and the target it is held to."""

    section: str
    name: str
    value: float
    unit: str
    baseline: float | None = None
    baseline_name: str | None = None
    ratio: float | None = None
    target: str | None = None
    met: bool | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    #: Mean CPU cores used by other processes during each section.
    load: dict[str, float] = field(default_factory=dict)
    #: Mean CPU cores the hypervisor took from this machine during each section (steal).
    steal: dict[str, float] = field(default_factory=dict)
    #: Sections that raised (the run went on without them).
    failed: list[str] = field(default_factory=list)

    def add(self, figure: Figure) -> Figure:
        self.figures.append(figure)
        met = "" if figure.met is None else ("  [met]" if figure.met else "  [MISSED]")
        ratio = "" if figure.ratio is None else f"  ({figure.ratio:.2f}x {figure.baseline_name})"
        log.info("  %s: %s%s%s", figure.name, _fmt(figure.value, figure.unit), ratio, met)
        return figure

    def note(self, text: str) -> None:
        self.notes.append(text)
        log.info("  note: %s", text)


def _fmt(value: float, unit: str) -> str:
    if unit in ("ms", "us", "s"):
        return f"{value:.3g} {unit}" if value < 100 else f"{value:,.0f} {unit}"
    if unit == "MiB":
        return f"{value:,.1f} MiB"
    if value >= 100:
        return f"{value:,.0f} {unit}"
    return f"{value:.3g} {unit}"


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    only = result.get("only")
    sections = f"; sections {', '.join(only)} only" if only else ""
    lines = [
        f"# coda-memory benchmark ({result['mode']}{sections})",
        "",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- duration: {result['duration_s'] / 60:.1f} min ({result['duration_s']:.0f} s)",
        f"- machine: {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, {m['platform']}",
        f"- PostgreSQL {m['postgres_version']} ({'embedded' if m['embedded'] else '--url'}), "
        f"Python {m['python']}, commit {result['commit']}",
        f"- other processes on the machine used {m['other_processes_cpu_cores_mean']:.2f} CPU "
        "cores on average during the run (per section below)",
        "",
        "| section | figure | value | baseline | ratio | target | met |",
        "| --- | --- | ---: | --- | ---: | --- | :---: |",
    ]
    for f in result["figures"]:
        baseline = "" if f["baseline"] is None else f"{_fmt(f['baseline'], f['unit'])}"
        if f["baseline_name"]:
            baseline = f"{f['baseline_name']}: {baseline}" if baseline else f["baseline_name"]
        ratio = "" if f["ratio"] is None else f"{f['ratio']:.2f}x"
        met = "" if f["met"] is None else ("yes" if f["met"] else "**no**")
        value = _fmt(f["value"], f["unit"]).strip()
        row = [f["section"], f["name"], value, baseline, ratio, f["target"] or "", met]
        lines.append("| " + " | ".join(row) + " |")
    for title, rows in result["tables"].items():
        if not rows:
            continue
        # Every row's columns (a later row may have some the first lacks).
        keys = [
            k
            for k in dict.fromkeys(k for row in rows for k in row)
            if not any(isinstance(row.get(k), list | dict) for row in rows)
        ]
        lines += ["", f"### {title}", "", "| " + " | ".join(keys) + " |"]
        lines.append("| " + " | ".join("---" for _ in keys) + " |")
        for row in rows:
            cells = [_cell(row.get(k)) for k in keys]
            lines.append("| " + " | ".join(cells) + " |")
    if result["notes"]:
        lines += ["", "### notes", ""] + [f"- {note}" for note in result["notes"]]
    timings = ", ".join(f"{k} {v:.0f} s" for k, v in result["timings"].items())
    load = ", ".join(f"{k} {v:.2f}" for k, v in result.get("other_processes_cpu_cores", {}).items())
    lines += [
        "",
        f"Section times: {timings}.",
        "",
        "CPU cores used by other processes on the machine during each section "
        f"(this machine has {m['cores']}): {load}.",
        "",
    ]
    stolen = result.get("stolen_cpu_cores")
    if stolen:  # runs from before 2026-12-03 17:00 did not count it
        taken = ", ".join(f"{k} {v:.2f}" for k, v in stolen.items())
        lines += [
            "CPU cores the hypervisor took from this machine during each section "
            f"(steal: a slow spell of a shared host): {taken}.",
            "",
        ]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def write_results(out: Path, result: dict[str, Any]) -> list[Path]:
    """The result as JSON and Markdown, named by the run's start (``bench-<UTC start>-``
    and its mode, or the sections of an ``--only`` run); a whole run is also the
    ``latest-<mode>.md``, which a run of some sections leaves alone."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.fromisoformat(result["date"]).astimezone(UTC).strftime("%Y%m%d-%H%M")
    only = result.get("only")
    stem = f"bench-{stamp}-{result['mode'] if not only else '-'.join(only)}"
    text = markdown(result)
    written: list[Path] = []
    files = [
        (out / f"{stem}.json", json.dumps(result, indent=2, default=str) + "\n"),
        (out / f"{stem}.md", text),
    ]
    if not only:
        files.append((out / f"latest-{result['mode']}.md", text))
    for path, content in files:
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(content)
        partial.replace(path)
        written.append(path)
    return written
