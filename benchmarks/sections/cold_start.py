"""14. Cold start: the first 10 requests of a freshly started service (library defaults),
on the host-shaped workload; how many come back empty on the timeout. Measured for a
service started lazily (on its first request) and for one opened with ``await start()``."""

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


async def _first_requests(
    db: Database, requests: HostRequests, services: int, started: bool
) -> list[dict[str, Any]]:
    by_request: list[list[float]] = [[] for _ in range(FIRST_REQUESTS)]
    empty = [0] * FIRST_REQUESTS
    for _ in range(services):
        service = MemoryService.from_url(db.url)
        try:
            if started:
                await service.start()
            for n in range(FIRST_REQUESTS):
                seconds, was_empty = await requests.one(service)
                by_request[n].append(seconds * 1000)
                empty[n] += was_empty
            await service.drain(DRAIN_TIMEOUT)
        finally:
            await service.close()
    return [
        {
            "start": "await start()" if started else "lazy",
            "request": n + 1,
            "services": services,
            "p50_ms": percentile(ms, 50),
            "max_ms": max(ms),
            "empty": empty[n],
        }
        for n, ms in enumerate(by_request)
    ]


async def cold_start_section(db: Database, ctx: Context) -> None:
    sizes, report = ctx.sizes, ctx.report
    identities = await seed_host(db, "cs", 50, 200)
    requests = HostRequests(identities, 200, seed=94)
    rows: list[dict[str, Any]] = []
    for started in (False, True):
        measured = await _first_requests(db, requests, sizes.cold_starts, started)
        rows += measured
        how = measured[0]["start"]
        total = sum(row["empty"] for row in measured)
        report.add(
            Figure(
                "14 cold start",
                f"{how}: empty loads in the first {FIRST_REQUESTS} requests of "
                f"{sizes.cold_starts} fresh services",
                total,
                "",
                target="0" if started else None,
                met=total == 0 if started else None,
                details={"per_request": measured},
            )
        )
        for row in measured[:2]:
            report.add(
                Figure(
                    "14 cold start",
                    f"{how}: request {row['request']} of a fresh service, load_memory max",
                    row["max_ms"],
                    "ms",
                )
            )
    report.tables["cold_start"] = rows


SECTION = Section(
    name="cold_start",
    title="cold start: the first 10 requests of fresh services, lazy and after start()",
    database="main",
    run=cold_start_section,
    selected_by=frozenset({"cold_start"}),
)
