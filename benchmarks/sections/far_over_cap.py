"""15. Far over the cap: identities with many times ``max_facts`` facts (150,000 and
400,000 in full mode), loaded every 200 ms until the cap has brought them down; one with
nothing waiting, one with a session's observations waiting for its consolidation, and a
dormant one whose facts have all expired. How long until its loads answer with its facts
(the dormant one's: with none, in time), how many came back empty meanwhile, the slowest
load and the event loop's lag (the cap must not hold the loop)."""

from __future__ import annotations

import asyncio
import gc
import random
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from benchmarks.host import OBSERVATIONS_PER_REQUEST, LagTicker, collector_pauses
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.server import quiesce
from benchmarks.workloads import DRAIN_TIMEOUT, SCHEMA, Database, new_observations, seed_identities
from coda_memory import MemoryService
from coda_memory.core.caps import kept_on_server

#: How often the identity is loaded, and for how long at most.
LOAD_EVERY = 0.2
DEADLINE = 90.0


async def _loads(
    db: Database, service: MemoryService, identity: str, dormant: bool
) -> tuple[float | None, int, int, float]:
    """Load ``identity`` every :data:`LOAD_EVERY` s until a load answers with its facts
    (``dormant``: with none, within the timeout) and at most ``max_facts``, its margin
    and a fact per waiting observation are stored (or :data:`DEADLINE`): (seconds until
    then or None, loads, empty ones, the slowest)."""
    cap = service.max_facts or 0
    start = time.perf_counter()
    loads, empty, slowest = 0, 0, 0.0
    while time.perf_counter() - start < DEADLINE:
        timeouts = service.stats().load_timeouts
        began = time.perf_counter()
        loaded = await service.load_memory(identity)
        slowest = max(slowest, time.perf_counter() - began)
        loads += 1
        empty += not loaded.facts
        answered = service.stats().load_timeouts == timeouts if dormant else bool(loaded.facts)
        stored = await db.conn.fetchval(
            f"SELECT count(*) FROM {SCHEMA}.facts WHERE identity_id = $1", identity
        )
        if answered and stored <= kept_on_server(cap) + OBSERVATIONS_PER_REQUEST:
            return time.perf_counter() - start, loads, empty, slowest
        await asyncio.sleep(LOAD_EVERY)
    return None, loads, empty, slowest


async def _until_capped(
    db: Database, identity: str, facts: int, waiting: bool, dormant: bool = False
) -> dict[str, Any]:
    """:func:`_loads` of ``identity`` (``waiting``: after a session of its observations
    is stored), by a fresh service, with the event loop's lag and the collector's runs."""
    service = MemoryService.from_url(db.url)
    ticker = LagTicker()
    try:
        await service.start()
        if waiting:
            for observation in new_observations(
                identity, facts, OBSERVATIONS_PER_REQUEST, 1, datetime.now(UTC), random.Random(5)
            ):
                service.emit_observation(identity, observation)
            await service.drain(DRAIN_TIMEOUT)
        gc.collect()  # the seeding's garbage is the benchmark's, not the library's
        ticker.start()
        with collector_pauses() as pauses:
            capped, loads, empty, slowest = await _loads(db, service, identity, dormant)
        stats = service.stats()
    finally:
        await ticker.stop()
        await service.close()
    return {
        "facts": facts,
        "observations_waiting": OBSERVATIONS_PER_REQUEST if waiting else 0,
        "dormant": dormant,
        "capped_after_s": capped,
        "loads": loads,
        "empty": empty,
        "slowest_load_ms": slowest * 1000,
        "facts_evicted": stats.facts_evicted,
        **{f"lag_{key}": value for key, value in ticker.summary().items()},
        **pauses.summary(),
    }


async def far_over_cap_section(db: Database, ctx: Context) -> None:
    sizes, report = ctx.sizes, ctx.report
    rows: list[dict[str, Any]] = []
    for facts in sizes.cap_facts:
        idle, busy, asleep = f"cap-{facts}-idle", f"cap-{facts}-waiting", f"cap-{facts}-dormant"
        # Their facts were made over many sessions (the events of one session that holds
        # nearly all of the table's rows would make the server's statistics send the
        # consolidation's check for earlier sessions through a scan of them).
        await seed_identities(
            db.conn,
            [idle, busy],
            facts,
            datetime.now(UTC) - timedelta(hours=1),
            random.Random(6),
            sessions=facts // 50,
        )
        # Idle for a year: every fact has expired.
        await seed_identities(
            db.conn,
            [asleep],
            facts,
            datetime.now(UTC) - timedelta(days=365),
            random.Random(7),
            sessions=facts // 50,
        )
        await quiesce(db.conn)
        quiet = await _until_capped(db, idle, facts, waiting=False)
        waiting = await _until_capped(db, busy, facts, waiting=True)
        dormant = await _until_capped(db, asleep, facts, waiting=False, dormant=True)
        rows += [quiet, waiting, dormant]
        section = "15 far over the cap"
        baseline = quiet["capped_after_s"]
        for row, what, target, baseline_label in (
            (
                waiting,
                f"an identity of {facts:,} facts whose observations wait is capped (loaded "
                f"every {LOAD_EVERY * 1000:.0f} ms)",
                "capped within",
                "the same identity with nothing waiting",
            ),
            (
                dormant,
                f"a dormant identity of {facts:,} facts, all expired, is brought down (its "
                "loads answer in time)",
                "within",
                "the live identity with nothing waiting",
            ),
        ):
            seconds = row["capped_after_s"]
            report.add(
                Figure(
                    section,
                    f"seconds until {what}",
                    DEADLINE if seconds is None else seconds,
                    "s",
                    baseline,
                    baseline_label,
                    None if seconds is None or not baseline else seconds / baseline,
                    f"{target} {DEADLINE:.0f} s",
                    seconds is not None,
                    row,
                )
            )
        worst = max(quiet["lag_max_ms"], waiting["lag_max_ms"], dormant["lag_max_ms"])
        report.add(
            Figure(
                section,
                f"event-loop lag max while identities of {facts:,} facts are capped",
                worst,
                "ms",
                target="<= 20 ms",
                met=worst <= 20.0,
                details={
                    "nothing waiting": quiet["lag_max_ms"],
                    "waiting": waiting["lag_max_ms"],
                    "dormant": dormant["lag_max_ms"],
                },
            )
        )
    report.tables["far_over_cap"] = rows


SECTION = Section(
    name="far_over_cap",
    title="identities far over the cap on facts, with and without observations waiting",
    database="main",
    run=far_over_cap_section,
    selected_by=frozenset({"cap"}),
)
