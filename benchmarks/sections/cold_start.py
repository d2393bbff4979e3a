"""14. Cold start: the first 10 requests of a freshly started service (library defaults),
on the host-shaped workload; how many time out (answered empty, or from the facts at
hand, at the end of the timeout). Measured for a service started lazily (on its first
request) and for one opened with ``await start()``; each with the requests one at a
time, and with 8 in flight, as the host-shaped run sends them."""

from __future__ import annotations

from typing import Any

from benchmarks.host import HostRequests, seed_host
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.stats import percentile
from benchmarks.workloads import DRAIN_TIMEOUT, Database, timeouts_between
from coda_memory import MemoryService

#: Requests measured after each start.
FIRST_REQUESTS = 10


async def _first_requests(
    db: Database, requests: HostRequests, services: int, started: bool
) -> list[dict[str, Any]]:
    """The first requests of fresh services, one at a time: per request, its latency
    and how many timed out."""
    by_request: list[list[float]] = [[] for _ in range(FIRST_REQUESTS)]
    empty = [0] * FIRST_REQUESTS
    timeouts = [0] * FIRST_REQUESTS
    for _ in range(services):
        service = MemoryService.from_url(db.url)
        try:
            if started:
                await service.start()
            for n in range(FIRST_REQUESTS):
                before = service.stats()
                seconds, was_empty = await requests.one(service)
                by_request[n].append(seconds * 1000)
                empty[n] += was_empty
                timeouts[n] += timeouts_between(before, service.stats())
            await service.drain(DRAIN_TIMEOUT)
        finally:
            await service.close()
    return [
        {
            "start": "await start()" if started else "lazy",
            "in_flight": 1,
            "request": n + 1,
            "services": services,
            "p50_ms": percentile(ms, 50),
            "max_ms": max(ms),
            "empty": empty[n],
            "timeouts": timeouts[n],
        }
        for n, ms in enumerate(by_request)
    ]


async def _first_requests_together(
    db: Database, requests: HostRequests, services: int, started: bool, in_flight: int
) -> dict[str, Any]:
    """The first requests of fresh services, ``in_flight`` at a time."""
    seconds: list[float] = []
    empty = timeouts = 0
    for _ in range(services):
        service = MemoryService.from_url(db.url)
        try:
            if started:
                await service.start()
            before = service.stats()
            seen = await requests.run(service, FIRST_REQUESTS, in_flight)
            timeouts += timeouts_between(before, service.stats())
            seconds += seen.seconds
            empty += seen.empty
            await service.drain(DRAIN_TIMEOUT)
        finally:
            await service.close()
    ms = [s * 1000 for s in seconds]
    return {
        "start": "await start()" if started else "lazy",
        "in_flight": in_flight,
        "request": f"1-{FIRST_REQUESTS}",
        "services": services,
        "p50_ms": percentile(ms, 50),
        "max_ms": max(ms),
        "empty": empty,
        "timeouts": timeouts,
    }


async def cold_start_section(db: Database, ctx: Context) -> None:
    sizes, report = ctx.sizes, ctx.report
    identities = await seed_host(db, "cs", 50, 200)
    requests = HostRequests(identities, 200, seed=94)
    rows: list[dict[str, Any]] = []
    first = f"the first {FIRST_REQUESTS} requests of {sizes.cold_starts} fresh services"
    for started in (False, True):
        measured = await _first_requests(db, requests, sizes.cold_starts, started)
        together = await _first_requests_together(
            db, requests, sizes.cold_starts, started, sizes.host_concurrency
        )
        rows += [*measured, together]
        how = measured[0]["start"]
        timeouts = sum(row["timeouts"] for row in measured)
        report.add(
            Figure(
                "14 cold start",
                f"{how}: timed-out loads (empty or from the facts at hand) in {first}, "
                "one at a time",
                timeouts,
                "",
                target="0" if started else None,
                met=timeouts == 0 if started else None,
                details={
                    "empty": sum(row["empty"] for row in measured),
                    "per_request": measured,
                },
            )
        )
        report.add(
            Figure(
                "14 cold start",
                f"{how}: timed-out loads (empty or from the facts at hand) in {first}, "
                f"{sizes.host_concurrency} in flight",
                together["timeouts"],
                "",
                target="0" if started else None,
                met=together["timeouts"] == 0 if started else None,
                details=together,
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
