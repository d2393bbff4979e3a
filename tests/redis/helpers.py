"""Helpers shared by the Redis store's tests."""

from __future__ import annotations

import redis.asyncio as aioredis

from coda_memory import MemoryService
from tests.helpers import tool_ok


async def bad_refused_alone(
    service: MemoryService, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    """One observation each of good1, bad and good2, stored: bad's refused alone, before
    its script wrote anything (no batch key, nothing pending); the other two stored."""
    for identity in ("good1", "bad", "good2"):
        service.emit_observation(identity, tool_ok("t"))
    await service.drain()
    stats = service.stats()
    assert (stats.stored, stats.rejected) == (2, 1)
    assert await redis_client.exists(f"{redis_prefix}batches:bad") == 0
    assert await redis_client.zcard(f"{redis_prefix}pending:bad") == 0
