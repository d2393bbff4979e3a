"""The large data set: observations, facts and history of many identities."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

from benchmarks.workloads import (
    DOMAINS,
    OBSERVATION_COLUMNS,
    SCHEMA,
    TOOLS,
    entity,
    seed_identities,
)

#: (type, content, metadata JSON) fragments; popular tools and entities appear more often,
#: so rollups and views see skewed, realistic distributions.
_FRAGMENT_CACHE: list[str] = []


def observation_fragments() -> list[str]:
    if _FRAGMENT_CACHE:
        return _FRAGMENT_CACHE
    out: list[str] = []
    for rank, tool in enumerate(TOOLS):
        weight = max(1, 60 // (rank + 1))
        failure = 0.02 + 0.3 * (rank % 7 == 3)
        successes = max(1, round(weight * 12 * (1 - failure)))
        failures = max(1, round(weight * 12 * failure))
        ok = f'tool_success\t{tool} ok\t{{"toolName":"{tool}","durationMs":120.5}}'
        bad = (
            f'tool_failure\t{tool} failed\t{{"toolName":"{tool}","durationMs":900.0,'
            '"error":"timeout"}'
        )
        out += [ok] * successes + [bad] * failures
    for rank in range(3_000):
        kind, key = entity(rank)
        text = (
            f'entity_access\taccessed {kind}\t{{"entityType":"{kind}","entityId":"{key}",'
            f'"entityName":"{kind} {key}"}}'
        )
        out += [text] * max(1, 40 // (rank + 1))
    for rank, domain in enumerate(DOMAINS):
        text = f'query_pattern\tasked about {domain}\t{{"domain":"{domain}","query":"{domain}?"}}'
        out += [text] * max(2, 400 // (rank + 1))
    _FRAGMENT_CACHE.extend(out)
    return out


def observation_lines(
    start: int, end: int, per_identity: int, base: datetime, days: int = 90
) -> bytes:
    """Rows ``start``..``end`` of the large observation set, in COPY text format.

    Row ``n`` belongs to identity ``u{n // per_identity}``, so each identity's rows are
    contiguous; sessions hold eight observations; ``created_at`` spreads over ``days``
    days before ``base``.
    """
    fragments = observation_fragments()
    rng = random.Random(start)
    pick, spread = rng.choice, rng.randrange
    span = days * 86_400
    base_ts = base.timestamp()
    stamps: dict[int, str] = {}
    lines: list[str] = []
    for n in range(start, end):
        identity = n // per_identity
        second = spread(span) // 60 * 60
        stamp = stamps.get(second)
        if stamp is None:
            when = datetime.fromtimestamp(base_ts - second, UTC)
            stamp = stamps[second] = when.strftime("%Y-%m-%d %H:%M:%S+00")
        lines.append(f"u{identity:06d}\t{pick(fragments)}\tu{identity:06d}-s{n // 8}\t{stamp}\n")
    return "".join(lines).encode()


async def fill_observations(
    conn: Any, start: int, end: int, per_identity: int, base: datetime
) -> None:
    """Bulk-load rows ``start``..``end`` with one streamed COPY, generated in chunks."""
    chunk = 50_000

    async def source() -> AsyncIterator[bytes]:
        for offset in range(start, end, chunk):
            yield await asyncio.to_thread(
                observation_lines, offset, min(end, offset + chunk), per_identity, base
            )

    await conn.copy_to_table(
        "observations",
        schema_name=SCHEMA,
        source=source(),
        columns=OBSERVATION_COLUMNS,
        format="text",
    )


async def fill_facts(conn: Any, identities: int, facts: int, base: datetime) -> None:
    """``facts`` facts (and their 'created' events) spread over identities ``u000000``..,
    and a checkpoint each, as months of consolidations would have left them."""
    await seed_identities(
        conn,
        [f"u{n:06d}" for n in range(identities)],
        max(1, facts // identities),
        base,
        random.Random(5),
        max_age=timedelta(days=60),
    )
