"""16. The long run: the host-shaped requests of section 8, 8 in flight, round after round
on one database of their own (12 rounds of 1,600 in full), with the server's autovacuum
as it is: does a service slow down as its tables age (dead rows in the checkpoint and
fact rows that every request updates, observations kept for the retention, statistics
that fall behind)?

Each round is followed by a probe: requests one at a time (200 in full), whose latency
and CPU per request show the work a request costs without the queueing of 8 in flight
(on a machine that 8 in flight saturate, their latency is mostly the wait for the CPU,
and loads that time out add the CPU of their fallback answers). Per round: the 8 in
flight's requests per second, ``load_memory`` p50 and p99, empty and timed-out loads,
CPU per request (this process and the server) and the garbage collector's runs; the
probe's p50, p99 and CPU per request; the facts per identity (the requests add entities,
so an identity's facts grow towards ``max_facts``, and a load's work with them); the
facts the service dropped from those it keeps between requests to make room
(``known_facts``) and the reads of an identity's facts that none kept spared; and the
dead rows the server counts in the tables the requests write, their live observations
and their size.

Growing facts make a request dearer whatever the tables' age, so the age is measured
apart: after the last round the tables are rewritten (``VACUUM (FULL, ANALYZE)``: no dead
row, no bloat, fresh statistics) and one more round runs on the same identities and
facts. The last round against that one is what the age costs; the last round against
the first is what the whole run costs, the facts' growth included."""

from __future__ import annotations

from typing import Any

from benchmarks.environment import CpuMeter
from benchmarks.host import HostRequests, collector_pauses, seed_host
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.stats import latency_summary
from benchmarks.workloads import (
    DRAIN_TIMEOUT,
    SCHEMA,
    Database,
    facts_per_identity,
    open_database,
    timeouts_between,
)
from coda_memory import MemoryService

#: The tables a request writes (its observations, their rollup, the consolidation).
WRITTEN = (
    "observations",
    "ingest_batches",
    "checkpoints",
    "facts",
    "fact_events",
    "tool_users",
    "tool_daily",
    "tool_durations",
    "entity_users",
    "entity_daily",
    "domain_users",
    "domain_daily",
)


async def _table_state(db: Database) -> dict[str, Any]:
    """Dead and live rows the server counts in the written tables, and their size (MB)."""
    await db.conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = await db.conn.fetch(
        "SELECT relname, n_dead_tup, n_live_tup, autovacuum_count, autoanalyze_count, "
        "pg_total_relation_size(relid) AS bytes "
        "FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = ANY($2::text[])",
        SCHEMA,
        list(WRITTEN),
    )
    by_table = {r["relname"]: r for r in rows}
    return {
        "dead_rows": sum(r["n_dead_tup"] for r in rows),
        "dead_checkpoints": by_table["checkpoints"]["n_dead_tup"],
        "dead_facts": by_table["facts"]["n_dead_tup"],
        "observations": by_table["observations"]["n_live_tup"],
        "autovacuums": sum(r["autovacuum_count"] for r in rows),
        "autoanalyzes": sum(r["autoanalyze_count"] for r in rows),
        "tables_mb": sum(r["bytes"] for r in rows) / 2**20,
    }


async def _round(
    db: Database,
    service: MemoryService,
    requests: HostRequests,
    ctx: Context,
    label: str,
) -> dict[str, Any]:
    """One round: the requests 8 in flight, then the probe's one at a time."""
    sizes = ctx.sizes
    before = service.stats()
    with CpuMeter(ctx.server.postmaster_pid()) as cpu, collector_pauses() as pauses:
        seen = await requests.run(service, sizes.host_requests, sizes.host_concurrency)
    after = service.stats()
    await service.drain(DRAIN_TIMEOUT)
    with CpuMeter(ctx.server.postmaster_pid()) as probe_cpu:
        probe = await requests.run(service, sizes.long_run_probe, 1)
    await service.drain(DRAIN_TIMEOUT)
    ended = service.stats()
    process_ms, server_ms = cpu.per_item_ms(seen.count)
    probe_process_ms, probe_server_ms = probe_cpu.per_item_ms(probe.count)
    probed = latency_summary(probe.seconds)
    return {
        "round": label,
        **latency_summary(seen.seconds),
        "requests_per_s": seen.rate,
        "empty": seen.empty,
        "timeouts": timeouts_between(before, after),
        "errors": after.load_errors - before.load_errors,
        "process_cpu_ms_per_request": process_ms,
        "server_cpu_ms_per_request": server_ms,
        # The collector's runs among the 8 in flight: a full one stalls every load.
        **pauses.summary(),
        "probe_p50_ms": probed["p50_ms"],
        "probe_p99_ms": probed["p99_ms"],
        "probe_process_cpu_ms": probe_process_ms,
        "probe_server_cpu_ms": probe_server_ms,
        "facts_per_identity": await facts_per_identity(db, requests.identities),
        # The facts kept between requests: those dropped for room, and the reads of an
        # identity's facts that none kept spared (both phases of the round).
        "kept_facts_dropped": ended.kept_facts_dropped - before.kept_facts_dropped,
        "facts_reads": ended.facts_reads - before.facts_reads,
        **await _table_state(db),
    }


