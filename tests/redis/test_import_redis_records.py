"""import-redis copies what the Redis store itself would consolidate, and leaves out only
what it cannot use: a pending observation the sorted set no longer holds is copied; an
optional metadata value a live server would refuse is dropped, not the observation; a
fact event of the wrong type or range is a bad record, found by the dry run too; an
identity whose checkpoint does not parse is left out whole (its consumed observations
would count again); a checkpoint map of the wrong type stops the run, naming the key."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis

from coda_memory import MemoryService
from coda_memory.migration import import_redis
from coda_memory.postgres import PostgresStore
from coda_memory.redis import RedisStore
from coda_memory.redis.codec import BadRecord
from tests.helpers import T0, FakeClock, tool_ok
from tests.redis.test_import_redis import EVENT, fact, fact_rows, ms, now, observation

#: After every observation and fact below.
NOW = T0 + timedelta(days=12)


async def _consolidated_alike(source: RedisStore, target: PostgresStore, identity: str) -> None:
    """Both stores' consolidations of ``identity`` give the same facts."""
    clock = FakeClock(NOW)
    on_redis = MemoryService(source, clock=clock, load_timeout=5.0)
    on_postgres = MemoryService(target, clock=clock, load_timeout=5.0)
    from_redis = fact_rows(await on_redis.consolidate(identity))
    assert from_redis, "the Redis store made no fact"
    assert fact_rows(await on_postgres.consolidate(identity)) == from_redis


@pytest.mark.parametrize("gone", ["pruned", "expired"])
async def test_a_pending_observation_the_sorted_set_lost_is_copied(
    redis_url: str, redis_client: aioredis.Redis, redis_prefix: str, pg_url: str, gone: str
) -> None:
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        member = observation("ana", "7", 3, "replayed_tool")
        await redis_client.zadd(f"{redis_prefix}obs:ana", {member: ms(3)})
        await redis_client.zadd(f"{redis_prefix}pending:ana", {member: 7})
        if gone == "pruned":  # the original server's prune took it, another stays
            kept = observation("ana", "8", 4, "get_account")
            await redis_client.zadd(f"{redis_prefix}obs:ana", {kept: ms(4)})
            await redis_client.zrem(f"{redis_prefix}obs:ana", member)
        else:  # the sorted set's TTL ran out
            await redis_client.delete(f"{redis_prefix}obs:ana")
        summary = await import_redis(source, target, now=now)
        assert (summary.copied, summary.bad, summary.failed) == (1, [], [])
        assert summary.observations == (2 if gone == "pruned" else 1)
        await _consolidated_alike(source, target, "ana")
        facts = {f.subject for f in await target.facts("ana")}
        assert "tool_affinity:replayed_tool" in facts
    finally:
        await source.close()
        await target.close()


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"x": value}
    return value


def _large(size: int) -> dict[str, str]:
    return {f"k{i}": "x" * 900 for i in range(size // 900 + 1)}


@pytest.mark.parametrize(
    ("kind", "metadata"),
    [
        ("tool_success", {"toolName": "get_account", "durationMs": -5}),
        ("tool_failure", {"toolName": "run_sql", "durationMs": 3, "error": {"code": 500}}),
        ("entity_access", {"entityType": "account", "entityId": "acct-9", "entityName": None}),
        ("query_pattern", {"domain": "royalty", "query": None}),
        # Metadata too deep or too large for a live server, in keys no fact reads.
        ("tool_success", {"toolName": "get_account", "raw": _nested(10)}),
        ("entity_access", {"entityType": "a", "entityId": "1", "trace": _large(20_000)}),
    ],
)
async def test_an_optional_value_a_live_server_refuses_is_dropped_not_the_observation(
    redis_url: str,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    pg_url: str,
    kind: str,
    metadata: dict[str, Any],
) -> None:
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        member = json.loads(observation("ana", "1", 3, "t"))
        member |= {"type": kind, "metadata": metadata}
        await redis_client.zadd(f"{redis_prefix}obs:ana", {json.dumps(member): ms(3)})
        summary = await import_redis(source, target, now=now)
        assert (summary.copied, summary.observations, summary.bad) == (1, 1, [])
        await _consolidated_alike(source, target, "ana")
    finally:
        await source.close()
        await target.close()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"subject": 123}, "subject is not a non-empty string"),
        ({"countAfter": 2**40}, "countAfter is out of range"),
        ({"confidenceAfter": "0.5"}, "confidenceAfter is not a number"),
        ({"hits": 1.5}, "hits is not a whole number"),
        ({"sessionId": ["s"]}, "sessionId is not a non-empty string"),
        ({"kind": "teleported"}, "category or kind is missing or unknown"),
        ({"subject": "entity_frequency:x"}, "subject is not of its category"),
    ],
)
async def test_a_fact_event_of_the_wrong_type_or_range_is_a_bad_record_the_dry_run_finds(
    redis_url: str,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    pg_url: str,
    change: dict[str, Any],
    reason: str,
) -> None:
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        history = f"{redis_prefix}history:ana"
        await redis_client.zadd(f"{redis_prefix}obs:ana", {observation("ana", "1", 3, "t"): ms(3)})
        await redis_client.rpush(history, json.dumps(EVENT), json.dumps(EVENT | change))
        dry = await import_redis(source, None, now=now)
        assert dry.bad == [(history, f"fact event: {reason}")]
        summary = await import_redis(source, target, now=now)
        assert (summary.copied, summary.failed, summary.bad) == (1, [], dry.bad)
        assert summary.fact_events == 1  # the good one
    finally:
        await source.close()
        await target.close()


