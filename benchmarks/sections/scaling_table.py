"""6b. Typical consolidation p50 as the observation table grows."""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Any

from benchmarks.bulk import fill_observations
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.server import quiesce
from benchmarks.stats import latency_summary, loglog_slopes
from benchmarks.workloads import SCHEMA, Database, names, prepare_profile, timed_consolidations

log = logging.getLogger("bench")


async def table_scaling_section(big: Database, ctx: Context) -> None:
    sizes, report, base = ctx.sizes, ctx.report, ctx.base
    rng = random.Random(7)
    per_identity = max(1, sizes.table_levels[-1] // sizes.analytics_identities)
    loaded = 0
    points: list[tuple[float, float]] = []
    rows: list[dict[str, Any]] = []
    for level in sizes.table_levels:
        start = time.perf_counter()
        await fill_observations(big.conn, loaded, level, per_identity, base)
        await quiesce(big.conn, f"VACUUM ANALYZE {SCHEMA}.observations")
        fill_seconds = time.perf_counter() - start
        loaded = level
        identities = names(f"st-{level}", sizes.table_identities)
        warm = names(f"st-{level}-warm", 2)
        await prepare_profile(big, [*warm, *identities], 200, 50, 5, rng)
        await timed_consolidations(big, warm)
        summary = latency_summary(await timed_consolidations(big, identities))
        log.info(
            "  %s observations (+%.1f s to load): p50 %.2f ms",
            f"{level:,}",
            fill_seconds,
            summary["p50_ms"],
        )
        size = await big.conn.fetchval(f"SELECT pg_total_relation_size('{SCHEMA}.observations')")
        points.append((level, summary["p50_ms"]))
        rows.append(
            {
                "observations": level,
                "table_bytes": int(size),
                "load_seconds": fill_seconds,
                **summary,
            }
        )
    report.tables["scaling_table"] = rows
    first = points[0][1]
    for size, p50 in points:
        report.add(
            Figure(
                "6 scaling",
                f"consolidation p50 (typical), {size:,.0f} observations in the table",
                p50,
                "ms",
                first,
                f"{points[0][0]:,.0f} rows",
                p50 / first,
            )
        )
    slopes = loglog_slopes(points)
    overall = math.log(points[-1][1] / first) / math.log(points[-1][0] / points[0][0])
    report.add(
        Figure(
            "6 scaling",
            "growth in table size: log-log slope, first to last",
            overall,
            "",
            0.0,
            "flat",
            None,
            "flat: last p50 <= 1.25x first",
            points[-1][1] <= 1.25 * first,
            {"loglog_slopes": slopes},
        )
    )


SECTION = Section(
    name="table_scaling",
    title="scaling with the observation table's size",
    database="big",
    run=table_scaling_section,
    selected_by=frozenset({"scaling", "analytics"}),
)
