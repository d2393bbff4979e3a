"""6a. Consolidation p50 as the identity's own facts grow."""

from __future__ import annotations

import random
from typing import Any

from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.stats import latency_summary, linear_fit, loglog_slopes
from benchmarks.workloads import Database, names, prepare_profile, timed_consolidations


async def fact_scaling_section(db: Database, ctx: Context) -> None:
    sizes, report = ctx.sizes, ctx.report
    rng = random.Random(6)
    points: list[tuple[float, float]] = []
    rows: list[dict[str, Any]] = []
    for facts, count in sizes.fact_levels:
        identities = names(f"sf-{facts}", count)
        warm = names(f"sf-{facts}-warm", 2)
        await prepare_profile(db, [*warm, *identities], facts, 20, 2, rng)
        await timed_consolidations(db, warm)
        summary = latency_summary(await timed_consolidations(db, identities))
        points.append((facts, summary["p50_ms"]))
        rows.append({"facts": facts, **summary})
    slopes = loglog_slopes(points)
    intercept, slope = linear_fit(points)
    for row, exponent in zip(rows[1:], slopes, strict=True):
        row["loglog_slope_from_previous"] = exponent
    report.tables["scaling_facts"] = rows
    first = points[0][1]
    for size, p50 in points:
        report.add(
            Figure(
                "6 scaling",
                f"consolidation p50, {size:,.0f} facts per identity",
                p50,
                "ms",
                first,
                f"{points[0][0]:,.0f} facts",
                p50 / first,
            )
        )
    report.add(
        Figure(
            "6 scaling",
            "growth in own facts: log-log slope, last step",
            slopes[-1],
            "",
            1.0,
            "linear",
            slopes[-1],
            "<= 1.1 (at most linear)",
            max(slopes) <= 1.1,
            {
                "loglog_slopes": slopes,
                "linear_fit_intercept_ms": intercept,
                "linear_fit_ms_per_1000_facts": slope * 1000,
            },
        )
    )


SECTION = Section(
    name="scaling",
    title="scaling",
    database="main",
    run=fact_scaling_section,
    selected_by=frozenset({"scaling"}),
)
