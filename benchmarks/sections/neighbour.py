"""12. Noisy neighbour: one identity with 30,000 facts loads its memory in a loop while
other identities' load_memory is measured; the same measured first without it. Then a
second one, as large, whose every load follows a session of its own observations, as a
busy user's would: its facts are over the cap while observations wait."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from benchmarks.host import (
    HostRequests,
    collector_pauses,
    seed_host,
    timed_out,
)
from benchmarks.logcount import counted_logs
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.server import quiesce
from benchmarks.stats import latency_summary
from benchmarks.workloads import (
    DRAIN_TIMEOUT,
    SCHEMA,
    Database,
    seed_identities,
    timeouts_between,
)
from coda_memory import MemoryService

NEIGHBOUR = "nn-big"
#: The neighbour whose observations wait at each of its loads.
BUSY_NEIGHBOUR = "nn-busy"


async def _measure(
    service: MemoryService,
    requests: HostRequests,
    count: int,
    loads: list[tuple[float, float]] | None = None,
) -> tuple[dict[str, Any], int]:
    """``count`` loads of the others, one at a time: their summary, and how many timed
    out (answered empty or from the facts at hand, at the end of the timeout). Each load's
    start (``time.perf_counter()``) and seconds go into ``loads``, when given."""
    before = service.stats()
    seconds: list[float] = []
    empty = timeouts = 0
    with counted_logs() as logs, collector_pauses() as pauses:
        for _ in range(count):
            began = time.perf_counter()
            elapsed, was_empty = await requests.one(service)
            seconds.append(elapsed)
            if loads is not None:
                loads.append((began, elapsed))
            empty += was_empty
            timeouts += timed_out(service, elapsed)
    after = service.stats()
    return {
        **latency_summary(seconds),
        "empty": empty,
        "timeouts": timeouts,
        "timeouts_all_identities": timeouts_between(before, after),
        # The others' loads always find new observations: the reused answers are the
        # neighbour's (one round trip, no consolidation).
        "reused_loads_all_identities": after.loads_reused - before.loads_reused,
        "warnings_logged": logs.lines,
        # Collections of the garbage collector meanwhile (loop stalls).
        **pauses.summary(),
    }, timeouts


async def neighbour_section(db: Database, ctx: Context) -> None:
    sizes, report = ctx.sizes, ctx.report
    others = await seed_host(db, "nn", 50, 200)
    await seed_identities(
        db.conn,
        [NEIGHBOUR, BUSY_NEIGHBOUR],
        sizes.neighbour_facts,
        datetime.now(UTC) - timedelta(hours=1),
        random.Random(98),
    )
    await quiesce(db.conn)
    requests = HostRequests(others, 200, seed=99)
    # The busy neighbour's sessions reach its own facts (and some new entities).
    busy = HostRequests([BUSY_NEIGHBOUR], sizes.neighbour_facts, seed=97)
    service = MemoryService.from_url(db.url)
    cap = service.max_facts or sizes.neighbour_facts

    async def alongside(load: Callable[[], Awaitable[int]]) -> tuple[dict[str, Any], int]:
        """Others' loads measured while ``load`` (the facts it answered with) runs in a
        loop; the neighbour's loads, empty ones and when it was capped in the summary."""
        stop = asyncio.Event()
        seen: list[bool] = []
        capped_after: float | None = None
        started = time.perf_counter()

        async def neighbour() -> None:
            nonlocal capped_after
            while not stop.is_set():
                facts = await load()
                seen.append(facts == 0)
                if capped_after is None and 0 < facts <= cap:
                    capped_after = time.perf_counter() - started

        task = asyncio.get_running_loop().create_task(neighbour())
        loads: list[tuple[float, float]] = []
        try:
            summary, timeouts = await _measure(service, requests, sizes.neighbour_loads, loads)
        finally:
            stop.set()
            await task
        summary["neighbour_loads"] = len(seen)
        summary["neighbour_empty_loads"] = sum(seen)
        # How long the neighbour was over the cap: its loads from then on are loads of
        # max_facts facts (most of them reused answers: see reused_loads_all_identities).
        summary["neighbour_capped_after_s"] = capped_after
        # The others' loads that began while it was still over the cap (too few for a
        # p99: their count and the slowest).
        over = [
            elapsed for at, elapsed in loads if capped_after is None or at - started < capped_after
        ]
        summary["loads_before_cap"] = len(over)
        summary["max_ms_before_cap"] = max(over, default=0.0) * 1000
        summary["measured_s"] = time.perf_counter() - started
        return summary, timeouts

    async def idle_load() -> int:
        return len((await service.load_memory(NEIGHBOUR)).facts)

    async def busy_load() -> int:
        await busy.one(service)
        return busy.last_facts

    try:
        await _measure(service, requests, 10)  # warm-up
        quiet, _ = await _measure(service, requests, sizes.neighbour_loads)
        noisy, noisy_timeouts = await alongside(idle_load)
        waiting, waiting_timeouts = await alongside(busy_load)
        await service.drain(DRAIN_TIMEOUT)
        left = await db.conn.fetchval(
            f"SELECT count(*) FROM {SCHEMA}.facts WHERE identity_id = $1", BUSY_NEIGHBOUR
        )
    finally:
        await service.close()
    waiting["neighbour_facts_left"] = left
    report.tables["noisy_neighbour"] = [
        {"neighbour": "none", **quiet},
        {"neighbour": f"{sizes.neighbour_facts:,} facts loading in a loop", **noisy},
        {
            "neighbour": f"{sizes.neighbour_facts:,} facts, observations waiting at each load",
            **waiting,
        },
    ]
    section = "12 noisy neighbour"
    for summary, timeouts, neighbour in (
        (noisy, noisy_timeouts, f"a {sizes.neighbour_facts:,}-fact identity loads in a loop"),
        (
            waiting,
            waiting_timeouts,
            f"a {sizes.neighbour_facts:,}-fact identity whose observations wait loads in a loop",
        ),
    ):
        report.add(
            Figure(
                section,
                f"others' load_memory p99 while {neighbour}",
                summary["p99_ms"],
                "ms",
                quiet["p99_ms"],
                "the same without the neighbour",
                summary["p99_ms"] / quiet["p99_ms"],
                "<= 25 ms",
                summary["p99_ms"] <= 25.0,
                summary,
            )
        )
        report.add(
            Figure(
                section,
                f"others' timed-out loads (of {summary['n']:,}; empty or from the facts at "
                f"hand) while {neighbour}",
                timeouts,
                "",
                target="0",
                met=timeouts == 0,
                details={
                    "empty": summary["empty"],
                    "neighbour_capped_after_s": summary["neighbour_capped_after_s"],
                    "measured_s": summary["measured_s"],
                },
            )
        )


SECTION = Section(
    name="neighbour",
    title="noisy neighbour: a 30,000-fact identity loading in a loop",
    database="main",
    run=neighbour_section,
    selected_by=frozenset({"neighbour"}),
)
