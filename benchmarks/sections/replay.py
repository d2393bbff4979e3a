"""11. Typical consolidation against its physical limit: the SQL of one typical
consolidation (200 facts, 50 new observations in 5 sessions), replayed by pgbench with
the same rows (see :mod:`benchmarks.replay`); TPC-B beside it. And the same
consolidation's plan alone (the pure Python that decides it, no I/O) beside the replay:
the target (1.5x the replay) leaves half the replay for everything but the SQL, so a
plan over 0.5x the replay puts it out of reach by itself."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from datetime import timedelta
from typing import Any

from benchmarks.replay import SqlCapture, render_script, run_script
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.server import quiesce
from benchmarks.stats import latency_summary
from benchmarks.workloads import (
    Database,
    emit_all,
    names,
    new_observations,
    prepare_profile,
    seed_identities,
    timed_consolidations,
)
from coda_memory.core.consolidation import plan_consolidation
from coda_memory.postgres import PostgresStore

#: The identity whose consolidation is captured, and its never-consolidated twin.
SOURCE, TWIN = "rp-source", "rp-twin"


async def replay_section(db: Database, ctx: Context) -> None:
    sizes, report = ctx.sizes, ctx.report
    typical = next(p for p in sizes.profiles if p.name == "typical")
    identities = names("rp", min(typical.identities, 100))
    warm = names("rp-warm", 3)
    await prepare_profile(db, [*warm, *identities], 200, 50, 5, random.Random(95))
    now = db.clock.now
    await seed_identities(db.conn, [SOURCE, TWIN], 200, now - timedelta(hours=1), random.Random(96))
    await emit_all(
        db.service,
        (
            (identity, observation)
            for identity in (SOURCE, TWIN)
            for observation in new_observations(identity, 200, 50, 5, now, random.Random(97))
        ),
    )
    await quiesce(db.conn)
    await timed_consolidations(db, warm)
    summary = latency_summary(await timed_consolidations(db, identities))
    with SqlCapture() as capture:
        await db.service.consolidate(SOURCE)
    script = await render_script(db.conn, capture.calls, SOURCE, TWIN)
    replayed = await asyncio.to_thread(
        run_script, ctx.server, db.name, script, sizes.pgbench_seconds
    )
    plan = await _plan_alone(db, TWIN, PLAN_RUNS)
    details = {
        "consolidation": summary,
        "replay": replayed,
        "captured_calls": len(capture.calls),
        "script": script,
    }
    report.tables["consolidation_replay"] = [
        {"what": "consolidate() through the service", **summary},
        {"what": "the same SQL replayed by pgbench -c1 (ROLLBACK)", **replayed},
    ]
    report.add(
        Figure(
            "11 consolidation replay",
            "typical p50 vs its SQL replayed by pgbench",
            summary["p50_ms"],
            "ms",
            replayed["p50_ms"],
            "replayed SQL p50",
            summary["p50_ms"] / replayed["p50_ms"],
            "<= 1.5x the replay",
            summary["p50_ms"] <= 1.5 * replayed["p50_ms"],
            details,
        )
    )
    report.add(
        Figure(
            "11 consolidation replay",
            "typical consolidation's plan alone (Python, no I/O) p50 vs its SQL replayed",
            plan["p50_ms"],
            "ms",
            replayed["p50_ms"],
            "replayed SQL p50",
            plan["p50_ms"] / replayed["p50_ms"],
            details={
                "plan": plan,
                "runs": PLAN_RUNS,
                # What the consolidation's p50 spends beside its SQL and its plan: the
                # client's side of the round trips, the rows read into models and the
                # plan's rows made for the write.
                "rest_of_p50_ms": summary["p50_ms"] - replayed["p50_ms"] - plan["p50_ms"],
            },
        )
    )
    report.add(
        Figure(
            "11 consolidation replay",
            "replayed SQL p50 vs TPC-B",
            replayed["p50_ms"],
            "ms",
            ctx.one.p50_ms,
            "pgbench -c1 p50",
            replayed["p50_ms"] / ctx.one.p50_ms,
        )
    )
    report.add(
        Figure(
            "11 consolidation replay",
            "typical p50 vs TPC-B",
            summary["p50_ms"],
            "ms",
            ctx.one.p50_ms,
            "pgbench -c1 p50",
            summary["p50_ms"] / ctx.one.p50_ms,
        )
    )


#: How many times the plan alone is timed.
PLAN_RUNS = 200


async def _plan_alone(db: Database, identity: str, runs: int) -> dict[str, Any]:
    """The plan of ``identity``'s consolidation as the service makes it (its clock, decay,
    retention and cap), timed ``runs`` times, each on fresh copies of the facts the
    store's unit read (the plan turns them into views in place). The unit's transaction
    is left without a write: rolled back, the identity unchanged."""
    store = db.service.store
    assert isinstance(store, PostgresStore)
    async with store.consolidation(identity) as unit:
        batch = await unit.load()
    service = db.service
    seconds: list[float] = []
    for _ in range(runs):
        fresh = dataclasses.replace(batch, facts=[fact.model_copy() for fact in batch.facts])
        start = time.perf_counter()
        plan_consolidation(
            identity, fresh, service.clock(), service.decay, service.retention, service.max_facts
        )
        seconds.append(time.perf_counter() - start)
    return latency_summary(seconds)


SECTION = Section(
    name="replay",
    title="typical consolidation against its SQL replayed by pgbench",
    database="main",
    run=replay_section,
    selected_by=frozenset({"replay"}),
)
