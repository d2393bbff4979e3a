"""The profiling pass: round trips, where the time goes, variants, single pieces."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.environment import LoadMonitor, command_line, git_commit, machine
from benchmarks.host import HostRequests, seed_host
from benchmarks.profiling.pieces import micro_costs
from benchmarks.profiling.sampling import profiled, profiled_work
from benchmarks.profiling.statements import DriverRecorder, log_offset, recorded, server_times
from benchmarks.profiling.variants import collections, interleaved
from benchmarks.server import start_server
from benchmarks.sizes import Sizes
from benchmarks.workloads import DRAIN_TIMEOUT, Database, names, open_database, prepare_profile
from coda_memory import MemoryService

log = logging.getLogger("bench")


async def profile_run(args: argparse.Namespace, sizes: Sizes) -> dict[str, Any]:
    server = start_server(args.url, args.data_dir, args.pgbench)
    base = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    count = 60 if sizes.mode == "quick" else 200
    rng = random.Random(9)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M")
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"identities_per_pass": count}
    admin = await server.connect()
    result["postgres_version"] = str(await admin.fetchval("SHOW server_version"))
    await admin.close()
    monitor = LoadMonitor(server.postmaster_pid())
    monitor.start()
    db = await open_database(server, "profile", base)
    try:
        groups = {
            name: names(f"p-{name}", count)
            for name in ("rec", "pyi", "ping", "noping", "gc", "freeze", "micro")
        }
        for identities in groups.values():
            await prepare_profile(db, identities, 200, 50, 5, rng)
        loads = {name: names(f"pl-{name}", count) for name in ("rec", "pyi", "new")}
        await prepare_profile(db, loads["rec"] + loads["pyi"], 200, 0, 1, rng)
        await prepare_profile(db, loads["new"], 200, 3, 1, rng)
        if server.embedded_dir is not None:
            await db.conn.execute(f'ALTER DATABASE "{db.name}" SET log_min_duration_statement = 0')
        await db.service.close()
        db.service = MemoryService.from_url(db.url, clock=db.clock, pool_size=sizes.workers)
        service = db.service
        warm = names("p-warm", 3)
        await prepare_profile(db, warm, 200, 50, 5, rng)
        for identity in warm:
            await service.consolidate(identity)
            await service.load_memory(identity)

        recorder = DriverRecorder()
        recorder.install()
        passes: dict[str, Any] = {}
        for name, operation, identities in (
            (
                "consolidate (typical: 200 facts, 50 new in 5 sessions)",
                service.consolidate,
                groups["rec"],
            ),
            ("load_memory (200 facts, none new)", service.load_memory, loads["rec"]),
            ("load_memory (200 facts, 3 new)", service.load_memory, loads["new"]),
        ):
            before = log_offset(server)
            stats = await recorded(recorder, operation, identities)
            await asyncio.sleep(0.2)  # let the server flush its log
            server_ms = (
                server_times(server.log_file, before, log_offset(server))
                if server.log_file is not None
                else None
            )
            passes[name] = {
                "wall_ms_per_run": stats.wall_ms,
                "round_trips_per_run": stats.round_trips,
                "driver_ms_per_run": stats.driver_ms,
                "server_ms_per_run": None
                if server_ms is None
                else sum(server_ms.values()) / stats.runs,
                "statements": stats.rows(server_ms),
            }
            log.info(
                "  %s: %.2f ms, %.1f round trips, %.2f ms in driver calls",
                name,
                stats.wall_ms,
                stats.round_trips,
                stats.driver_ms,
            )
        result["passes"] = passes
        if server.embedded_dir is not None:
            await db.conn.execute(f'ALTER DATABASE "{db.name}" RESET log_min_duration_statement')
        await service.close()
        db.service = service = MemoryService.from_url(
            db.url, clock=db.clock, pool_size=sizes.workers
        )
        for identity in warm:
            await service.load_memory(identity)

        profiles: dict[str, Any] = {}
        for name, operation, identities in (
            ("consolidate", service.consolidate, groups["pyi"]),
            ("load_memory", service.load_memory, loads["pyi"]),
        ):
            path = args.out / f"profile-{stamp}-{sizes.mode}-{name}.txt"
            profiles[name] = await profiled(operation, identities, path)
        profiles[f"host-shaped, {sizes.host_concurrency} in flight, per request"] = await _host(
            db, sizes, args.out / f"profile-{stamp}-{sizes.mode}-host.txt"
        )
        result["sampling"] = profiles

        pinging, trusting = (
            MemoryService.from_url(
                db.url, clock=db.clock, pool_size=sizes.workers, pool_pre_ping=ping
            )
            for ping in (True, False)
        )
        try:
            for identity in warm:
                await pinging.load_memory(identity)
                await trusting.load_memory(identity)
            variants = await interleaved(
                {
                    "pool_pre_ping=True": (pinging.consolidate, groups["ping"]),
                    "pool_pre_ping=False": (trusting.consolidate, groups["noping"]),
                }
            )
        finally:
            await pinging.close()
            await trusting.close()
        result["garbage_collector"] = {
            "collector on (as configured)": await collections(service.consolidate, groups["gc"]),
            "after gc.freeze()": await collections(
                service.consolidate, groups["freeze"], freeze=True
            ),
        }
        result["variants"] = variants
        result["micro"] = await micro_costs(db, groups["micro"][0], loads["rec"][0])
    finally:
        monitor.stop()
        await db.close()
        if not args.keep:
            await server.drop_databases()
    result["other_processes_cpu_cores_mean"] = (
        monitor.foreign_seconds / monitor.elapsed if monitor.elapsed else 0.0
    )
    result["stamp"] = stamp
    return result


async def _host(db: Database, sizes: Sizes, out: Path) -> dict[str, Any]:
    """The host-shaped run (the host section's workload: each request emits a session's
    observations for a random identity, then loads it; library defaults, started)
    under the sampling profiler: where a request's CPU goes in this process, the
    writer's share included."""
    identities = await seed_host(db, "ph", sizes.host_identities, sizes.host_facts)
    requests = HostRequests(identities, sizes.host_facts, seed=17)
    service = MemoryService.from_url(db.url)
    try:
        await service.start()
        await requests.run(service, sizes.host_requests // 4, sizes.host_concurrency)  # warm

        async def run() -> None:
            await requests.run(service, sizes.host_requests, sizes.host_concurrency)
            await service.drain(DRAIN_TIMEOUT)  # what the writer has left of them counts too

        return await profiled_work(run, sizes.host_requests, out)
    finally:
        await service.close()


def profile_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# coda-memory profile ({result['mode']})",
        "",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- machine: {result['machine']['cores']} cores, PostgreSQL "
        f"{result['machine'].get('postgres_version', '?')}, Python {result['machine']['python']}",
        f"- commit: {result['commit']}",
        f"- identities per pass: {result['identities_per_pass']}",
        f"- other processes on the machine used {result['other_processes_cpu_cores_mean']:.2f} "
        "CPU cores on average meanwhile",
        "",
        "## Round trips and time per statement",
    ]
    for name, data in result["passes"].items():
        server = data["server_ms_per_run"]
        lines += [
            "",
            f"### {name}",
            "",
            f"wall {data['wall_ms_per_run']:.2f} ms per run; {data['round_trips_per_run']:.1f} "
            f"round trips; {data['driver_ms_per_run']:.2f} ms inside driver calls"
            + ("" if server is None else f"; {server:.2f} ms of it executing on the server")
            + f"; {data['wall_ms_per_run'] - data['driver_ms_per_run']:.2f} ms of Python outside "
            "driver calls.",
            "",
            "| statement | calls/run | client ms/call | client ms/run | server ms/run |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for row in data["statements"]:
            server_cell = (
                "" if "server_ms_per_run" not in row else f"{row['server_ms_per_run']:.3f}"
            )
            lines.append(
                f"| {row['statement']} | {row['calls_per_run']:.2f} | "
                f"{row['client_ms_per_call']:.3f} | {row['client_ms_per_run']:.3f} | "
                f"{server_cell} |"
            )
    lines += ["", "## Where the time goes"]
    for name, data in result["sampling"].items():
        wall, cpu = data["wall_ms_per_run"], data["cpu_ms_per_run"]
        lines += [
            "",
            f"### {name}: {wall:.2f} ms wall per run, {cpu:.2f} ms of it Python CPU, "
            f"{wall - cpu:.2f} ms waiting",
            "",
            f"Sampled with {data['sampler']}: `{data['tree']}`. CPU time by the leaf-most "
            "frame's library:",
            "",
            "| where | ms/run | share of wall |",
            "| --- | ---: | ---: |",
            f"| waiting (event loop idle: network + server) | {wall - cpu:.3f} | "
            f"{100 * (wall - cpu) / wall:.0f}% |",
        ]
        for label, ms in data["categories_ms_per_run"].items():
            lines.append(f"| {label} | {ms:.3f} | {100 * ms / wall:.0f}% |")
        lines += [
            "",
            "| function (inclusive CPU) | ms/run | share of wall |",
            "| --- | ---: | ---: |",
        ]
        for label, ms in data["functions_ms_per_run"].items():
            if ms > 0:
                lines.append(f"| {label} | {ms:.3f} | {100 * ms / wall:.0f}% |")
    lines += [
        "",
        "## Variants (typical consolidation, alternating blocks of 10)",
        "",
        "| variant | p50 ms | p90 ms | p99 ms | max ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, data in result["variants"].items():
        lines.append(
            f"| {name} | {data['p50_ms']:.2f} | {data['p90_ms']:.2f} | {data['p99_ms']:.2f} | "
            f"{data['max_ms']:.2f} |"
        )
    lines += [
        "",
        "## The garbage collector (typical consolidation, every collection timed)",
        "",
        "| variant | tracked objects | gen0/1/2 per run | full collections: n, mean, max ms "
        "| p50 ms | p99 ms | p99 ms without a full collection |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for name, data in result["garbage_collector"].items():
        per_run = "/".join(f"{v:.2f}" for v in data["collections_per_run"].values())
        lines.append(
            f"| {name} | {data['tracked_objects']:,} | {per_run} | {data['full_collections']}, "
            f"{data['full_collection_ms_mean']:.1f}, {data['full_collection_ms_max']:.1f} | "
            f"{data['p50_ms']:.2f} | {data['p99_ms']:.2f} | "
            f"{data['p99_ms_of_runs_without_full_collection']:.2f} |"
        )
    lines += ["", "## Single pieces", "", "| piece | value |", "| --- | ---: |"]
    for name, value in result["micro"].items():
        lines.append(f"| {name} | {value:.3f} |")
    lines.append("")
    return "\n".join(lines)


def profile_main(args: argparse.Namespace, sizes: Sizes) -> int:
    commit = git_commit()
    result = asyncio.run(profile_run(args, sizes))
    result["commit"] = commit
    result.update(
        {
            "mode": sizes.mode,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": command_line(),
            "machine": machine({"postgres_version": result.pop("postgres_version", "?")}),
        }
    )
    stem = f"profile-{result['stamp']}-{sizes.mode}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    text = profile_markdown(result)
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"latest-profile-{sizes.mode}.md").write_text(text)
    log.info("wrote %s", args.out / f"{stem}.md")
    return 0