async def long_run_section(db: Database, ctx: Context) -> None:
    sizes = ctx.sizes
    # A database of its own, so that its tables age with these requests only.
    # (``db``, the run's main database, is left alone.)
    own = await open_database(ctx.server, "long_run", ctx.base)
    try:
        identities = await seed_host(own, "lr", sizes.host_identities, sizes.host_facts)
        requests = HostRequests(identities, sizes.host_facts, seed=95)
        service = MemoryService.from_url(own.url)
        try:
            await requests.run(service, 4 * sizes.host_concurrency, sizes.host_concurrency)
            await service.drain(DRAIN_TIMEOUT)
            rows = [
                await _round(own, service, requests, ctx, str(n + 1))
                for n in range(sizes.long_run_rounds)
            ]
            await own.conn.execute(
                "VACUUM (FULL, ANALYZE) " + ", ".join(f"{SCHEMA}.{t}" for t in WRITTEN)
            )
            rows.append(await _round(own, service, requests, ctx, "after VACUUM (FULL)"))
        finally:
            await service.close()
    finally:
        await own.close()
    _report(ctx, rows)


def _report(ctx: Context, rows: list[dict[str, Any]]) -> None:
    report, section = ctx.report, "16 long run"
    report.tables["long_run"] = rows
    *rounds, rewritten = rows
    first, last = rounds[0], rounds[-1]
    requests = sum(row["n"] for row in rounds)
    span = f"after {requests:,} requests ({len(rounds)} rounds)"
    facts = {"facts_per_identity": [first["facts_per_identity"], last["facts_per_identity"]]}
    probe = f"{ctx.sizes.long_run_probe} requests one at a time"
    for name, key in (
        (f"{probe}: load_memory p50", "probe_p50_ms"),
        (f"{probe}: CPU per request, this process", "probe_process_cpu_ms"),
        (f"{probe}: CPU per request, the server", "probe_server_cpu_ms"),
    ):
        if last[key] is None:
            continue  # the server's CPU: embedded server only
        report.add(
            Figure(
                section,
                f"{span}, {name}",
                last[key],
                "ms",
                first[key],
                "round 1",
                last[key] / first[key],
                details=facts,
            )
        )
        report.add(
            Figure(
                section,
                f"{span}, {name}, against the same after VACUUM (FULL, ANALYZE)",
                last[key],
                "ms",
                rewritten[key],
                "after the rewrite",
                last[key] / rewritten[key],
                details={"dead_rows_before_rewrite": last["dead_rows"]},
            )
        )
    report.add(
        Figure(
            section,
            f"{span}, {ctx.sizes.host_concurrency} in flight: requests/s in the last round",
            last["requests_per_s"],
            "/s",
            first["requests_per_s"],
            "round 1",
            last["requests_per_s"] / first["requests_per_s"],
            details=facts,
        )
    )
    report.add(
        Figure(
            section,
            f"{span}: reads of an identity's facts in the last round (none kept)",
            last["facts_reads"],
            "",
            first["facts_reads"],
            "round 1",
            details={
                "kept_facts_dropped": [first["kept_facts_dropped"], last["kept_facts_dropped"]]
            },
        )
    )
    report.add(
        Figure(
            section,
            f"{span}, {ctx.sizes.host_concurrency} in flight: timed-out loads (empty or "
            "from the facts at hand)",
            sum(row["timeouts"] for row in rounds),
            "",
            details={"empty": sum(row["empty"] for row in rounds)},
        )
    )


SECTION = Section(
    name="long_run",
    title="long run: host-shaped rounds on one database as its tables age",
    database="main",
    run=long_run_section,
    selected_by=frozenset({"long_run"}),
)
