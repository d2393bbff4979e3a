"""2. load_memory() latency, typical identity, with 3 new observations and none."""

from __future__ import annotations

import random

from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.stats import latency_summary
from benchmarks.workloads import Database, names, prepare_profile, timed_loads


async def load_section(db: Database, ctx: Context) -> None:
    sizes, report, baseline = ctx.sizes, ctx.report, ctx.one
    rng = random.Random(2)
    for variant, new in (("3 new observations", 3), ("none new", 0)):
        tag = "new" if new else "none"
        identities = names(f"l-{tag}", sizes.load_identities)
        warm = names(f"l-{tag}-warm", 3)
        await prepare_profile(db, [*warm, *identities], 200, new, 1, rng)
        for identity in warm:
            await db.service.load_memory(identity)
        loads = await timed_loads(db.service, identities)
        summary = latency_summary(loads.seconds)
        details = {
            **summary,
            "facts": 200,
            "new_observations": new,
            "identities": len(identities),
            "timeouts": loads.timeouts,
            "errors": loads.errors,
            "with_prompt_and_affinities": loads.with_prompt_and_affinities,
        }
        report.tables.setdefault("load_memory", []).append({"variant": variant, **details})
        report.add(
            Figure(
                "2 load_memory",
                f"typical, {variant}: p50",
                summary["p50_ms"],
                "ms",
                baseline.p50_ms,
                "pgbench -c1 p50",
                summary["p50_ms"] / baseline.p50_ms,
            )
        )
        report.add(
            Figure(
                "2 load_memory",
                f"typical, {variant}: p99",
                summary["p99_ms"],
                "ms",
                baseline.p99_ms,
                "pgbench -c1 p99",
                summary["p99_ms"] / baseline.p99_ms,
                "<= 10 ms",
                summary["p99_ms"] <= 10.0,
                details,
            )
        )


SECTION = Section(
    name="load",
    title="load",
    database="main",
    run=load_section,
    selected_by=frozenset({"load"}),
)
