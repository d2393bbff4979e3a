"""8 and 9. The host-shaped run (issue 9): 200 identities with 200 facts each; each
request emits one session's 10 observations for a random identity, then calls
load_memory, through a service with the library's defaults. 8 requests in flight in one
process, then 1 at a time; the event loop's lag meanwhile, from a 1 ms ticker task.
Then the 8 concurrent requests again in a host that froze its garbage collector after
startup (``gc.freeze()``, see the README): a full collection of a process that imports
SQLAlchemy otherwise pauses the loop for tens of milliseconds. And once more on uvloop,
the event loop uvicorn picks by itself when it is installed (``uvicorn[standard]``): a
service of its own on a uvloop loop in a thread, while the run's loop waits for it.
Targets are judged on the standard library's loop, the library's default.

Each concurrent row counts the statements that were slow on the server meanwhile
(``benchmarks.slow_statements``), beside the loads over the 25 ms target. Each row also
has the CPU per request in this process and on the server (``CpuMeter``): beside the
server's CPU per pgbench transaction, and, for the 8 in flight, both together beside
what the throughput target leaves per request of the machine's cores."""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any

import uvloop

from benchmarks.environment import CpuMeter
from benchmarks.host import HostRequests, LagTicker, Requests, seed_host
from benchmarks.logcount import counted_logs
from benchmarks.profiling.statements import log_offset
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.server import Server
from benchmarks.slow_statements import (
    SLOW_KEY,
    SLOW_SERVER_MS,
    slow_since,
    slow_statements_logged,
)
from benchmarks.stats import latency_summary
from benchmarks.workloads import DRAIN_TIMEOUT, Database, timeouts_between
from coda_memory import MemoryService

#: The target of a load under concurrency: loads over it are counted.
SLOW_LOAD_MS = 25


def _row(mode: str, seen: Requests, timeouts: int, errors: int) -> dict[str, Any]:
    return {
        "mode": mode,
        **latency_summary(seen.seconds),
        f"loads_over_{SLOW_LOAD_MS}ms": sum(s * 1000 > SLOW_LOAD_MS for s in seen.seconds),
        "empty": seen.empty,
        "timeouts": timeouts,
        "errors": errors,
        "requests_per_s": seen.rate,
        "seconds": seen.wall,
    }


