"""import-redis holds imported records to what a live server would store: a date more than
the clock skew in the future is copied as the run's now, and counted (a fact anchored in
the future outlived its time, and the analytics views decayed it not at all), and an ease
factor that none of the library's decay strategies could have given a fact is a bad
record (an ease of 1e308 never decays)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
import redis.asyncio as aioredis
from sqlalchemy import text
from typer.testing import CliRunner

from coda_memory import Fact
from coda_memory.cli import app
from coda_memory.migration import import_redis
from coda_memory.postgres import PostgresStore
from coda_memory.redis import RedisStore
from coda_memory.redis.codec import to_ms
from coda_memory.redis.store import split_prefix
from tests.helpers import T0
from tests.postgres.helpers import engine
from tests.redis.test_import_redis import fact, ms, observation

#: The run's now.
RUN_NOW = T0 + timedelta(days=12)
#: Ten years after it.
AHEAD = int(to_ms(RUN_NOW + timedelta(days=3650)))
#: Within the clock skew (5 minutes) after it: kept as dated.
JUST_AHEAD = int(to_ms(RUN_NOW + timedelta(minutes=1)))


def _observation_at(identity: str, id_: str, at_ms: int) -> str:
    return json.dumps(
        {**json.loads(observation(identity, id_, 0, "get_account")), "createdAt": at_ms}
    )


async def _observation_times(url: str, identity: str) -> dict[str, tuple[datetime, bool]]:
    """Each observation's content: its ``created_at`` and whether it arrived consumed."""
    own = engine(url)
    async with own.connect() as conn:
        result = await conn.execute(
            text(
                "SELECT metadata->>'n', created_at, xid = '3' FROM coda_memory.observations "
                "WHERE identity_id = :identity"
            ),
            {"identity": identity},
        )
        rows = {str(n): (at, bool(consumed)) for n, at, consumed in result}
    await own.dispose()
    return rows


def _times(facts: list[Fact]) -> dict[str, tuple[datetime, ...]]:
    return {f.subject: (f.last_reinforced_at, f.anchor, f.created_at, f.updated_at) for f in facts}


def _numbered(raw: str, n: str) -> str:
    value = json.loads(raw)
    value["metadata"]["n"] = n
    return json.dumps(value)


