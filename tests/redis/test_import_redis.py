"""import-redis: the original Redis deployment copied into Postgres."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from sqlalchemy import text
from typer.testing import CliRunner

from coda_memory import Fact, MemoryService
from coda_memory.cli import app
from coda_memory.core.sanitize import sanitize_observation
from coda_memory.migration import import_redis
from coda_memory.postgres import PostgresStore, imports
from coda_memory.redis import RedisStore
from coda_memory.redis.codec import to_ms
from coda_memory.redis.store import split_prefix
from tests.helpers import T0, FakeClock, tool_ok
from tests.postgres.helpers import engine

IDENTITIES = 1_000
NOW = T0 + timedelta(days=12)


def ms(days: float) -> int:
    return int(to_ms(T0 + timedelta(days=days)))


def observation(identity: str, id_: str, days: float, tool: str, ok: bool = True) -> str:
    return json.dumps(
        {
            "id": id_,
            "identityId": identity,
            "type": "tool_success" if ok else "tool_failure",
            "content": f"{tool} ran",
            "metadata": {"toolName": tool, "durationMs": 30},
            "createdAt": ms(days),
        }
    )


def fact(identity: str, tool: str, confidence: float, count: int, **extra: Any) -> str:
    return json.dumps(
        {
            "id": f"fact:tool_affinity:{tool}",
            "identityId": identity,
            "category": "tool_affinity",
            "subject": f"tool_affinity:{tool}",
            "content": f"Uses {tool} successfully",
            "confidence": confidence,
            "reinforcementCount": count,
            "lastReinforcedAt": ms(6),
            "createdAt": ms(1),
            "updatedAt": ms(9),
            **extra,
        }
    )


#: A fact event as the Redis store writes it.
EVENT: dict[str, Any] = {
    "identityId": "u",
    "subject": "tool_affinity:get_account",
    "category": "tool_affinity",
    "kind": "created",
    "sessionId": "s1",
    "at": ms(1),
    "confidenceBefore": None,
    "confidenceAfter": 0.5,
    "countBefore": None,
    "countAfter": 1,
    "easeBefore": None,
    "easeAfter": 2.5,
    "quality": 1.0,
    "hits": 1,
    "trials": 1,
}

#: One corrupt record in every hundredth identity, of these kinds in turn.
CORRUPTIONS = ["broken JSON", "unknown type", "impossible confidence", "not a fact", "event"]


async def write_deployment(client: aioredis.Redis, store: RedisStore, prefix: str) -> None:
    """1,000 identities as the original server (and, for some, coda-memory) left them:
    consumed observations (before the checkpoint), new ones after it, late ones in the
    pending set stamped before it, facts with and without an ease factor, and 1 % corrupt
    records."""
    async with client.pipeline(transaction=False) as pipe:
        for i in range(IDENTITIES):
            identity = f"user-{i:04d}"
            obs_key = f"{prefix}obs:{identity}"
            tools = [f"tool_{(i + k) % 7}" for k in range(3)]
            members = {
                observation(identity, f"{i}-a", 8, tools[0]): ms(8),  # consumed
                observation(identity, f"{i}-b", 9, tools[1], ok=i % 3 != 0): ms(9),  # consumed
                observation(identity, f"{i}-c", 10.5, tools[2]): ms(10.5),  # new
            }
            pipe.zadd(obs_key, members)
            facts: Any = {
                f"fact:tool_affinity:{tools[0]}": fact(identity, tools[0], 0.8, 4),
                f"fact:tool_affinity:{tools[1]}": fact(
                    identity, tools[1], 0.55, 2, easeFactor=2.2 + (i % 5) / 10
                ),
            }
            pipe.hset(f"{prefix}facts:{identity}", mapping=facts)
            if i % 10 != 9:  # one in ten was never consolidated
                pipe.hset(f"{prefix}checkpoint", identity, str(ms(10)))
            if i % 100 == 7:
                kind = CORRUPTIONS[(i // 100) % len(CORRUPTIONS)]
                if kind == "broken JSON":
                    pipe.zadd(obs_key, {'{"id": "x", "type": ': ms(11)})
                elif kind == "unknown type":
                    bad = json.loads(observation(identity, f"{i}-x", 11, "t"))
                    pipe.zadd(obs_key, {json.dumps({**bad, "type": "teleport"}): ms(11)})
                elif kind == "impossible confidence":
                    pipe.hset(f"{prefix}facts:{identity}", "fact:x", fact(identity, "x", 7.5, 1))
                elif kind == "not a fact":
                    pipe.hset(f"{prefix}facts:{identity}", "fact:y", "[1, 2, 3]")
                else:  # a fact event whose count no store holds
                    pipe.rpush(
                        f"{prefix}history:{identity}", json.dumps(EVENT | {"countAfter": 2**40})
                    )
        await pipe.execute()
    # Late observations, appended by coda-memory: pending, yet stamped before the checkpoint.
    late = [
        sanitize_observation(f"user-{i:04d}", tool_ok("late_tool", session=f"s{i}"), T0)
        for i in range(3, IDENTITIES, 10)
    ]
    await store.append(late)


def fact_rows(facts: list[Fact]) -> list[tuple[Any, ...]]:
    return sorted(
        (
            f.subject,
            f.category,
            f.content,
            f.confidence,
            f.reinforcement_count,
            f.last_reinforced_at,
            f.anchor,
            f.created_at,
            f.updated_at,
            f.ease_factor,
        )
        for f in facts
    )


async def row_counts(url: str, schema: str = "coda_memory") -> dict[str, int]:
    counts: dict[str, int] = {}
    own = engine(url)
    async with own.connect() as conn:
        for table in ("observations", "facts", "fact_events", "checkpoints", "redis_imports"):
            result = await conn.execute(text(f'SELECT count(*) FROM "{schema}".{table}'))
            counts[table] = int(result.scalar_one())
        consumed = await conn.execute(
            text(f"SELECT count(*) FROM \"{schema}\".observations WHERE xid = '3'")
        )
        counts["consumed"] = int(consumed.scalar_one())
    await own.dispose()
    return counts


async def tool_calls(url: str) -> list[tuple[str, int, int]]:
    own = engine(url)
    async with own.connect() as conn:
        result = await conn.execute(
            text(
                "SELECT tool_name, sum(successes), sum(failures) "
                "FROM coda_memory.tool_daily GROUP BY tool_name"
            )
        )
        rows = [(str(name), int(ok), int(failed)) for name, ok, failed in result]
    await own.dispose()
    return rows


def now() -> datetime:
    return datetime.now(UTC)


class Killed(Exception):
    """Stands for the process dying: raised in the middle of an identity's copy."""


