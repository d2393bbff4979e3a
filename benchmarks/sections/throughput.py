"""3. Consolidations per second, 8 concurrent, against pgbench -c8."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence

from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.workloads import Database, consumed, names, prepare_profile
from coda_memory import MemoryService


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


async def throughput_section(db: Database, ctx: Context) -> None:
    sizes, report, baseline = ctx.sizes, ctx.report, ctx.eight
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


SECTION = Section(
    name="throughput",
    title="throughput",
    database="main",
    run=throughput_section,
    selected_by=frozenset({"throughput"}),
)