async def test_dates_in_the_future_are_copied_as_the_runs_now_and_counted(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    p = redis_prefix
    # alice: the original server consumed an observation dated ten years ahead, and moved
    # its checkpoint there; her fact has every time ahead.
    await redis_client.zadd(
        f"{p}obs:alice",
        {
            _numbered(_observation_at("alice", "1", ms(1)), "past"): ms(1),
            _numbered(_observation_at("alice", "2", AHEAD), "ahead"): AHEAD,
        },
    )
    await redis_client.hset(f"{p}checkpoint", "alice", str(AHEAD))
    everything_ahead = {
        "lastReinforcedAt": AHEAD,
        "confidenceAt": AHEAD,
        "createdAt": AHEAD,
        "updatedAt": AHEAD,
    }
    await redis_client.hset(
        f"{p}facts:alice", "fact:tool_affinity:t", fact("alice", "t", 0.9, 3, **everything_ahead)
    )
    # bob: never consolidated; one observation ten years ahead, one a minute ahead. One
    # fact anchored ahead (its other times past), one updated (and so anchored) a minute
    # ahead.
    await redis_client.zadd(
        f"{p}obs:bob",
        {
            _numbered(_observation_at("bob", "1", AHEAD), "ahead"): AHEAD,
            _numbered(_observation_at("bob", "2", JUST_AHEAD), "just"): JUST_AHEAD,
        },
    )
    await redis_client.hset(
        f"{p}facts:bob",
        mapping={
            "fact:tool_affinity:anchored": fact("bob", "anchored", 0.9, 2, confidenceAt=AHEAD),
            "fact:tool_affinity:near": fact("bob", "near", 0.9, 2, updatedAt=JUST_AHEAD),
        },
    )

    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        dry = await import_redis(source, None, now=lambda: RUN_NOW)
        summary = await import_redis(source, target, now=lambda: RUN_NOW)
        alice, bob = await target.facts("alice"), await target.facts("bob")
    finally:
        await source.close()
        await target.close()

    # Two observations and two facts; what is a minute ahead is within the clock skew.
    assert (summary.future_clamped, dry.future_clamped) == (4, 4)
    assert (summary.copied, summary.observations, summary.facts, summary.bad) == (2, 4, 3, [])
    just = datetime.fromtimestamp(JUST_AHEAD / 1000, UTC)
    assert await _observation_times(pg_url, "alice") == {
        "past": (T0 + timedelta(days=1), True),
        "ahead": (RUN_NOW, True),  # still consumed
    }
    assert await _observation_times(pg_url, "bob") == {
        "ahead": (RUN_NOW, False),
        "just": (just, False),
    }
    assert _times(alice) == {"tool_affinity:t": (RUN_NOW,) * 4}
    day = [T0 + timedelta(days=d) for d in range(10)]
    assert _times(bob) == {
        "tool_affinity:anchored": (day[6], RUN_NOW, day[1], day[9]),
        "tool_affinity:near": (day[6], just, day[1], just),
    }
    # Confidence and count as they were: only the dates moved.
    assert [(f.confidence, f.reinforcement_count) for f in alice] == [(0.9, 3)]


def test_the_command_shows_how_many_dates_it_moved(
    redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    server, _ = split_prefix(redis_url)
    year_9000 = int(to_ms(datetime(9000, 1, 1, tzinfo=UTC)))
    client = redis.Redis.from_url(server)
    client.zadd(f"{redis_prefix}obs:alice", {_observation_at("alice", "1", year_9000): year_9000})
    client.hset(
        f"{redis_prefix}facts:alice",
        "fact:tool_affinity:t",
        fact("alice", "t", 0.5, 1, confidenceAt=year_9000),
    )
    client.close()
    base = ["import-redis", server, "--prefix", redis_prefix, "--url", pg_url]

    dry = CliRunner().invoke(app, [*base, "--dry-run", "-f", "json"])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.stdout)["future_clamped"] == 2

    copied = CliRunner().invoke(app, base)
    assert copied.exit_code == 0, copied.output
    assert re.search(r"records dated in the future \(copied as now\)\W+2\b", copied.stdout), (
        copied.stdout
    )


def _with_ease(identity: str, tool: str, count: int, ease: Any) -> str:
    return fact(identity, tool, 0.5, count, easeFactor=ease)


async def test_an_ease_no_decay_strategy_makes_is_a_bad_record(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    key = f"{redis_prefix}facts:carol"
    await redis_client.hset(
        key,
        mapping={
            # Never decays under AdaptiveDecay (nor in the analytics views).
            "fact:tool_affinity:huge": _with_ease("carol", "huge", 1, 1e308),
            # Below PowerLawDecay's least stability (AdaptiveDecay's eases stay over 1.3).
            "fact:tool_affinity:tiny": _with_ease("carol", "tiny", 1, 0.01),
            # More than 365 plus AdaptiveDecay's 0.1 a reinforcement after the first.
            "fact:tool_affinity:fast": _with_ease("carol", "fast", 1_000, 470),
            # Each strategy's bounds, and AdaptiveDecay's growth over 1,000 reinforcements.
            "fact:tool_affinity:low": _with_ease("carol", "low", 1, 0.05),
            "fact:tool_affinity:high": _with_ease("carol", "high", 1, 365),
            "fact:tool_affinity:grown": _with_ease("carol", "grown", 1_000, 464.9),
            "fact:tool_affinity:usual": _with_ease("carol", "usual", 4, 2.8),
        },
    )
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        dry = await import_redis(source, None, now=lambda: RUN_NOW)
        summary = await import_redis(source, target, now=lambda: RUN_NOW)
        copied = await target.facts("carol")
    finally:
        await source.close()
        await target.close()

    assert dict(summary.bad) == {
        f"{key} field 'fact:tool_affinity:huge'": "easeFactor 1e+308 is outside 0.05..365",
        f"{key} field 'fact:tool_affinity:tiny'": "easeFactor 0.01 is outside 0.05..365",
        f"{key} field 'fact:tool_affinity:fast'": "easeFactor 470.0 is outside 0.05..464.9",
    }
    assert dry.bad == summary.bad
    assert sorted((f.subject, f.ease_factor) for f in copied) == [
        ("tool_affinity:grown", 464.9),
        ("tool_affinity:high", 365.0),
        ("tool_affinity:low", 0.05),
        ("tool_affinity:usual", 2.8),
    ]
