"""The original server's key layout and JSON: what it wrote loads, what we write it reads."""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis

from coda_memory import MemoryService
from coda_memory.core.caps import LogThrottle
from coda_memory.core.logs import identity_label
from coda_memory.redis import unit as redis_unit
from coda_memory.redis.codec import to_ms
from tests.helpers import T0, FakeClock, tool_ok

#: The keys of the seed's interfaces (docs: Observation and Fact).
OBSERVATION_KEYS = {"id", "identityId", "type", "content", "metadata", "createdAt"}
FACT_KEYS = {
    "id",
    "identityId",
    "category",
    "subject",
    "content",
    "confidence",
    "reinforcementCount",
    "lastReinforcedAt",
    "createdAt",
    "updatedAt",
}
DAY_MS = 86_400_000


def ms(days: float = 0) -> int:
    return int(to_ms(T0 + timedelta(days=days)))


def seed_observation(
    identity: str, id_: str, at: int, tool: str, kind: str = "tool_success"
) -> str:
    return json.dumps(
        {
            "id": id_,
            "identityId": identity,
            "type": kind,
            "content": f"{tool} ran",
            "metadata": {"toolName": tool, "durationMs": 42},
            "createdAt": at,
        },
        separators=(",", ":"),
    )


def seed_fact(
    identity: str, subject: str, confidence: float, count: int, at: int, **extra: Any
) -> str:
    category = subject.split(":", 1)[0]
    return json.dumps(
        {
            "id": f"fact:{subject}",
            "identityId": identity,
            "category": category,
            "subject": subject,
            "content": f"Uses {subject.split(':', 1)[1]} successfully",
            "confidence": confidence,
            "reinforcementCount": count,
            # The original server wrote the decayed confidence back with updatedAt.
            "lastReinforcedAt": at - 2 * DAY_MS,
            "createdAt": at - 5 * DAY_MS,
            "updatedAt": at,
            **extra,
        },
        separators=(",", ":"),
    )


async def write_seed(client: aioredis.Redis, prefix: str, identity: str) -> None:
    """What the TypeScript server leaves behind: a checkpoint at day 2, one observation it
    consumed (day 1), two it did not (day 3), and two facts, one with an ease factor."""
    await client.zadd(
        f"{prefix}obs:{identity}",
        {
            seed_observation(identity, "obs-1", ms(1), "old_tool"): ms(1),
            seed_observation(identity, "obs-2", ms(3), "get_account"): ms(3),
            seed_observation(identity, "obs-3", ms(3) + 5, "run_query", "tool_failure"): ms(3) + 5,
        },
    )
    await client.hset(
        f"{prefix}facts:{identity}",
        mapping={
            "fact:tool_affinity:get_account": seed_fact(
                identity, "tool_affinity:get_account", 0.8, 4, ms(2)
            ),
            "fact:tool_affinity:old_tool": seed_fact(
                identity, "tool_affinity:old_tool", 0.6, 2, ms(2), easeFactor=2.5
            ),
        },
    )
    await client.hset(f"{prefix}checkpoint", identity, str(ms(2)))


