"""The pgbench baselines: TPC-B-like transactions with 1 and 8 clients."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.environment import CpuMeter
from benchmarks.report import Report
from benchmarks.server import Server, quiesce
from benchmarks.sizes import Sizes
from benchmarks.stats import percentile

log = logging.getLogger("bench")


@dataclass(frozen=True)
class PgbenchResult:
    clients: int
    seconds: int
    transactions: int
    tps: float
    latency_avg_ms: float
    p50_ms: float
    p99_ms: float
    per_statement_ms: dict[str, float]
    #: The server's CPU per transaction (None: a server given by --url, not seen).
    server_cpu_ms_per_tx: float | None = None


def run_pgbench(server: Server, database: str, clients: int, seconds: int) -> PgbenchResult:
    """pgbench's TPC-B-like script; percentiles from ``--log`` (one line per transaction)."""
    env = server.pgbench_env()
    with tempfile.TemporaryDirectory(prefix="coda-bench-pgbench-") as logs:
        command = [
            server.pgbench,
            "-c",
            str(clients),
            "-j",
            str(min(clients, os.cpu_count() or 1)),
            "-T",
            str(seconds),
            "-r",
            "--log",
            f"--log-prefix={logs}/tx",
            database,
        ]
        with CpuMeter(server.postmaster_pid()) as cpu:
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        latencies: list[float] = []
        for path in Path(logs).iterdir():
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) >= 3:
                    latencies.append(int(parts[2]) / 1000)  # microseconds -> ms
    out = done.stdout
    tps = float(_search(r"tps = ([\d.]+) \(without", out))
    average = float(_search(r"latency average = ([\d.]+) ms", out))
    statements: dict[str, float] = {}
    for match in re.finditer(
        r"^\s+([\d.]+)\s+\d+\s+(BEGIN|UPDATE \w+|SELECT|INSERT|END)", out, re.M
    ):
        statements[match.group(2)] = float(match.group(1))
    return PgbenchResult(
        clients=clients,
        seconds=seconds,
        transactions=len(latencies),
        tps=tps,
        latency_avg_ms=average,
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        per_statement_ms=statements,
        server_cpu_ms_per_tx=(
            None
            if cpu.server_seconds is None or not latencies
            else cpu.server_seconds * 1000 / len(latencies)
        ),
    )


def _search(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    if match is None:
        raise RuntimeError(f"pgbench output has no {pattern!r}:\n{text}")
    return match.group(1)


def pgbench_scale(sizes: Sizes) -> int:
    """TPC-B's scale: at least the clients. At scale 1 every transaction updates the one
    branch row, and 8 clients mostly waited for each other's lock on it (about half the
    tps of scale 8 here), which doubled every ratio to "pgbench -c8 tps"."""
    return max(1, sizes.workers)


async def pgbench_baselines(
    server: Server, sizes: Sizes, report: Report
) -> tuple[PgbenchResult, PgbenchResult]:
    name, _ = await server.create_database("pgbench")
    env = server.pgbench_env()
    scale = str(pgbench_scale(sizes))
    subprocess.run(
        [server.pgbench, "-i", "-s", scale, "-q", name], env=env, capture_output=True, check=True
    )
    admin = await server.connect(name)
    try:
        await quiesce(admin)
    finally:
        await admin.close()
    # A short run first: the measured ones then start with warm caches and connections.
    await asyncio.to_thread(run_pgbench, server, name, 1, max(1, sizes.pgbench_seconds // 3))
    one = await asyncio.to_thread(run_pgbench, server, name, 1, sizes.pgbench_seconds)
    eight = await asyncio.to_thread(run_pgbench, server, name, sizes.workers, sizes.pgbench_seconds)
    for result in (one, eight):
        record_pgbench(report, result, "start")
    return one, eight


def record_pgbench(report: Report, result: PgbenchResult, when: str) -> None:
    report.tables.setdefault("pgbench", []).append({"when": when, **asdict(result)})
    log.info(
        "  pgbench -c %d (%s): %.0f tps, latency avg %.3f ms, p50 %.3f ms, p99 %.3f ms",
        result.clients,
        when,
        result.tps,
        result.latency_avg_ms,
        result.p50_ms,
        result.p99_ms,
    )


async def pgbench_again(
    server: Server, sizes: Sizes, report: Report, first: tuple[PgbenchResult, PgbenchResult]
) -> None:
    """pgbench once more at the end. Its latency on this kind of machine moves between
    runs (how the scheduler places pgbench and its backend on the cores), so the pgbench
    baselines become the mean of the start and the end, and ratios and targets follow."""
    name = next(n for n in server.created if n.endswith("_pgbench"))
    admin = await server.connect(name)
    try:
        await quiesce(admin)
    finally:
        await admin.close()
    one, eight = first
    again_one = await asyncio.to_thread(run_pgbench, server, name, 1, sizes.pgbench_seconds)
    again_eight = await asyncio.to_thread(
        run_pgbench, server, name, sizes.workers, sizes.pgbench_seconds
    )
    record_pgbench(report, again_one, "end")
    record_pgbench(report, again_eight, "end")
    rebase(report, "pgbench -c1 p50", (one.p50_ms + again_one.p50_ms) / 2)
    rebase(report, "pgbench -c1 p99", (one.p99_ms + again_one.p99_ms) / 2)
    rebase(report, f"pgbench -c{sizes.workers} tps", (eight.tps + again_eight.tps) / 2)
    rebase(report, "pgbench -c1 tps", (one.tps + again_one.tps) / 2)
    report.note(
        f"pgbench -c1 p50 was {one.p50_ms:.3f} ms at the start and {again_one.p50_ms:.3f} ms "
        f"at the end; -c1 {one.tps:,.0f} and {again_one.tps:,.0f} tps; -c{sizes.workers} "
        f"{eight.tps:,.0f} and {again_eight.tps:,.0f} tps (scale {pgbench_scale(sizes)}). "
        "Baselines are the means."
    )


def rebase(report: Report, baseline_name: str, value: float) -> None:
    """Give every figure measured against ``baseline_name`` the new baseline ``value``,
    with its ratio and (for a target on the ratio) its verdict."""
    for figure in report.figures:
        if figure.baseline_name != baseline_name or figure.ratio is None:
            continue
        figure.baseline = value
        figure.baseline_name = f"{baseline_name} (mean)"
        figure.ratio = figure.value / value
        rule = re.match(r"([<>]=) ([\d.]+)x", figure.target or "")
        if rule:
            limit = float(rule.group(2))
            figure.met = figure.ratio <= limit if rule.group(1) == "<=" else figure.ratio >= limit
