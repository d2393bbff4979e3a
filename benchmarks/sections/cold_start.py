"""14. Cold start: the first 10 requests of a freshly started service (library defaults),
on the host-shaped workload; how many come back empty on the timeout."""

from __future__ import annotations

from typing import Any

from benchmarks.host import HostRequests, seed_host
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.stats import percentile
from benchmarks.workloads import DRAIN_TIMEOUT, Database
from coda_memory import MemoryService

#: Requests measured after each start.
FIRST_REQUESTS = 10


async def cold_start_section(db: Database, ctx: Context) -> None:
    sizes, report = ctx.sizes, ctx.report
    identities = await seed_host(db, "cs", 50, 200)
    requests = HostRequests(identities, 200, seed=94)
    by_request: list[list[float]] = [[] for _ in range(FIRST_REQUESTS)]
    empty = [0] * FIRST_REQUESTS
    timeouts = 0
    for _ in range(sizes.cold_starts):
        service = MemoryService.from_url(db.url)
        try:
            for n in range(FIRST_REQUESTS):
                seconds, was_empty = await requests.one(service)
                by_request[n].append(seconds * 1000)
                empty[n] += was_empty
            timeouts += service.stats().load_timeouts
            await service.drain(DRAIN_TIMEOUT)
        finally:
            await service.close()
    rows: list[dict[str, Any]] = [
        {
            "request": n + 1,
            "services": sizes.cold_starts,
            "p50_ms": percentile(ms, 50),
            "max_ms": max(ms),
            "empty": empty[n],
        }
        for n, ms in enumerate(by_request)
    ]
    report.tables["cold_start"] = rows
    total = sum(empty)
    report.add(
        Figure(
            "14 cold start",
            f"empty loads in the first {FIRST_REQUESTS} requests of "
            f"{sizes.cold_starts} fresh services",
            total,
            "",
            target="0",
            met=total == 0,
            details={"timeouts": timeouts, "per_request": rows},
        )
    )
    for n in (0, 1):
        report.add(
            Figure(
                "14 cold start",
                f"request {n + 1} of a fresh service: load_memory max",
                rows[n]["max_ms"],
                "ms",
            )
        )


SECTION = Section(
    name="cold_start",
    title="cold start: the first 10 requests of fresh services",
    database="main",
    run=cold_start_section,
    selected_by=frozenset({"cold_start"}),
)
