"""Row-level security: the typical consolidation with and without it, in the same run.

The run's service connects as a superuser, which bypasses row-level security; a second
service on the same database runs as a role granted ``app`` (``coda-memory grant app``),
which the policies apply to. Identities alternate between the two, so both see the same
server state. Both pay the round trip that sets the tenant; its cost is measured apart.
"""

from __future__ import annotations

import random
import secrets
import time

from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.stats import latency_summary
from benchmarks.workloads import Database, consumed, names, prepare_profile
from coda_memory import MemoryService
from coda_memory.postgres.tenancy import SET_TENANT, grant_script

#: Target: row-level security adds at most this share to the typical consolidation p50.
TARGET = 1.10


async def tenancy_section(db: Database, ctx: Context) -> None:
    report = ctx.report
    profile = next(p for p in ctx.sizes.profiles if p.name == "typical")
    if not await db.conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"):
        report.note("tenancy: skipped, the benchmark's role cannot create roles")
        return
    role = f"coda_bench_app_{secrets.token_hex(4)}"
    await db.conn.execute(f'CREATE ROLE "{role}" NOLOGIN')
    app = MemoryService.from_url(
        db.url, clock=db.clock, connect_args={"server_settings": {"role": role}}
    )
    try:
        await db.conn.execute(grant_script("app", role, "coda_memory"))
        identities = names("t-typical", 2 * profile.identities + 6)
        await prepare_profile(
            db, identities, profile.facts, profile.new, profile.sessions, random.Random(2)
        )
        without: list[float] = []
        with_rls: list[float] = []
        for n, identity in enumerate(identities):
            service, seconds = (db.service, without) if n % 2 == 0 else (app, with_rls)
            start = time.perf_counter()
            await service.consolidate(identity)
            if n >= 6:  # the first three of each warm the connections
                seconds.append(time.perf_counter() - start)
        real = await consumed(db.conn, identities, profile.new)
        tenant_rtt = await _tenant_round_trip(db)
    finally:
        await app.close()
        await db.conn.execute(f'DROP OWNED BY "{role}"')
        await db.conn.execute(f'DROP ROLE "{role}"')
    off, on = latency_summary(without), latency_summary(with_rls)
    ratio = on["p50_ms"] / off["p50_ms"]
    details = {"without": off, "with": on, "real_runs": real, "identities": len(identities)}
    report.tables.setdefault("tenancy", []).append({"variant": "superuser (no RLS)", **off})
    report.tables["tenancy"].append({"variant": "app role (RLS)", **on})
    report.add(
        Figure(
            "7 tenancy",
            "typical consolidation p50, app role (row-level security)",
            on["p50_ms"],
            "ms",
            off["p50_ms"],
            "superuser, no row-level security: p50",
            ratio,
            f"<= {TARGET:.2f}x without",
            ratio <= TARGET,
            details,
        )
    )
    report.add(
        Figure(
            "7 tenancy",
            "setting the tenant: one round trip, p50",
            tenant_rtt,
            "ms",
            off["p50_ms"],
            "typical consolidation p50",
            tenant_rtt / off["p50_ms"],
        )
    )


async def _tenant_round_trip(db: Database) -> float:
    """The median time of the statement that sets the tenant, in a transaction."""
    seconds: list[float] = []
    for _ in range(500):
        async with db.conn.transaction():
            start = time.perf_counter()
            await db.conn.execute(SET_TENANT, "t-typical-000000")
            seconds.append(time.perf_counter() - start)
    return latency_summary(seconds)["p50_ms"]


SECTION = Section(
    name="tenancy",
    title="row-level security",
    database="main",
    run=tenancy_section,
    selected_by=frozenset({"tenancy"}),
)
