"""4. Ingest: emit_observation + drain against COPY and INSERT per row, and the CPU per
observation in this process and on the server against the COPY's; emit cost; memory bound."""

from __future__ import annotations

import asyncio
import random
import time
from datetime import UTC, datetime

from benchmarks.environment import CpuMeter
from benchmarks.queueing import emit_cost, memory_bound
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.workloads import (
    BATCH_SIZE,
    DRAIN_TIMEOUT,
    OBSERVATION_COLUMNS,
    SCHEMA,
    Database,
    copy_rows,
    ingest_observations,
)
from coda_memory.core.sanitize import sanitize_observation


async def ingest_section(db: Database, ctx: Context) -> None:
    sizes, report = ctx.sizes, ctx.report

    rng = random.Random(4)
    items = ingest_observations(sizes.ingest_rows, rng)
    now = datetime.now(UTC)
    rows = copy_rows([sanitize_observation(i, o, o.created_at or now) for i, o in items])
    table = f"{SCHEMA}.observations"

    # The limit: the same rows in one COPY.
    start = time.perf_counter()
    with CpuMeter(ctx.server.postmaster_pid()) as copy_cpu:
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
    with CpuMeter(ctx.server.postmaster_pid()) as service_cpu:
        for n, (identity, observation) in enumerate(items, 1):
            service.emit_observation(identity, observation)
            if n % 1_000 == 0:
                await asyncio.sleep(0)
                while service.stats().pending > 20_000:
                    await asyncio.sleep(0.001)
        await service.drain(DRAIN_TIMEOUT)
    elapsed = time.perf_counter() - start
    cpu = service_cpu.process_seconds
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
    # CPU per observation: ingest is CPU-bound on both sides of the connection.
    report.add(
        Figure(
            "4 ingest",
            "emit_observation + drain: CPU per observation, this process",
            cpu * 1e6 / len(items),
            "us",
        )
    )
    if service_cpu.server_seconds is not None and copy_cpu.server_seconds:
        per_row = copy_cpu.server_seconds * 1e6 / len(rows)
        server_us = service_cpu.server_seconds * 1e6 / len(items)
        report.add(
            Figure(
                "4 ingest",
                "emit_observation + drain: CPU per observation, the server",
                server_us,
                "us",
                per_row,
                "one COPY: server CPU per row",
                server_us / per_row,
            )
        )
    await emit_cost(sizes, report)
    await memory_bound(sizes, report)


SECTION = Section(
    name="ingest",
    title="ingest",
    database="main",
    run=ingest_section,
    selected_by=frozenset({"ingest"}),
)