async def _measured(
    service: MemoryService,
    requests: HostRequests,
    ticker: LagTicker,
    mode: str,
    count: int,
    concurrency: int,
    server: Server,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``count`` requests, ``concurrency`` in flight: the mode's row, and the ticker's lag
    meanwhile (it ticks only with requests in flight together; {} otherwise)."""
    before = service.stats()
    log_start = log_offset(server)
    if concurrency > 1:
        ticker.start()
    with counted_logs() as logs, CpuMeter(server.postmaster_pid()) as cpu:
        seen = await requests.run(service, count, concurrency)
    lag = ticker.summary() if concurrency > 1 else {}
    await ticker.stop()
    after = service.stats()
    timeouts = timeouts_between(before, after)
    errors = after.load_errors - before.load_errors
    row = _row(mode, seen, timeouts, errors) | {"warnings_logged": logs.lines}
    row["process_cpu_ms_per_request"], row["server_cpu_ms_per_request"] = cpu.per_item_ms(
        seen.count
    )
    return row | slow_since(server, log_start), lag


def _on_uvloop(
    url: str,
    requests: HostRequests,
    count: int,
    concurrency: int,
    mode: str,
    server: Server,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``count`` requests, ``concurrency`` in flight, through a new service on a new
    uvloop loop (in the calling thread, which it blocks): the row and the ticker's lag."""

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        service = MemoryService.from_url(url)
        ticker = LagTicker()
        try:
            await requests.run(service, 4 * concurrency, concurrency)  # as on the other loop
            measured = await _measured(service, requests, ticker, mode, count, concurrency, server)
            await service.drain(DRAIN_TIMEOUT)
            return measured
        finally:
            await ticker.stop()
            await service.close()

    return uvloop.run(run())


async def host_section(db: Database, ctx: Context) -> None:
    sizes = ctx.sizes
    identities = await seed_host(db, "h", sizes.host_identities, sizes.host_facts)
    requests = HostRequests(identities, sizes.host_facts, seed=92)
    async with slow_statements_logged(db.conn, ctx.server):
        rows, lag, frozen_lag, uvloop_lag = await _runs(db, ctx, requests)
    _report(ctx, rows, lag, frozen_lag, uvloop_lag)


async def _runs(
    db: Database,
    ctx: Context,
    requests: HostRequests,
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The four runs' rows, then the ticker's lag in each of the concurrent ones."""
    sizes = ctx.sizes
    service = MemoryService.from_url(db.url)
    ticker = LagTicker()
    rows: list[dict[str, Any]] = []
    lag: dict[str, Any] = {}
    frozen_lag: dict[str, Any] = {}
    concurrent_mode = f"{sizes.host_concurrency} concurrent"
    try:
        await requests.run(service, 4 * sizes.host_concurrency, sizes.host_concurrency)
        for mode, count, concurrency, frozen in (
            (concurrent_mode, sizes.host_requests, sizes.host_concurrency, False),
            ("1 at a time", sizes.host_sequential_requests, 1, False),
            (f"{concurrent_mode}, gc.freeze()", sizes.host_requests, sizes.host_concurrency, True),
        ):
            if frozen:
                gc.collect()
                gc.freeze()
            row, seen_lag = await _measured(
                service, requests, ticker, mode, count, concurrency, ctx.server
            )
            if frozen:
                gc.unfreeze()
                frozen_lag = seen_lag
            elif concurrency > 1:
                lag = seen_lag
            rows.append(row)
        await service.drain(DRAIN_TIMEOUT)
    finally:
        await ticker.stop()
        await service.close()
    uvloop_row, uvloop_lag = await asyncio.to_thread(
        _on_uvloop,
        db.url,
        requests,
        sizes.host_requests,
        sizes.host_concurrency,
        f"{concurrent_mode}, uvloop",
        ctx.server,
    )
    rows.append(uvloop_row)
    return rows, lag, frozen_lag, uvloop_lag


def _report(
    ctx: Context,
    rows: list[dict[str, Any]],
    lag: dict[str, Any],
    frozen_lag: dict[str, Any],
    uvloop_lag: dict[str, Any],
) -> None:
    sizes, report = ctx.sizes, ctx.report
    report.tables["host"] = rows
    concurrent, sequential, frozen_row, uvloop_row = rows
    section = "8 host-shaped"
    report.add(
        Figure(
            section,
            f"{concurrent['mode']}: empty loads of {concurrent['n']:,}",
            concurrent["empty"],
            "",
            None,
            None,
            None,
            "0 (in >= 1,600 requests)",
            concurrent["empty"] == 0 and concurrent["n"] >= 1_600,
            concurrent,
        )
    )
    report.add(
        Figure(
            section,
            f"{frozen_row['mode']}: empty loads of {frozen_row['n']:,}",
            frozen_row["empty"],
            "",
            details=frozen_row,
        )
    )
    report.add(
        Figure(
            section,
            f"{uvloop_row['mode']}: empty loads of {uvloop_row['n']:,}",
            uvloop_row["empty"],
            "",
            details=uvloop_row,
        )
    )
    for row in (concurrent, sequential, frozen_row, uvloop_row):
        report.add(Figure(section, f"{row['mode']}: load_memory p50", row["p50_ms"], "ms"))
        report.add(
            Figure(
                section,
                f"{row['mode']}: load_memory p99",
                row["p99_ms"],
                "ms",
                target="<= 25 ms" if row is concurrent else None,
                met=row["p99_ms"] <= 25 if row is concurrent else None,
            )
        )
    for row in (concurrent, frozen_row, uvloop_row):
        slow = row[SLOW_KEY]
        if slow is not None:
            report.add(
                Figure(
                    section,
                    f"{row['mode']}: statements of {SLOW_SERVER_MS} ms or more on the server "
                    f"(loads over {SLOW_LOAD_MS} ms: {row[f'loads_over_{SLOW_LOAD_MS}ms']})",
                    slow,
                    "",
                    details={
                        "server_max_ms": row["server_max_ms"],
                        **row["server_slow_statements"],
                    },
                )
            )
    for row, pgbench in (
        (concurrent, ctx.eight),
        (sequential, ctx.one),
        (frozen_row, ctx.eight),
        (uvloop_row, ctx.eight),
    ):
        clients = 1 if row is sequential else sizes.workers
        report.add(
            Figure(
                section,
                f"{row['mode']}: requests/s",
                row["requests_per_s"],
                "/s",
                pgbench.tps,
                f"pgbench -c{clients} tps",
                row["requests_per_s"] / pgbench.tps,
                ">= 0.25x pgbench tps" if row is concurrent else None,
                row["requests_per_s"] >= 0.25 * pgbench.tps if row is concurrent else None,
            )
        )
    _cpu_figures(ctx, concurrent, sequential)
    report.tables["event_loop_lag"] = [
        {"during": concurrent["mode"], **lag},
        {"during": frozen_row["mode"], **frozen_lag},
        {"during": uvloop_row["mode"], **uvloop_lag},
    ]
    for name, key, limit in (("p99", "p99_ms", 5.0), ("max", "max_ms", 20.0)):
        report.add(
            Figure(
                "9 event-loop lag",
                f"1 ms ticker lag {name}, {concurrent['mode']}",
                lag[key],
                "ms",
                target=f"<= {limit:g} ms",
                met=lag[key] <= limit,
                details=lag,
            )
        )
        for row, lags in ((frozen_row, frozen_lag), (uvloop_row, uvloop_lag)):
            report.add(
                Figure(
                    "9 event-loop lag",
                    f"1 ms ticker lag {name}, {row['mode']}",
                    lags[key],
                    "ms",
                    details=lags,
                )
            )


def _cpu_figures(ctx: Context, concurrent: dict[str, Any], sequential: dict[str, Any]) -> None:
    """CPU per request, in this process and on the server, beside the server's CPU per
    pgbench transaction; and what the throughput target leaves of the machine's cores
    per request: a run whose CPU per request is over it cannot reach the target on this
    machine, whatever the scheduling."""
    sizes, report, section = ctx.sizes, ctx.report, "8 host-shaped"
    for row, pgbench, clients in (
        (concurrent, ctx.eight, sizes.workers),
        (sequential, ctx.one, 1),
    ):
        report.add(
            Figure(
                section,
                f"{row['mode']}: CPU per request, this process",
                row["process_cpu_ms_per_request"],
                "ms",
            )
        )
        server_ms = row["server_cpu_ms_per_request"]
        if server_ms is not None and pgbench.server_cpu_ms_per_tx:
            report.add(
                Figure(
                    section,
                    f"{row['mode']}: CPU per request, the server",
                    server_ms,
                    "ms",
                    pgbench.server_cpu_ms_per_tx,
                    f"pgbench -c{clients} (start): server CPU per transaction",
                    server_ms / pgbench.server_cpu_ms_per_tx,
                )
            )
    server_ms = concurrent["server_cpu_ms_per_request"]
    if server_ms is None:
        return
    cores = os.cpu_count() or 1
    total = concurrent["process_cpu_ms_per_request"] + server_ms
    budget = cores * 1000 / (0.25 * ctx.eight.tps)
    report.add(
        Figure(
            section,
            f"{concurrent['mode']}: CPU per request, this process and the server",
            total,
            "ms",
            budget,
            f"{cores} cores' CPU per request at 0.25x pgbench -c{sizes.workers} tps (start)",
            total / budget,
            details={"most_requests_per_s_on_these_cores": cores * 1000 / total},
        )
    )


SECTION = Section(
    name="host",
    title="host-shaped run (8 concurrent and 1 at a time) with the event-loop lag",
    database="main",
    run=host_section,
    selected_by=frozenset({"host"}),
)
