"""Profiling: the cost of single pieces, each timed on its own."""

from __future__ import annotations

import random
import statistics
import time
from collections import defaultdict
from datetime import UTC, datetime

from sqlalchemy import text as sql_text

from benchmarks.workloads import (
    BATCH_SIZE,
    FACT_COLUMNS,
    OBSERVATION_COLUMNS,
    SCHEMA,
    Database,
    copy_rows,
    ingest_observations,
)
from coda_memory.core.affinity import extract_tool_affinities
from coda_memory.core.consolidation import active_views, plan_consolidation
from coda_memory.core.model import Fact, fact_id
from coda_memory.core.prompt import format_memory_section
from coda_memory.core.sanitize import sanitize_observation
from coda_memory.postgres import PostgresStore
from coda_memory.postgres.repositories import FactRepository


async def micro_costs(db: Database, identity: str, loaded_identity: str) -> dict[str, float]:
    """Costs of single pieces, each timed on its own (milliseconds or microseconds)."""
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