@pytest.mark.slow
async def test_a_deployment_of_1000_identities_moves_to_postgres(
    redis_url: str, redis_client: aioredis.Redis, redis_prefix: str, pg_url: str
) -> None:
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        await write_deployment(redis_client, source, redis_prefix)

        # Killed half-way: the 501st identity's transaction dies after its observations
        # were written, before its ledger row.
        rollups: list[str] = []
        real_rollup = imports._write_rollup

        async def dying_rollup(conn: Any, identity_id: str, types: Any) -> None:
            if len(rollups) == 500:
                raise Killed
            rollups.append(identity_id)
            await real_rollup(conn, identity_id, types)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(imports, "_write_rollup", dying_rollup)
            with pytest.raises(Killed):
                await import_redis(source, target, now=now)
        half = await row_counts(pg_url)
        assert (half["redis_imports"], half["observations"]) == (500, len(rollups) * 3 + 50)

        summary = await import_redis(source, target, now=now)  # run again: resumes
        assert (summary.identities, summary.copied, summary.skipped) == (1000, 500, 500)
        assert len(summary.bad) == 5  # the second half's: the first half's were reported
        # All 10 corrupt records, each reported by its key; none stopped the copy.
        checked = await import_redis(source, None, now=now)  # a dry run
        assert len(checked.bad) == 10, checked.bad
        assert all(key.startswith(redis_prefix) for key, _ in checked.bad)
        assert any("teleport" in reason for _, reason in checked.bad)
        assert any("outside 0..1" in reason for _, reason in checked.bad)
        assert any("countAfter is out of range" in reason for _, reason in checked.bad)
        assert (checked.observations, checked.consumed_observations) == (3100, 900 * 2)
        # Observations: 3 per identity and 100 late ones; consumed: the first two of
        # every identity with a checkpoint, never a late one.
        counts = await row_counts(pg_url)
        assert (counts["observations"], counts["consumed"]) == (3100, 900 * 2)
        assert counts["facts"] == 2000
        assert counts["redis_imports"] == 1000

        again = await import_redis(source, target, now=now)
        assert (again.copied, again.skipped) == (0, 1000)
        assert await row_counts(pg_url) == counts  # a second run adds nothing

        for i in range(IDENTITIES):
            identity = f"user-{i:04d}"
            assert fact_rows(await target.facts(identity)) == fact_rows(
                await source.facts(identity)
            ), identity

        # Consolidating both afterwards gives the same facts: nothing is reinforced twice.
        clock = FakeClock(NOW)
        on_redis = MemoryService(source, clock=clock, load_timeout=5.0)
        on_postgres = MemoryService(target, clock=clock, load_timeout=5.0)
        for i in range(IDENTITIES):
            identity = f"user-{i:04d}"
            from_redis = fact_rows(await on_redis.consolidate(identity))
            assert fact_rows(await on_postgres.consolidate(identity)) == from_redis, identity
        assert fact_rows(await target.facts("user-0003")) == fact_rows(
            await source.facts("user-0003")
        )
    finally:
        await source.close()
        await target.close()


