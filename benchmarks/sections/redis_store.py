"""1r/2r. consolidate() and load_memory() on the Redis store, against redis-benchmark -c1.

The same profiles as the Postgres sections (facts seeded as stored facts, new observations
emitted through the service), on the Redis at ``$CODA_MEMORY_BENCH_REDIS_URL`` (default
127.0.0.1:6379/0) under a key prefix of this run, deleted afterwards. The baseline is
``redis-benchmark -c 1 -t set`` on the same server in the same run: one round trip, while a
consolidation takes about six (peek, lock, load, session records, commit, unlock).
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
import random
import shutil
import time
from collections.abc import Sequence
from datetime import timedelta
from urllib.parse import urlsplit

from benchmarks.report import Figure, Report
from benchmarks.section import Context, Section
from benchmarks.stats import latency_summary
from benchmarks.workloads import Database, FactShape, emit_all, names, new_observations
from coda_memory import Fact, FactCategory, MemoryService
from coda_memory.core.model import fact_id
from coda_memory.redis import RedisStore
from coda_memory.redis.codec import fact_json
from coda_memory.redis.keys import glob_escape

DEFAULT_URL = "redis://127.0.0.1:6379/0"


async def redis_benchmark_set(url: str, requests: int = 20_000) -> dict[str, float] | None:
    """p50/p99 latency (ms) of SET with one client, from redis-benchmark's CSV."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    parts = urlsplit(url)
    process = await asyncio.create_subprocess_exec(
        *(binary, "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379)),
        *("-n", str(requests), "-c", "1", "-t", "set", "--csv"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await process.communicate()
    rows = list(csv.DictReader(io.StringIO(out.decode())))
    if process.returncode != 0 or not rows:
        return None
    return {
        "p50_ms": float(rows[0]["p50_latency_ms"]),
        "p99_ms": float(rows[0]["p99_latency_ms"]),
        "rps": float(rows[0]["rps"]),
    }


async def seed_facts(
    store: RedisStore, identities: Sequence[str], facts: int, db: Database, rng: random.Random
) -> None:
    """``facts`` stored facts per identity, written straight into the facts hashes."""
    at = db.clock.now - timedelta(hours=1)
    shape = list(FactShape(facts).rows())
    async with store.client.pipeline(transaction=False) as pipe:
        for identity in identities:
            mapping: dict[str | bytes, str | bytes] = {}
            for subject, category, content in shape:
                last = at - timedelta(seconds=rng.uniform(3_000, 300_000))
                fact = Fact(
                    id=fact_id(subject),
                    identity_id=identity,
                    category=FactCategory(category),
                    subject=subject,
                    content=content,
                    confidence=round(rng.uniform(0.45, 0.95), 4),
                    reinforcement_count=rng.randint(1, 30),
                    last_reinforced_at=last,
                    created_at=last - timedelta(days=rng.uniform(0, 30)),
                    updated_at=last,
                    confidence_at=last,
                )
                mapping[fact.id] = fact_json(fact)
            pipe.hset(store.keys.of("facts", identity), mapping=mapping)  # type: ignore[arg-type]
        await pipe.execute()


async def redis_section(db: Database, ctx: Context) -> None:
    sizes, report = ctx.sizes, ctx.report
    url = os.environ.get("CODA_MEMORY_BENCH_REDIS_URL", DEFAULT_URL)
    prefix = f"coda:bench:{os.getpid()}:"
    store = RedisStore.from_url(url, prefix=prefix)
    try:
        await store.client.ping()
    except Exception as exc:
        report.note(f"redis: skipped, no server at {url} ({type(exc).__name__})")
        await store.close()
        return
    service = MemoryService(store, clock=db.clock)
    try:
        baseline = await redis_benchmark_set(url)
        if baseline is None:
            report.note("redis: redis-benchmark unavailable; figures have no baseline")
        rng = random.Random(3)
        for profile in sizes.profiles:
            if profile.name == "heavy":
                continue  # the Redis store is not meant for identities that large
            identities = names(f"r-{profile.name}", profile.identities)
            await seed_facts(store, identities, profile.facts, db, rng)
            await emit_all(
                service,
                (
                    (identity, observation)
                    for identity in identities
                    for observation in new_observations(
                        identity, profile.facts, profile.new, profile.sessions, db.clock.now, rng
                    )
                ),
            )
            seconds: list[float] = []
            for identity in identities:
                start = time.perf_counter()
                await service.consolidate(identity)
                seconds.append(time.perf_counter() - start)
            _add(report, "1 consolidation", f"redis {profile.name}", seconds, baseline, profile)
        for variant, new in (("3 new observations", 3), ("none new", 0)):
            identities = names(f"r-load-{new}", sizes.load_identities)
            await seed_facts(store, identities, 200, db, rng)
            if new:
                await emit_all(
                    service,
                    (
                        (identity, observation)
                        for identity in identities
                        for observation in new_observations(
                            identity, 200, new, 1, db.clock.now, rng
                        )
                    ),
                )
            seconds = []
            for identity in identities:
                start = time.perf_counter()
                await service.load_memory(identity)
                seconds.append(time.perf_counter() - start)
            _add(report, "2 load_memory", f"redis typical, {variant}", seconds, baseline, None)
    finally:
        await service.close()
        cleaner = RedisStore.from_url(url, prefix=prefix)
        async for key in cleaner.client.scan_iter(match=glob_escape(prefix) + "*", count=1000):
            await cleaner.client.delete(key)
        await cleaner.close()


def _add(
    report: Report,
    section: str,
    name: str,
    seconds: list[float],
    baseline: dict[str, float] | None,
    profile: object,
) -> None:
    summary = latency_summary(seconds)
    report.tables.setdefault("redis", []).append({"figure": f"{section}: {name}", **summary})
    for quantile in ("p50", "p99"):
        value = summary[f"{quantile}_ms"]
        base = None if baseline is None else baseline[f"{quantile}_ms"]
        report.add(
            Figure(
                section,
                f"{name} {quantile}",
                value,
                "ms",
                base,
                f"redis-benchmark SET -c1 {quantile}" if base is not None else None,
                value / base if base else None,
                details={**summary, "profile": str(profile)} if quantile == "p99" else {},
            )
        )


SECTION = Section(
    name="redis",
    title="Redis store: consolidation and load_memory",
    database="main",
    run=redis_section,
    selected_by=frozenset({"redis"}),
)
