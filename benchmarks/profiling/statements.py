"""Profiling: every driver call timed and labelled by statement; the server's own times."""

from __future__ import annotations

import functools
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncpg.connection import Connection
from asyncpg.prepared_stmt import PreparedStatement

from benchmarks.server import Server
from benchmarks.workloads import SCHEMA
from coda_memory.postgres.tenancy import TENANT_SETTING
from coda_memory.postgres.unit import Statements

#: Statement labels, by the first pattern that matches the SQL text.
STATEMENT_LABELS: tuple[tuple[str, str], ...] = (
    (r"^BEGIN", "BEGIN"),
    (r"^COMMIT", "COMMIT"),
    (r"^ROLLBACK", "ROLLBACK"),
    (r"^;$", "pre-ping ';'"),
    (rf"set_config\('{re.escape(TENANT_SETTING)}'", "set the tenant (set_config)"),
    (r"set_config\('lock_timeout'|lock_timeout =", "set lock_timeout"),
    (r"set_config", "set_config (other settings)"),
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


@functools.cache
def named_statements() -> dict[str, str]:
    """The store's own named hot-path statements (``coda_memory/postgres/sql/*.sql``, as
    :class:`~coda_memory.postgres.unit.Statements` holds them), by their normalised SQL."""
    s = Statements.for_schema(SCHEMA)
    queries = (s.lock, s.ensure, s.new_first, s.new_since, s.facts, s.session_events, s.write)
    return {" ".join(q.text.split()): f"{q.name}.sql" for q in (*queries, s.peek)}


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
        for cls, name, original in (
            (Connection, "execute", Connection.execute),
            (Connection, "fetch", Connection.fetch),
            (Connection, "fetchrow", Connection.fetchrow),
            (Connection, "fetchval", Connection.fetchval),
            (Connection, "prepare", Connection.prepare),
            (Connection, "executemany", Connection.executemany),
            (Connection, "copy_records_to_table", Connection.copy_records_to_table),
            (Connection, "copy_to_table", Connection.copy_to_table),
        ):
            self._wrap(cls, name, original, prepared=False)
        for cls, name, original in (
            (PreparedStatement, "fetch", PreparedStatement.fetch),
            (PreparedStatement, "fetchrow", PreparedStatement.fetchrow),
            (PreparedStatement, "fetchval", PreparedStatement.fetchval),
            (PreparedStatement, "executemany", PreparedStatement.executemany),
        ):
            self._wrap(cls, name, original, prepared=True)

    def _wrap(self, cls: type, name: str, original: Callable[..., Any], *, prepared: bool) -> None:
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


def server_entries(log_file: Path, start: int, end: int) -> list[tuple[float, str]]:
    """The server log's ``log_min_duration_statement`` lines between two offsets, as
    (milliseconds, statement label): one per parse, bind and execute that took as long."""
    with log_file.open("rb") as handle:
        handle.seek(start)
        text = handle.read(end - start).decode(errors="replace")
    entries: list[tuple[float, str]] = []
    current: tuple[float, list[str]] | None = None

    def close() -> None:
        if current is not None:
            entries.append((current[0], statement_label("\n".join(current[1]))))

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
    return entries


def server_times(log_file: Path, start: int, end: int) -> dict[str, float]:
    """Server-side milliseconds by statement label, from the server log's
    ``log_min_duration_statement = 0`` lines between two offsets (parse + bind + execute)."""
    totals: dict[str, float] = defaultdict(float)
    for milliseconds, label in server_entries(log_file, start, end):
        totals[label] += milliseconds
    return dict(totals)


def log_offset(server: Server) -> int:
    path = server.log_file
    return path.stat().st_size if path is not None and path.exists() else 0