def test_the_command_copies_reports_and_refuses_nothing_twice(
    redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    # Synchronous: the command runs its own event loop.
    server, _ = split_prefix(redis_url)
    client = redis.Redis.from_url(server)
    client.zadd(
        f"{redis_prefix}obs:alice",
        {observation("alice", "1", 1, "get_account"): ms(1), "{oops": ms(2)},
    )
    client.hset(f"{redis_prefix}checkpoint", "alice", str(ms(1)))
    client.hset(f"{redis_prefix}facts:bob", "fact:tool_affinity:t", fact("bob", "t", 0.5, 1))
    client.close()
    base = ["import-redis", server, "--prefix", redis_prefix, "--url", pg_url]

    dry = CliRunner().invoke(app, [*base, "--dry-run", "-f", "json"])
    assert dry.exit_code == 0, dry.output
    report = json.loads(dry.stdout)
    assert (report["dry_run"], report["copied"], report["observations"]) == (True, 2, 1)
    assert report["bad_records"] == [
        # By its place and size: a record that is not one may hold anything.
        {
            "key": f"{redis_prefix}obs:alice member #1 (5 bytes)",
            "reason": "not JSON (JSONDecodeError)",
        }
    ]
    assert asyncio.run(row_counts(pg_url))["redis_imports"] == 0

    first = CliRunner().invoke(app, base)
    assert first.exit_code == 0, first.output
    assert "identities copied" in first.stdout
    assert f"bad record: {redis_prefix}obs:alice" in first.stdout
    counts = asyncio.run(row_counts(pg_url))
    assert (counts["observations"], counts["consumed"], counts["facts"]) == (1, 1, 1)
    # The copied observation counts in the analytics rollup, as an appended one would.
    assert asyncio.run(tool_calls(pg_url)) == [("get_account", 1, 0)]

    second = CliRunner().invoke(app, [*base, "-f", "json"])
    assert second.exit_code == 0, second.output
    report = json.loads(second.stdout)
    assert (report["copied"], report["skipped"]) == (0, 2)
    # What the first run left out is not listed again, but counted (the ledger keeps it):
    # a run killed after copying alice said nothing of her bad record ever after.
    assert (report["bad_records"], report["bad_records_earlier"]) == ([], 1)
    assert asyncio.run(row_counts(pg_url)) == counts
    third = CliRunner().invoke(app, base)
    assert "bad records left out by earlier runs (--dry-run lists them)" in third.stdout


async def test_a_server_that_knows_an_identity_sees_the_facts_an_import_adds(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    """A live Postgres server consolidated the identity (and keeps its facts between
    requests) before the copy from Redis added one it did not have."""
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        live = MemoryService(target, clock=FakeClock(NOW), load_timeout=5.0)
        live.emit_observation("user-0001", tool_ok("live_tool"))
        await live.drain()
        assert [f.subject for f in await live.consolidate("user-0001")] == [
            "tool_affinity:live_tool"
        ]
        await redis_client.hset(
            f"{redis_prefix}facts:user-0001",
            "fact:tool_affinity:old_tool",
            fact("user-0001", "old_tool", 0.8, 4),
        )
        summary = await import_redis(source, target, now=now)
        assert summary.copied == 1
        facts, _ = await target.peek("user-0001")
        assert sorted(f.subject for f in facts) == [
            "tool_affinity:live_tool",
            "tool_affinity:old_tool",
        ]
    finally:
        await source.close()
        await target.close()


def test_a_bad_record_whose_key_holds_an_escape_sequence_is_listed_escaped(
    redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    """The key holds the identity, which a tenant chooses: the line carried its escape
    sequence to the operator's terminal."""
    server, _ = split_prefix(redis_url)
    client = redis.Redis.from_url(server)
    client.zadd(f"{redis_prefix}obs:evil\x1b[31mred\x1b[0m", {"{oops": ms(1)})
    client.close()
    base = ["import-redis", server, "--prefix", redis_prefix, "--url", pg_url, "--dry-run"]
    result = CliRunner().invoke(app, base)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout
    assert f"bad record: {redis_prefix}obs:evil\\x1b[31mred\\x1b[0m member" in result.stdout
