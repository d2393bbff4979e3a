"""1. consolidate() latency for three identity profiles, against pgbench -c1."""

from __future__ import annotations

import random

from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.stats import latency_summary
from benchmarks.workloads import Database, consumed, names, prepare_profile, timed_consolidations


async def consolidation_section(db: Database, ctx: Context) -> None:
    sizes, report, baseline = ctx.sizes, ctx.report, ctx.one
    rng = random.Random(1)
    for profile in sizes.profiles:
        identities = names(f"c-{profile.name}", profile.identities)
        warm = names(f"c-{profile.name}-warm", 3)
        await prepare_profile(
            db, [*warm, *identities], profile.facts, profile.new, profile.sessions, rng
        )
        await timed_consolidations(db, warm)
        summary = latency_summary(await timed_consolidations(db, identities))
        real = await consumed(db.conn, identities, profile.new)
        details = {
            **summary,
            "facts": profile.facts,
            "new_observations": profile.new,
            "sessions": profile.sessions,
            "identities": profile.identities,
            "real_runs": real,
        }
        report.tables.setdefault("consolidation", []).append({"profile": profile.name, **details})
        typical = profile.name == "typical"
        report.add(
            Figure(
                "1 consolidation",
                f"{profile.name} p50",
                summary["p50_ms"],
                "ms",
                baseline.p50_ms,
                "pgbench -c1 p50",
                summary["p50_ms"] / baseline.p50_ms,
                "<= 1.5x pgbench -c1" if typical else None,
                summary["p50_ms"] <= 1.5 * baseline.p50_ms if typical else None,
                details,
            )
        )
        report.add(
            Figure(
                "1 consolidation",
                f"{profile.name} p99",
                summary["p99_ms"],
                "ms",
                baseline.p99_ms,
                "pgbench -c1 p99",
                summary["p99_ms"] / baseline.p99_ms,
            )
        )
        if real != profile.identities:
            report.note(f"{profile.name}: only {real}/{profile.identities} runs consumed rows")


SECTION = Section(
    name="consolidation",
    title="consolidation",
    database="main",
    run=consolidation_section,
    selected_by=frozenset({"consolidation"}),
)
