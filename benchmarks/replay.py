"""The physical limit of one consolidation: its SQL, captured from the driver, replayed by
pgbench as a custom script with the same rows.

Every asyncpg call of one consolidation is recorded with its arguments. The script
inlines each argument as a literal cast to the parameter's type (so the server plans
the same statements with the same values), names a twin identity in place of the
captured one (the twin was seeded with the same facts and observations and never
consolidated, so every replay reads the same rows), and ends each transaction with
ROLLBACK instead of COMMIT (so the next replay finds the rows unchanged; the library
commits without waiting for the WAL flush, so what differs is the commit record).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from datetime import date, datetime
from pathlib import Path
from typing import Any

from asyncpg.connection import Connection

from benchmarks.server import Server
from benchmarks.stats import percentile

Call = tuple[str, tuple[Any, ...]]


class SqlCapture:
    """Records the SQL and arguments of every asyncpg ``Connection`` call while active."""

    METHODS: tuple[tuple[str, Callable[..., Awaitable[Any]]], ...] = (
        ("execute", Connection.execute),
        ("fetch", Connection.fetch),
        ("fetchrow", Connection.fetchrow),
        ("fetchval", Connection.fetchval),
    )

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def __enter__(self) -> SqlCapture:
        capture = self
        for name, original in self.METHODS:

            async def recorded(
                conn: Any, query: str, *args: Any, _original: Any = original, **kwargs: Any
            ) -> Any:
                capture.calls.append((query, args))
                return await _original(conn, query, *args, **kwargs)

            setattr(Connection, name, recorded)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self.METHODS:
            setattr(Connection, name, original)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _array(values: Sequence[Any]) -> str:
    items = []
    for value in values:
        if value is None:
            items.append("NULL")
        else:
            quoted = _text(value).replace("\\", "\\\\").replace('"', '\\"')
            items.append(f'"{quoted}"')
    return "{" + ",".join(items) + "}"


def literal(value: Any, type_schema: str, type_name: str) -> str:
    """``value`` as an escape-string literal cast to the parameter's type. Colons are
    written as ``\\x3a`` so that pgbench does not read ``:name`` as a variable."""
    cast = type_name if type_schema == "pg_catalog" else f'"{type_schema}".{type_name}'
    if value is None:
        return f"NULL::{cast}"
    text = _array(value) if isinstance(value, list | tuple) else _text(value)
    escaped = (
        text.replace("\\", "\\\\")
        .replace("'", "\\'")
        .replace(":", "\\x3a")
        .replace("\n", "\\n")
        .replace("\r", "\\r")
    )
    return f"E'{escaped}'::{cast}"


def _swap(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, list | tuple):
        return [_swap(v, old, new) for v in value]
    return value


def _parameter(values: Sequence[str], match: re.Match[str]) -> str:
    return values[int(match.group(1)) - 1]


async def render_script(conn: Any, calls: Sequence[Call], old: str, new: str) -> str:
    """The pgbench script replaying ``calls`` for identity ``new`` instead of ``old``."""
    lines: list[str] = []
    for query, args in calls:
        text = query.strip().rstrip(";")
        if re.fullmatch(r"COMMIT", text, re.I):
            text = "ROLLBACK"
        if args:
            parameters = (await conn.prepare(query)).get_parameters()
            values = [
                literal(_swap(arg, old, new), p.schema, p.name)
                for arg, p in zip(args, parameters, strict=True)
            ]
            text = re.sub(r"\$(\d+)", functools.partial(_parameter, values), text)
        lines.append(text + ";")
    return "\n".join(lines) + "\n"


def run_script(
    server: Server, database: str, script: str, seconds: int, clients: int = 1
) -> dict[str, Any]:
    """Run ``script`` with pgbench (prepared statements); tps and latency percentiles."""
    with tempfile.TemporaryDirectory(prefix="coda-bench-replay-") as scratch:
        path = Path(scratch) / "consolidation.sql"
        path.write_text(script)
        command = [
            server.pgbench,
            "-n",
            "-M",
            "prepared",
            "-c",
            str(clients),
            "-j",
            str(min(clients, os.cpu_count() or 1)),
            "-T",
            str(seconds),
            "-f",
            str(path),
            "--log",
            f"--log-prefix={scratch}/tx",
            database,
        ]
        done = subprocess.run(
            command, env=server.pgbench_env(), capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"pgbench replay failed:\n{done.stderr}\n{done.stdout}")
        latencies = [
            int(line.split()[2]) / 1000
            for log in Path(scratch).glob("tx*")
            for line in log.read_text().splitlines()
            if len(line.split()) >= 3
        ]
    tps = re.search(r"tps = ([\d.]+)", done.stdout)
    return {
        "transactions": len(latencies),
        "tps": float(tps.group(1)) if tps else float("nan"),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "statements": script.count(";\n"),
    }
