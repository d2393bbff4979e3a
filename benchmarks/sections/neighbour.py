"""12. Noisy neighbour: one identity with 30,000 facts loads its memory in a loop while
other identities' load_memory is measured; the same measured first without it."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime, timedelta
from typing import Any

from benchmarks.host import HostRequests, seed_host
from benchmarks.logcount import counted_logs
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.server import quiesce
from benchmarks.stats import latency_summary
from benchmarks.workloads import DRAIN_TIMEOUT, Database, seed_identities
from coda_memory import MemoryService

NEIGHBOUR = "nn-big"


async def _measure(
    service: MemoryService, requests: HostRequests, count: int
) -> tuple[dict[str, Any], int]:
    before = service.stats()
    seconds: list[float] = []
    empty = 0
    with counted_logs() as logs:
        for _ in range(count):
            elapsed, was_empty = await requests.one(service)
            seconds.append(elapsed)
            empty += was_empty
    after = service.stats()
    return {
        **latency_summary(seconds),
        "empty": empty,
        "timeouts_all_identities": after.load_timeouts - before.load_timeouts,
        "warnings_logged": logs.lines,
    }, empty


async def neighbour_section(db: Database, ctx: Context) -> None:
    sizes, report = ctx.sizes, ctx.report
    others = await seed_host(db, "nn", 50, 200)
    await seed_identities(
        db.conn,
        [NEIGHBOUR],
        sizes.neighbour_facts,
        datetime.now(UTC) - timedelta(hours=1),
        random.Random(98),
    )
    await quiesce(db.conn)
    requests = HostRequests(others, 200, seed=99)
    service = MemoryService.from_url(db.url)
    stop = asyncio.Event()
    neighbour_loads: list[bool] = []

    async def neighbour() -> None:
        while not stop.is_set():
            loaded = await service.load_memory(NEIGHBOUR)
            neighbour_loads.append(not loaded.facts)

    try:
        await _measure(service, requests, 10)  # warm-up
        quiet, _ = await _measure(service, requests, sizes.neighbour_loads)
        loop = asyncio.get_running_loop().create_task(neighbour())
        try:
            noisy, empty = await _measure(service, requests, sizes.neighbour_loads)
        finally:
            stop.set()
            await loop
        await service.drain(DRAIN_TIMEOUT)
    finally:
        await service.close()
    noisy["neighbour_loads"] = len(neighbour_loads)
    noisy["neighbour_empty_loads"] = sum(neighbour_loads)
    report.tables["noisy_neighbour"] = [
        {"neighbour": "none", **quiet},
        {"neighbour": f"{sizes.neighbour_facts:,} facts loading in a loop", **noisy},
    ]
    section = "12 noisy neighbour"
    report.add(
        Figure(
            section,
            "others' load_memory p99 while a "
            f"{sizes.neighbour_facts:,}-fact identity loads in a loop",
            noisy["p99_ms"],
            "ms",
            quiet["p99_ms"],
            "the same without the neighbour",
            noisy["p99_ms"] / quiet["p99_ms"],
            "<= 25 ms",
            noisy["p99_ms"] <= 25.0,
            noisy,
        )
    )
    report.add(
        Figure(
            section,
            f"others' empty loads (of {noisy['n']:,}) while it loads",
            empty,
            "",
            target="0",
            met=empty == 0,
        )
    )


SECTION = Section(
    name="neighbour",
    title="noisy neighbour: a 30,000-fact identity loading in a loop",
    database="main",
    run=neighbour_section,
    selected_by=frozenset({"neighbour"}),
)