async def test_the_original_servers_data_loads_and_only_unconsumed_observations_count(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    await write_seed(redis_client, redis_prefix, "u1")
    clock = FakeClock(T0 + timedelta(days=4))
    service = MemoryService.from_url(redis_url, clock=clock, load_timeout=5.0)
    try:
        facts = {f.subject: f for f in await service.consolidate("u1")}
        # Reinforced by obs-2 (day 3) from 0.8 as of updatedAt (day 2), not as of
        # lastReinforcedAt (day 0); seen now, at day 4.
        account = facts["tool_affinity:get_account"]
        assert account.reinforcement_count == 5
        assert account.confidence == pytest.approx((0.8 * 0.95 + 0.1) * 0.95)
        # obs-1 was consumed by the original server: old_tool is only decayed, from day 2.
        old = facts["tool_affinity:old_tool"]
        assert old.reinforcement_count == 2
        assert old.ease_factor == 2.5
        assert old.confidence == pytest.approx(0.6 * 0.95**2)
        assert facts["tool_avoidance:run_query"].reinforcement_count == 1
        # A second consolidation finds nothing new.
        again = {f.subject: f for f in await service.consolidate("u1")}
        assert {s: f.reinforcement_count for s, f in again.items()} == {
            s: f.reinforcement_count for s, f in facts.items()
        }
    finally:
        await service.close()


async def test_facts_written_back_keep_the_original_shape(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    await write_seed(redis_client, redis_prefix, "u1")
    service = MemoryService.from_url(
        redis_url, clock=FakeClock(T0 + timedelta(days=4)), load_timeout=5.0
    )
    try:
        await service.consolidate("u1")
        service.emit_observation("u1", tool_ok("search", session="s9"))
        await service.drain()
        await service.consolidate("u1")
    finally:
        await service.close()

    stored: dict[Any, Any] = await redis_client.hgetall(f"{redis_prefix}facts:u1")
    facts = {field.decode(): json.loads(value) for field, value in stored.items()}
    assert set(facts) == {
        "fact:tool_affinity:get_account",
        "fact:tool_affinity:old_tool",
        "fact:tool_avoidance:run_query",
        "fact:tool_affinity:search",
    }
    for field, fact in facts.items():
        assert fact["id"] == field
        # Every original key; a fact coda-memory wrote adds only its confidence anchor.
        extra = {"easeFactor"} if "easeFactor" in fact else set()
        if field != "fact:tool_affinity:old_tool":  # the one nothing reinforced
            extra.add("confidenceAt")
        assert set(fact) == FACT_KEYS | extra, field
        assert fact["identityId"] == "u1"
        assert fact["category"] == fact["category"].lower()
        for key in {"lastReinforcedAt", "createdAt", "updatedAt", "confidenceAt"} & set(fact):
            assert isinstance(fact[key], int), (field, key)  # epoch ms, as the seed writes
        assert isinstance(fact["reinforcementCount"], int)
        assert 0.0 <= fact["confidence"] <= 1.0
    assert facts["fact:tool_affinity:old_tool"]["easeFactor"] == 2.5
    assert "easeFactor" not in facts["fact:tool_affinity:get_account"]
    assert facts["fact:tool_affinity:search"]["createdAt"] == ms(4)

    # Observations coda-memory appended have the seed's shape (plus sessionId) and score.
    members: list[Any] = await redis_client.zrange(f"{redis_prefix}obs:u1", 0, -1, withscores=True)
    ours = [(json.loads(m), score) for m, score in members if b'"sessionId"' in m]
    assert len(ours) == 1
    observation, score = ours[0]
    assert set(observation) == OBSERVATION_KEYS | {"sessionId"}
    assert isinstance(observation["id"], str)
    assert observation["type"] == "tool_success"
    assert observation["createdAt"] == score == ms(4)
    # The checkpoint map moved to the latest consumed observation, as the seed's does.
    checkpoint: Any = await redis_client.hget(f"{redis_prefix}checkpoint", "u1")
    assert int(checkpoint) == ms(4)


async def test_bad_records_are_logged_by_the_identitys_label_once_a_second(
    redis_url: str,
    redis_prefix: str,
    redis_client: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each bad record gave a line naming the identity itself ('alice.smith@…')."""
    monkeypatch.setattr(redis_unit, "_log", LogThrottle(logging.getLogger("coda_memory")))
    identity = "alice.smith@example.com"
    await redis_client.zadd(
        f"{redis_prefix}obs:{identity}", {f"{{broken {n}": ms(3) + n for n in range(7)}
    )
    service = MemoryService.from_url(redis_url, clock=FakeClock(T0 + timedelta(days=4)))
    try:
        with caplog.at_level(logging.WARNING, logger="coda_memory"):
            await service.consolidate(identity)
    finally:
        await service.close()
    lines = [r.getMessage() for r in caplog.records if "skipped a bad" in r.getMessage()]
    assert lines == [
        f"coda-memory: skipped a bad observation of {identity_label(identity)} in Redis: "
        "not JSON (JSONDecodeError)"
    ]
    assert "alice" not in caplog.text


async def test_bad_records_of_the_original_server_are_skipped_not_fatal(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    await write_seed(redis_client, redis_prefix, "u1")
    await redis_client.zadd(
        f"{redis_prefix}obs:u1",
        {"{not json": ms(3) + 1, seed_observation("u1", "x", ms(3) + 2, "t", "wat"): ms(3) + 2},
    )
    await redis_client.hset(
        f"{redis_prefix}facts:u1",
        mapping={
            "fact:broken": "[]",
            "fact:too_sure": seed_fact("u1", "tool_affinity:z", 7.0, 1, ms(2)),
        },
    )
    service = MemoryService.from_url(
        redis_url, clock=FakeClock(T0 + timedelta(days=4)), load_timeout=5.0
    )
    try:
        subjects = {f.subject for f in await service.consolidate("u1")}
    finally:
        await service.close()
    assert subjects == {
        "tool_affinity:get_account",
        "tool_affinity:old_tool",
        "tool_avoidance:run_query",
    }


async def test_an_observation_whose_session_id_redis_cannot_take_back_is_skipped(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """A lone surrogate in a sessionId (half an emoji that a JavaScript ``slice`` cut)
    parsed, and the commit, which writes the session's events back, failed on encoding
    it (UnicodeEncodeError): every consolidation of the identity failed for good."""
    cut = json.loads(seed_observation("u1", "cut", ms(3), "cut_tool"))
    cut["sessionId"] = "s\ud83d"
    await redis_client.zadd(
        f"{redis_prefix}obs:u1",
        {
            json.dumps(cut, separators=(",", ":")): ms(3),
            seed_observation("u1", "good", ms(3) + 1, "get_account"): ms(3) + 1,
        },
    )
    service = MemoryService.from_url(
        redis_url, clock=FakeClock(T0 + timedelta(days=4)), load_timeout=5.0
    )
    try:
        subjects = {f.subject for f in await service.consolidate("u1")}
        waiting = (await service.store.peek("u1"))[1]
    finally:
        await service.close()
    assert subjects == {"tool_affinity:get_account"}
    assert not waiting  # consumed, as any record that does not parse


@pytest.mark.parametrize("score", ["+inf", "-inf", "1e300"])
async def test_an_observation_scored_outside_the_range_of_dates_moves_no_checkpoint(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, score: str
) -> None:
    """A member something else scored ±inf (or past year 9999) moved the checkpoint to
    that score: "inf" or "-inf", which the scripts then refused (BADCHECKPOINT), so every
    later consolidation of the identity failed; or a 301-digit number, past which no
    later observation of the original server's counted (and which the import refuses as
    no epoch ms). Such a member is left out, as no date of an observation."""
    odd = seed_observation("u1", "odd", ms(3), "odd_tool")
    await redis_client.zadd(f"{redis_prefix}obs:u1", {odd: score})
    service = MemoryService.from_url(
        redis_url, clock=FakeClock(T0 + timedelta(days=4)), load_timeout=5.0
    )
    try:
        first = {f.subject for f in await service.consolidate("u1")}
        later = seed_observation("u1", "later", ms(3) + 1, "later")
        await redis_client.zadd(f"{redis_prefix}obs:u1", {later: ms(3) + 1})
        second = {f.subject for f in await service.consolidate("u1")}
        waiting = (await service.store.peek("u1"))[1]
    finally:
        await service.close()
    assert first == set()
    assert second == {"tool_affinity:later"}
    assert not waiting
    checkpoint: Any = await redis_client.hget(f"{redis_prefix}checkpoint", "u1")
    assert int(checkpoint) == ms(3) + 1
