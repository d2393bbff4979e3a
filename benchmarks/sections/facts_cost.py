"""17. What an identity's facts cost a request: the host-shaped requests of section 8
(10 observations, then ``load_memory``), one at a time, for identities of 100, 200 and
400 facts (``facts_cost_levels``), with the library's defaults.

A load decays, ranks and answers with every fact of its identity, and its consolidation
makes each kept fact a model again, so a request's CPU grows with the identity's facts
(up to ``max_facts``, 500 by default): the long run saw it grow by half as the requests
took its identities from 212 to 315 facts. This section measures that cost apart from
everything else, so that an operator can size ``max_facts`` (README, "Scaling out"): per
level, the latency and the CPU per request in this process and on the server, after a
warm-up request of every identity (its facts are then kept between requests, as in a
service that has run for a while); then a least-squares line through the levels' CPU
against the facts each load answered with (its intercept, a request's CPU with no
facts; its slope, the CPU that 100 facts add)."""

from __future__ import annotations

from typing import Any

from benchmarks.environment import CpuMeter
from benchmarks.host import HostRequests, collector_pauses, seed_host
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.stats import latency_summary, linear_fit
from benchmarks.workloads import DRAIN_TIMEOUT, Database
from coda_memory import MemoryService

#: Identities per level: few enough that all their facts are kept between requests.
IDENTITIES = 20


async def _level(db: Database, ctx: Context, facts: int) -> dict[str, Any]:
    """The requests, one at a time, for identities of ``facts`` facts each."""
    identities = await seed_host(db, f"fc{facts}-", IDENTITIES, facts)
    requests = HostRequests(identities, facts, seed=facts)
    service = MemoryService.from_url(db.url)
    try:
        await service.start()
        for identity in identities:  # warm: the connections, and every identity's facts
            await requests.one(service, identity)
        await service.drain(DRAIN_TIMEOUT)
        before = service.stats()
        with CpuMeter(ctx.server.postmaster_pid()) as cpu, collector_pauses() as pauses:
            seen = await requests.run(service, ctx.sizes.facts_cost_requests, 1)
        await service.drain(DRAIN_TIMEOUT)
        after = service.stats()
    finally:
        await service.close()
    process_ms, server_ms = cpu.per_item_ms(seen.count)
    return {
        "facts_seeded": facts,
        # The requests add entities: the facts a load answered with, at the end.
        "facts_answered": requests.last_facts,
        **latency_summary(seen.seconds),
        "process_cpu_ms_per_request": process_ms,
        "server_cpu_ms_per_request": server_ms,
        **pauses.summary(),
        "facts_reads": after.facts_reads - before.facts_reads,
        "empty": seen.empty,
    }


async def facts_cost_section(db: Database, ctx: Context) -> None:
    rows = [await _level(db, ctx, facts) for facts in ctx.sizes.facts_cost_levels]
    ctx.report.tables["facts_cost"] = rows
    name = "host-shaped request, 1 at a time"
    for key, side in (
        ("process_cpu_ms_per_request", "in this process"),
        ("server_cpu_ms_per_request", "on the server"),
    ):
        if any(row[key] is None for row in rows):
            continue  # a server given by --url: its CPU is not seen
        intercept, slope = linear_fit([(row["facts_answered"], row[key]) for row in rows])
        ctx.report.add(
            Figure(
                "17 facts cost",
                f"{name}: CPU {side} that 100 facts of its identity add",
                slope * 100,
                "ms",
                intercept,
                "the same request with no facts (the line's intercept)",
                slope * 100 / intercept,
                details={
                    "facts_answered": [row["facts_answered"] for row in rows],
                    "cpu_ms": [row[key] for row in rows],
                },
            )
        )


SECTION = Section(
    name="facts_cost",
    title="what an identity's facts cost a request",
    database="main",
    run=facts_cost_section,
    selected_by=frozenset({"facts_cost"}),
)
