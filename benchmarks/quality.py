"""The memory-quality section: glibc's ChangeLogs replayed through MemoryService.

``python -m benchmarks --quality`` (no Postgres: the replay runs on ``memory://``). It
scores 10 identities drawn at random (seed 13) among the authors with at least 10 active
days; global popularity counts every author's sessions. Each strategy is replayed with
the seed's constants and tuned by a coordinate search over a small grid (below) on the
first 70 % of the timeline; the table reports the last 30 %. Writes
``quality-<stamp>.md`` and ``quality-<stamp>-reliability.png`` to ``benchmarks/results/``.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.quality_data import glibc_events
from coda_memory.replay import build_timeline, markdown_table, plot_reliability
from coda_memory.replay.harness import replay_baselines
from coda_memory.replay.tuning import FAMILIES, Tuned, describe, tune

log = logging.getLogger("bench")

SAMPLE = 10
MIN_SESSIONS = 10
SEED = 13
#: A smaller grid than the library's, so the section stays under 3 minutes.
GRIDS: dict[str, dict[str, tuple[float, ...]]] = {
    "exponential": {"base": (0.9, 0.98), "reinforce_amount": (0.2,)},
    "adaptive": {"base": (0.9, 0.98), "default_ease": (5.0,)},
    "power-law": {"initial_stability": (0.05, 1.0), "growth": (0.8,)},
}


def _verdicts(tuned: list[Tuned]) -> list[str]:
    lines = []
    for t in tuned:
        if not t.best_params:
            lines.append(f"- {t.family.name}: the search kept the seed's constants.")
            continue
        seed, best = t.seed.test.ranking.ndcg_at_10, t.best.test.ranking.ndcg_at_10
        verdict = "better" if best > seed else "not better"
        lines.append(
            f"- {t.family.name} tuned ({describe(t.best_params)}): held-out NDCG@10 "
            f"{best:.3f} against {seed:.3f} with the seed's constants: {verdict}."
        )
    return lines


async def _run(out: Path) -> list[Path]:
    started = time.perf_counter()
    events = glibc_events()
    timeline = build_timeline(events, sample=SAMPLE, min_sessions=MIN_SESSIONS, seed=SEED)
    scored = [s for s in timeline.sessions if s.identity in timeline.scored]
    log.info(
        "quality: %d events, %d sessions, %d of them of the %d sampled identities",
        len(events),
        len(timeline.sessions),
        len(scored),
        len(timeline.scored),
    )
    baselines = replay_baselines(timeline)
    tuned: list[Tuned] = []
    for family in FAMILIES:
        log.info("quality: %s", family.name)
        tuned.append(await tune(family, timeline, grid=GRIDS[family.name]))
    results = [*baselines, *(t.seed for t in tuned), *(t.best for t in tuned if t.best_params)]
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M")
    out.mkdir(parents=True, exist_ok=True)
    png = out / f"quality-{stamp}-reliability.png"
    plot_reliability(results, png)
    elapsed = time.perf_counter() - started
    held_out = baselines[0].test.ranking.sessions  # scored (an author's first is not)
    text = "\n".join(
        [
            f"# Memory quality, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            "",
            f"glibc ChangeLogs: {len(events):,} author-file events, "
            f"{len(timeline.sessions):,} author-days. Scored: {len(timeline.scored)} authors "
            f"drawn at random (seed {SEED}) among those with at least {MIN_SESSIONS} active "
            f"days, {len(scored):,} sessions, {held_out:,} of them held out (from "
            f"{timeline.split_at:%Y-%m-%d}). Replays on memory://; "
            f"{sum(t.trials for t in tuned)} strategy replays; {elapsed:.0f} s on "
            f"{platform.python_implementation()} {platform.python_version()}.",
            "",
            "Held out (last 30 % of the timeline):",
            "",
            markdown_table(results),
            "",
            "Fitting period (first 70 %):",
            "",
            markdown_table(results, held_out=False),
            "",
            *_verdicts(tuned),
            "",
            f"Reliability diagram: {png.name}",
            "",
        ]
    )
    md = out / f"quality-{stamp}.md"
    md.write_text(text, encoding="utf-8")
    (out / "latest-quality.md").write_text(text, encoding="utf-8")
    log.info("quality: done in %.0f s", elapsed)
    return [md, png]


def quality_main(out: Path) -> int:
    for path in asyncio.run(_run(out)):
        log.info("wrote %s", path)
    return 0