@pytest.mark.parametrize("checkpoint", ["NaN-oops", "0x10", "1e3"])
async def test_an_identity_whose_checkpoint_does_not_parse_is_left_out_whole(
    redis_url: str, redis_client: aioredis.Redis, redis_prefix: str, pg_url: str, checkpoint: str
) -> None:
    """Refused as the store refuses it (decimal epoch ms only): "0x10" and "1e3" were
    read by one of Lua and Python and not the other."""
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        for identity in ("ana", "bob"):
            members = {observation(identity, f"{n}", n, "get_account"): ms(n) for n in (1, 2)}
            await redis_client.zadd(f"{redis_prefix}obs:{identity}", members)
            await redis_client.hset(
                f"{redis_prefix}facts:{identity}",
                "fact:tool_affinity:get_account",
                fact(identity, "get_account", 0.6, 2),
            )
        await redis_client.hset(f"{redis_prefix}checkpoint", "ana", checkpoint)
        await redis_client.hset(f"{redis_prefix}checkpoint", "bob", str(ms(2)))
        dry = await import_redis(source, None, now=now)
        assert dry.failed == ["ana"]
        summary = await import_redis(source, target, now=now)
        assert (summary.copied, summary.failed) == (1, ["ana"])
        [(key, why)] = summary.bad
        assert key == f"{redis_prefix}*:ana"
        assert "checkpoint field 'ana' is not epoch ms" in why and checkpoint not in why
        assert await target.facts("ana") == []
        # bob's two observations were consumed: his fact is not reinforced again.
        await _consolidated_alike(source, target, "bob")
        [bob] = await target.facts("bob")
        assert bob.reinforcement_count == 2
    finally:
        await source.close()
        await target.close()


async def test_a_checkpoint_map_of_another_type_stops_the_run_naming_the_key(
    redis_url: str, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    source = RedisStore.from_url(redis_url)
    try:
        await redis_client.set(f"{redis_prefix}checkpoint", "not a hash")
        with pytest.raises(BadRecord, match=f"{redis_prefix}checkpoint holds a value of another"):
            await import_redis(source, None, now=now)
    finally:
        await source.close()


async def test_a_late_observation_pending_in_redis_resumes_a_deleted_fact_after_the_import(
    redis_url: str, pg_url: str
) -> None:
    """The import left the checkpoint's consolidated_at empty: the first consolidation in
    Postgres never looked for a deleted fact's last life, and started the fact anew where
    the Redis store resumed it."""
    clock = FakeClock()
    on_redis = MemoryService.from_url(redis_url, clock=clock, load_timeout=5.0)
    target = PostgresStore.from_url(pg_url)
    on_postgres = MemoryService(target, clock=clock, load_timeout=5.0)
    try:
        for day in range(5):
            on_redis.emit_observation(
                "u", tool_ok("t", session=f"d{day}", at=T0 + timedelta(days=day))
            )
            clock.now = T0 + timedelta(days=day, hours=1)
            await on_redis.drain()
            await on_redis.consolidate("u")
        clock.now = T0 + timedelta(days=50)
        assert await on_redis.consolidate("u") == []  # expired at about day 44: deleted
        clock.now = T0 + timedelta(days=51)
        on_redis.emit_observation("u", tool_ok("t", session="late", at=T0 + timedelta(days=30)))
        await on_redis.drain()
        source = on_redis.store
        assert isinstance(source, RedisStore)
        summary = await import_redis(source, target, now=clock)  # still pending
        assert (summary.copied, summary.failed) == (1, [])
        (in_postgres,) = await on_postgres.consolidate("u")
        (in_redis,) = await on_redis.consolidate("u")
        assert in_postgres.reinforcement_count == in_redis.reinforcement_count == 6
        assert in_postgres.confidence == pytest.approx(in_redis.confidence, abs=1e-12)
    finally:
        await on_postgres.close()
        await on_redis.close()


async def test_an_observation_scored_outside_the_range_of_dates_is_a_bad_record(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    """The Redis store reads no observation scored ±inf or past year 9999: the import
    copied one all the same (as new when it was scored +inf)."""
    p = redis_prefix
    good, odd = (
        observation("u-odd", "o-good", 1, "get_account"),
        observation("u-odd", "o-inf", 1, "odd"),
    )
    await redis_client.zadd(f"{p}obs:u-odd", {good: ms(1), odd: "inf"})
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        summary = await import_redis(source, target, now=now)
    finally:
        await source.close()
        await target.close()
    assert summary.bad == [(f"{p}obs:u-odd id 'o-inf'", "its score is out of range")]
    assert summary.observations == 1
