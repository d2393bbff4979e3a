"""10. load_memory on the typical profile of issue 9: 200 facts and 50 new observations
from 5 sessions, one client; then the same for identities that also keep a long history
of consumed observations (a load's work must not grow with it); then the same on other
identities in a host that froze its garbage collector after startup (``gc.freeze()``,
see the README). Each variant counts the statements that were slow on the server
meanwhile (``benchmarks.slow_statements``)."""

from __future__ import annotations

import gc
import random
from typing import Any

from benchmarks.host import collector_pauses
from benchmarks.profiling.statements import log_offset
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.server import Server
from benchmarks.slow_statements import slow_since, slow_statements_logged
from benchmarks.stats import latency_summary
from benchmarks.workloads import Database, names, prepare_profile, timed_loads


async def _loads(db: Database, server: Server, identities: list[str]) -> dict[str, Any]:
    # The collector's runs meanwhile: a collection that falls in a load adds to it.
    log_start = log_offset(server)
    with collector_pauses() as pauses:
        loads = await timed_loads(db.service, identities)
    return {
        **latency_summary(loads.seconds),
        **pauses.summary(),
        **slow_since(server, log_start),
        "facts": 200,
        "new_observations": 50,
        "sessions": 5,
        "empty": loads.empty,
        "timeouts": loads.timeouts,
        "errors": loads.errors,
    }


async def typical_load_section(db: Database, ctx: Context) -> None:
    sizes, report, baseline = ctx.sizes, ctx.report, ctx.one
    identities = names("tl", sizes.typical_load_identities)
    frozen_identities = names("tl-frozen", sizes.typical_load_identities)
    warm = names("tl-warm", 3)
    long_lived = names("tl-history", sizes.history_identities)
    await prepare_profile(
        db, [*warm, *identities, *frozen_identities], 200, 50, 5, random.Random(93)
    )
    await prepare_profile(
        db, long_lived, 200, 50, 5, random.Random(94), history=sizes.history_observations
    )
    for identity in warm:
        await db.service.load_memory(identity)
    async with slow_statements_logged(db.conn, ctx.server):
        details = await _loads(db, ctx.server, identities)
        history = await _loads(db, ctx.server, long_lived)
        gc.collect()
        gc.freeze()
        try:
            frozen = await _loads(db, ctx.server, frozen_identities)
        finally:
            gc.unfreeze()
    history["consumed_observations"] = sizes.history_observations
    name = "typical, 50 new observations in 5 sessions"
    report.tables["typical_load"] = [
        {"gc": "default", **details},
        {"gc": "default, long history", **history},
        {"gc": "gc.freeze() after start", **frozen},
    ]
    for key, pgbench, label in (
        ("p50_ms", baseline.p50_ms, "pgbench -c1 p50"),
        ("p99_ms", baseline.p99_ms, "pgbench -c1 p99"),
    ):
        p99 = key == "p99_ms"
        report.add(
            Figure(
                "10 load_memory",
                f"{name}: {key[:3]}",
                details[key],
                "ms",
                pgbench,
                label,
                details[key] / pgbench,
                "<= 10 ms" if p99 else None,
                details[key] <= 10.0 if p99 else None,
                details,
            )
        )
        report.add(
            Figure(
                "10 load_memory",
                f"{name}, gc.freeze(): {key[:3]}",
                frozen[key],
                "ms",
                pgbench,
                label,
                frozen[key] / pgbench,
                details=frozen,
            )
        )

    with_history = f"{name}, {sizes.history_observations:,} consumed observations each"
    for key in ("p50_ms", "p99_ms"):
        report.add(
            Figure(
                "10 load_memory",
                f"{with_history}: {key[:3]}",
                history[key],
                "ms",
                details[key],
                f"the same without the history: {key[:3]}",
                history[key] / details[key],
                details=history,
            )
        )


SECTION = Section(
    name="typical_load",
    title="load_memory, 200 facts and 50 new observations",
    database="main",
    run=typical_load_section,
    selected_by=frozenset({"typical_load"}),
)
