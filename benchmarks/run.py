"""A benchmark run: pgbench, then every selected section on its database, then pgbench
again; the result as the JSON that ``report`` writes."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from benchmarks.environment import LoadMonitor, command_line, git_commit, machine
from benchmarks.pgbench import pgbench_again, pgbench_baselines
from benchmarks.report import Report
from benchmarks.section import Context, Section
from benchmarks.sections import OPTIONS, SECTIONS
from benchmarks.server import start_server
from benchmarks.sizes import Sizes
from benchmarks.workloads import Database, open_database

log = logging.getLogger("bench")


def selected(only: str | None) -> set[str]:
    """The ``--only`` names chosen (all of them by default); an unknown one is an error."""
    if not only:
        return set(OPTIONS)
    chosen = {name.strip() for name in only.split(",") if name.strip()}
    unknown = chosen - set(OPTIONS)
    if unknown:
        raise SystemExit(
            f"unknown sections: {', '.join(sorted(unknown))} (of {', '.join(OPTIONS)})"
        )
    return chosen


async def run(args: argparse.Namespace, sizes: Sizes, report: Report) -> dict[str, Any]:
    server = start_server(args.url, args.data_dir, args.pgbench)
    only = selected(args.only)
    base = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    admin = await server.connect()
    version = str(await admin.fetchval("SHOW server_version"))
    await admin.close()
    log.info("server: PostgreSQL %s (%s)", version, "embedded" if server.embedded_dir else "url")
    info: dict[str, Any] = {
        "postgres_version": version,
        "embedded": server.embedded_dir is not None,
    }
    monitor = LoadMonitor(server.postmaster_pid())
    monitor.start()
    try:
        log.info("baseline: pgbench")
        with monitor.section(report, "pgbench"):
            one, eight = await pgbench_baselines(server, sizes, report)
        ctx = Context(sizes=sizes, report=report, one=one, eight=eight, base=base, server=server)
        chosen = [section for section in SECTIONS if section.selected_by & only]
        for database in dict.fromkeys(section.database for section in chosen):
            db: Database = await open_database(server, database, base, pool_size=sizes.workers)
            try:
                for section in chosen:
                    if section.database == database:
                        log.info("section: %s", section.title)
                        with monitor.section(report, section.name):
                            await _run_section(section, db, ctx)
            finally:
                await db.close()
        log.info("baseline: pgbench again")
        with monitor.section(report, "pgbench_end"):
            await pgbench_again(server, sizes, report, (one, eight))
    finally:
        monitor.stop()
        if not args.keep:
            await server.drop_databases()
    info["other_processes_cpu_cores_mean"] = (
        monitor.foreign_seconds / monitor.elapsed if monitor.elapsed else 0.0
    )
    return info


async def _run_section(section: Section, db: Database, ctx: Context) -> None:
    """Run one section; one that fails is reported as failed (its figures so far kept)
    and the run goes on, so a long run still writes what the other sections measured."""
    try:
        await section.run(db, ctx)
    except Exception as error:
        log.exception("section %s failed", section.name)
        ctx.report.note(f"section {section.name} failed: {type(error).__name__}: {error}")
        ctx.report.failed.append(section.name)


def benchmark(args: argparse.Namespace, sizes: Sizes) -> dict[str, Any]:
    """Run the benchmark; the result, ready to be written."""
    report = Report()
    commit = git_commit()  # the code this run imports, whatever lands meanwhile
    started = time.perf_counter()
    date = datetime.now(UTC)
    info = asyncio.run(run(args, sizes, report))
    return {
        "mode": sizes.mode,
        # The sections asked for with --only (None: every section, a whole run).
        "only": sorted(selected(args.only)) if args.only else None,
        "date": date.isoformat(timespec="seconds"),
        "command": command_line(),
        "duration_s": time.perf_counter() - started,
        "commit": commit,
        "machine": machine(info),
        "sizes": asdict(sizes),
        "figures": [asdict(f) for f in report.figures],
        "tables": report.tables,
        "notes": report.notes,
        "failed_sections": report.failed,
        "timings": report.timings,
        "other_processes_cpu_cores": report.load,
        "stolen_cpu_cores": report.steal,
    }
