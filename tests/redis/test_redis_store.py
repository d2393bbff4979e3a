"""The Redis store's own mechanisms: exactly-once under concurrency, no timestamp cursor,
the lock, retention, the capped history, forget and stats."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from coda_memory import Fact, FactEvent, FactEventKind, MemoryService, NewObservation
from coda_memory import service as service_module
from coda_memory.core.consolidation import plan_consolidation
from coda_memory.core.decay import ExponentialDecay
from coda_memory.core.logs import identity_label
from coda_memory.core.sanitize import sanitize_observation
from coda_memory.errors import ConnectionLost
from coda_memory.redis import LockLost, LockTimeout, RedisStore
from coda_memory.redis import store as store_module
from coda_memory.redis.codec import BadRecord
from coda_memory.redis.keys import glob_escape
from tests.builders import consolidate, contents, event, fact, record
from tests.helpers import T0, FakeClock, LoopTurns, domain, entity, tool_failed, tool_ok
from tests.redis.helpers import bad_refused_alone
from tests.redis.test_import_redis import fact as stored_fact
from tests.redis.test_import_redis import ms
from tests.redis.test_import_redis_faults import SECOND_FACTS
from tests.redis_fixtures import _own_server


def summary(facts: list[Fact]) -> dict[str, tuple[float, int]]:
    return {f.subject: (round(f.confidence, 12), f.reinforcement_count) for f in facts}


def reinforcements(events: list[FactEvent]) -> list[tuple[str, str | None]]:
    """(subject, session) of every reinforcement, sorted: each session reinforces a fact
    once, however the observations were split between runs."""
    kinds = (FactEventKind.CREATED, FactEventKind.REINFORCED)
    return sorted((e.subject, e.session_id) for e in events if e.kind in kinds)


def round_observations(day: int) -> list[tuple[str, NewObservation]]:
    """A day of sessions for one identity: tools, failures, entities, domains, late ones."""
    at = T0 + timedelta(days=day)
    out: list[tuple[str, NewObservation]] = []
    for s in range(4):
        session = f"d{day}s{s}"
        out += [
            ("u1", tool_ok(f"tool_{s % 3}", session=session, at=at + timedelta(minutes=s))),
            ("u1", tool_failed("flaky", session=session, at=at + timedelta(minutes=s, seconds=1))),
            ("u1", entity("account", str(s % 2), session=session, at=at)),
            ("u1", domain("royalty", session=session, at=at + timedelta(minutes=s))),
        ]
    # Late: stamped the previous day, delivered now.
    out.append(("u1", tool_ok("late_tool", session=f"late{day}", at=at - timedelta(hours=20))))
    return out


async def test_16_concurrent_consolidations_of_one_identity_equal_the_serial_result(
    redis_url: str, redis_prefix: str
) -> None:
    clock = FakeClock()
    serial = MemoryService.from_url(
        redis_url, prefix=redis_prefix + "serial:", clock=clock, load_timeout=5.0
    )
    # Sixteen services, each with its own client and connections, as sixteen processes.
    workers = [MemoryService.from_url(redis_url, clock=clock, load_timeout=5.0) for _ in range(16)]
    try:
        for day in range(1, 6):
            clock.now = T0 + timedelta(days=day, hours=1)
            observations = round_observations(day)
            for identity, obs in observations:
                serial.emit_observation(identity, obs)
            await serial.drain()
            await serial.consolidate("u1")
            # Half is stored before the race, half by the racers themselves during it.
            half = len(observations) // 2
            for identity, obs in observations[:half]:
                workers[0].emit_observation(identity, obs)
            await workers[0].drain()
            for i, (identity, obs) in enumerate(observations[half:]):
                workers[1 + i % 15].emit_observation(identity, obs)

            async def race(worker: MemoryService) -> list[Fact]:
                await worker.drain()
                return await worker.consolidate("u1")

            await asyncio.gather(*(race(w) for w in workers))
            await workers[0].consolidate("u1")  # whatever the racers left over

        expected = await serial.facts("u1")
        got = await workers[5].facts("u1")
        assert summary(got) == summary(expected)
        assert reinforcements(await workers[3].history("u1")) == reinforcements(
            await serial.history("u1")
        )
        assert len(expected) == 8
        store = workers[0].store
        assert isinstance(store, RedisStore)
        consumed: Any = await store.client.hget(store.keys.of("state", "u1"), "consumed")
        assert int(consumed) == 5 * len(round_observations(1))  # each one exactly once
    finally:
        for service in [serial, *workers]:
            await service.close()


async def test_a_late_observation_stamped_before_the_checkpoint_is_consumed_once(
    redis_url: str,
) -> None:
    clock = FakeClock(T0 + timedelta(days=5))
    service = MemoryService.from_url(redis_url, clock=clock, load_timeout=5.0)
    try:
        service.emit_observation("u1", tool_ok("t", session="s1"))
        await service.drain()
        await service.consolidate("u1")
        # Delivered late: stamped four days before the checkpoint.
        service.emit_observation("u1", tool_ok("t", session="s0", at=T0 + timedelta(days=1)))
        await service.drain()
        facts = {f.subject: f for f in await service.consolidate("u1")}
        assert facts["tool_affinity:t"].reinforcement_count == 2
        facts = {f.subject: f for f in await service.consolidate("u1")}
        assert facts["tool_affinity:t"].reinforcement_count == 2
    finally:
        await service.close()


async def test_a_state_whose_consolidation_time_does_not_parse_consolidates_all_the_same(
    redis_url: str, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    """The load reads when coda-memory last consolidated the identity, to know whether an
    observation arrived late; a value that does not parse is reported, not raised."""
    clock = FakeClock(T0 + timedelta(days=5))
    service = MemoryService.from_url(redis_url, clock=clock, load_timeout=5.0)
    try:
        service.emit_observation("u1", tool_ok("t", session="s1"))
        await service.drain()
        await service.consolidate("u1")
        await redis_client.hset(f"{redis_prefix}state:u1", "consolidatedAt", "yesterday")
        service.emit_observation("u1", tool_ok("u", session="s0", at=T0 + timedelta(days=1)))
        await service.drain()
        facts = {f.subject for f in await service.consolidate("u1")}
        assert facts == {"tool_affinity:t", "tool_affinity:u"}
    finally:
        await service.close()


async def test_an_append_during_a_consolidation_is_left_for_the_next_one(
    redis_store: RedisStore, redis_url: str
) -> None:
    decay = ExponentialDecay()
    writer = RedisStore.from_url(redis_url)
    try:
        first = sanitize_observation("u1", tool_ok("a", session="s1"), T0)
        await writer.append([first])
        async with redis_store.consolidation("u1") as unit:
            batch = await unit.load()
            # Lands after the load, with an older timestamp than the one just loaded.
            late = sanitize_observation("u1", tool_ok("b", session="s2"), T0 - timedelta(hours=1))
            await writer.append([late])
            plan = plan_consolidation("u1", batch, T0 + timedelta(minutes=1), decay)
            await unit.write(plan)
            await unit.commit()
        assert [o.metadata["toolName"] for o in batch.observations] == ["a"]
        _, pending = await redis_store.peek("u1")
        assert pending
        async with redis_store.consolidation("u1") as unit:
            batch = await unit.load()
        assert [o.metadata["toolName"] for o in batch.observations] == ["b"]
    finally:
        await writer.close()


async def test_a_run_whose_lock_expired_commits_nothing(
    redis_store: RedisStore, redis_url: str
) -> None:
    decay = ExponentialDecay()
    await redis_store.append([sanitize_observation("u1", tool_ok("a"), T0)])
    other = RedisStore.from_url(redis_url)
    try:
        async with redis_store.consolidation("u1") as unit:
            batch = await unit.load()
            # The lock expires (as after lock_ttl) and another run takes it.
            await redis_store.client.delete(redis_store.keys.of("lock", "u1"))
            async with other.consolidation("u1"):
                await unit.write(plan_consolidation("u1", batch, T0, decay))
                with pytest.raises(LockLost):
                    await unit.commit()
        assert await redis_store.facts("u1") == []
        assert (await redis_store.peek("u1"))[1]
    finally:
        await other.close()


async def test_a_consolidation_that_outlasts_lock_ttl_keeps_its_lock_and_commits(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """The lock was set once, for ``lock_ttl``: a consolidation that ran longer (a backlog
    of hundreds of thousands of observations) lost it and wrote nothing, at every attempt,
    for ever. Its holder extends it while it runs."""
    ttl = timedelta(milliseconds=600)
    store = RedisStore.from_url(redis_url, lock_ttl=ttl)
    lock = f"{redis_prefix}lock:u1"
    loop = asyncio.get_running_loop()
    try:
        await store.append([sanitize_observation("u1", tool_ok("a"), T0)])
        async with store.consolidation("u1") as unit:
            batch = await unit.load()
            token = await redis_client.get(lock)
            until = loop.time() + 3 * ttl.total_seconds()
            while loop.time() < until:  # the run outlasts lock_ttl three times over
                await asyncio.sleep(0.05)
                assert await redis_client.get(lock) == token
            await unit.write(plan_consolidation("u1", batch, T0, ExponentialDecay()))
            await unit.commit()
        assert [f.subject for f in await store.facts("u1")] == ["tool_affinity:a"]
        assert await redis_client.exists(lock) == 0
    finally:
        await store.close()


async def test_a_consolidation_that_hangs_lets_its_lock_expire_after_a_while(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept for ever, the lock of a consolidation that hangs (a reply that never comes)
    held its identity's consolidations off as long as the process lived."""
    monkeypatch.setattr(store_module, "LOCK_KEPT_FOR_TTLS", 2)
    store = RedisStore.from_url(redis_url, lock_ttl=timedelta(milliseconds=300))
    try:
        await store.append([sanitize_observation("u1", tool_ok("a"), T0)])
        async with store.consolidation("u1") as unit:
            batch = await unit.load()
            async with asyncio.timeout(5):
                while await redis_client.exists(f"{redis_prefix}lock:u1"):
                    await asyncio.sleep(0.05)  # the run hangs until its lock is gone
            await unit.write(plan_consolidation("u1", batch, T0, ExponentialDecay()))
            with pytest.raises(LockLost):
                await unit.commit()
    finally:
        await store.close()


async def test_a_busy_lock_times_out(redis_store: RedisStore, redis_url: str) -> None:
    impatient = RedisStore.from_url(redis_url, lock_timeout=timedelta(milliseconds=50))
    try:
        async with redis_store.consolidation("u1"):
            with pytest.raises(LockTimeout) as busy:
                async with impatient.consolidation("u1"):
                    pass
        # By its label: a host that logs the exception logs no identity.
        assert str(busy.value) == f"the consolidation lock of {identity_label('u1')} stayed busy"
        async with impatient.consolidation("u1"):  # free again
            pass
    finally:
        await impatient.close()


async def test_a_lock_without_an_expiry_ends_after_lock_ttl(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """A lock key copied or restored without its TTL (no coda-memory process sets one
    without) held every consolidation of the identity off for ever: each timed out."""
    store = RedisStore.from_url(
        redis_url, lock_ttl=timedelta(milliseconds=300), lock_timeout=timedelta(seconds=5)
    )
    lock = f"{redis_prefix}lock:u1"
    try:
        await redis_client.set(lock, "a token from a restored copy")
        async with store.consolidation("u1"):
            assert await redis_client.get(lock) != b"a token from a restored copy"
        assert await redis_client.exists(lock) == 0
    finally:
        await store.close()


async def test_a_load_behind_a_dead_holders_lock_answers_with_the_last_facts(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    # A process that died holding an identity's lock leaves it for lock_ttl (30 s). The
    # peek left the facts out whenever observations waited, so every load of the identity
    # came back empty meanwhile: the consolidation waited for the lock, and the load had
    # nothing at hand to answer with when its timeout fired.
    clock = FakeClock()
    service = MemoryService.from_url(
        redis_url, clock=clock, load_timeout=0.2, lock_timeout=timedelta(milliseconds=500)
    )
    try:
        service.emit_observation("u1", tool_ok("t", session="s1"))
        await service.drain()
        before = await service.consolidate("u1")
        assert before
        service.emit_observation("u1", tool_ok("u", session="s2"))
        await service.drain()
        peeked, pending = await service.store.peek("u1")
        assert (peeked, pending) == ([], True)  # no lock held: the facts are left out
        await redis_client.set(f"{redis_prefix}lock:u1", "a dead process's token", px=30_000)
        peeked, pending = await service.store.peek("u1")
        assert pending and {f.subject for f in peeked} == {f.subject for f in before}
        loaded = await service.load_memory("u1")
        assert {f.subject for f in loaded.facts} == {f.subject for f in before}
        stats = service.stats()
        assert (stats.load_stale, stats.load_timeouts) == (1, 0)
    finally:
        await service.close()


async def test_the_history_is_capped_per_identity(redis_url: str) -> None:
    clock = FakeClock()
    service = MemoryService.from_url(redis_url, clock=clock, history_limit=5, load_timeout=5.0)
    try:
        for day in range(8):
            clock.now = T0 + timedelta(days=day)
            service.emit_observation("u1", tool_ok("t", session=f"s{day}"))
            await service.drain()
            await service.consolidate("u1")
        events = await service.history("u1")
        assert [e.count_after for e in events] == [4, 5, 6, 7, 8]
        assert (await service.facts("u1"))[0].reinforcement_count == 8
    finally:
        await service.close()


async def test_retention_prunes_consumed_observations_only(
    redis_store: RedisStore, redis_url: str
) -> None:
    clock = FakeClock()
    service = MemoryService.from_url(redis_url, clock=clock, load_timeout=5.0)
    try:
        service.emit_observation("u1", tool_ok("old", session="s1"))
        await service.drain()
        await service.consolidate("u1")
        clock.advance(days=10)
        service.emit_observation("u1", tool_ok("new", session="s3"))
        await service.drain()
        async with redis_store.consolidation("u1") as unit:
            batch = await unit.load()
            # Appended during the run and older than the retention: still pending, so the
            # run's pruning must leave it for the next run to consume.
            late = sanitize_observation("u1", tool_ok("late", session="s2"), T0)
            await redis_store.append([late])
            await unit.write(plan_consolidation("u1", batch, clock.now, ExponentialDecay()))
            await unit.commit()
        kept = {o.metadata["toolName"] for o in await redis_store.observations("u1")}
        assert kept == {"new", "late"}
        assert {o.metadata["toolName"] for o in batch.observations} == {"new"}
        facts = {f.subject for f in await service.consolidate("u1")}
        assert "tool_affinity:late" in facts
    finally:
        await service.close()


async def test_forget_leaves_no_key_of_the_identity(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    service = MemoryService.from_url(redis_url, load_timeout=5.0, clock=FakeClock())
    try:
        for identity in ("u1", "u2"):
            service.emit_observation(identity, tool_ok("t", session="s1"))
            await service.drain()
            await service.consolidate(identity)
        await service.forget("u1")
        keys = {
            k.decode() async for k in redis_client.scan_iter(match=glob_escape(redis_prefix) + "*")
        }
        assert not any(k.endswith(":u1") for k in keys), keys
        assert await redis_client.hkeys(f"{redis_prefix}checkpoint") == [b"u2"]
        assert await service.facts("u1") == []
        assert len(await service.facts("u2")) == 1
    finally:
        await service.close()


async def test_forget_erases_an_identity_whose_keys_hold_another_type(
    redis_store: RedisStore, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """Its count failed with WRONGTYPE before anything was erased: an identity whose key
    something else wrote with another type could not be forgotten at all."""
    p = redis_prefix
    await redis_client.set(f"{p}obs:u1", "x")
    await redis_client.hset(f"{p}facts:u1", mapping={"f1": "{}", "f2": "{}"})
    await redis_client.set(f"{p}history:u1", "x")
    await redis_client.set(f"{p}state:u1", "x")
    await redis_client.hset(f"{p}checkpoint", mapping={"u1": "1", "u2": "2"})
    forgotten = await redis_store.forget("u1")
    assert (forgotten.observations, forgotten.facts, forgotten.fact_events) == (0, 2, 0)
    assert [k async for k in redis_client.scan_iter(match=glob_escape(p) + "*:u1")] == []
    assert await redis_client.hkeys(f"{p}checkpoint") == [b"u2"]


@pytest.mark.parametrize("kind", ["history", "session-times"])
async def test_a_key_of_another_type_fails_a_commit_before_it_writes_anything(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, kind: str
) -> None:
    """The commit wrote the facts, then failed at the key (WRONGTYPE), its pending
    observations left unconsumed: every later consolidation applied them to the facts
    again, a reinforcement more each time."""
    service = MemoryService.from_url(redis_url, load_timeout=5.0, clock=FakeClock())
    try:
        service.emit_observation("u1", tool_ok("t", session="s1"))
        await service.drain()
        await service.consolidate("u1")
        await redis_client.delete(f"{redis_prefix}{kind}:u1")
        await redis_client.set(f"{redis_prefix}{kind}:u1", "x")
        service.emit_observation("u1", tool_ok("t", session="s2"))
        await service.drain()
        for _ in range(2):
            with pytest.raises(BadRecord, match=f"the identity's {kind} key in Redis holds"):
                await service.consolidate("u1")
        assert [f.reinforcement_count for f in await service.facts("u1")] == [1]
        assert await redis_client.zcard(f"{redis_prefix}pending:u1") == 1
    finally:
        await service.close()


@pytest.mark.parametrize("runs", ["x", "1.5", "9" * 19, "007"])
async def test_a_run_counter_hincrby_cannot_take_counts_anew(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, runs: str
) -> None:
    """The commit's last command failed on it, after everything else was written: every
    consolidation of the identity raised, its answer lost, though it was committed."""
    service = MemoryService.from_url(redis_url, load_timeout=5.0, clock=FakeClock())
    state = f"{redis_prefix}state:u1"
    try:
        service.emit_observation("u1", tool_ok("t", session="s1"))
        await service.drain()
        await service.consolidate("u1")
        await redis_client.hset(state, "runs", runs)
        service.emit_observation("u1", tool_ok("t", session="s2"))
        await service.drain()
        (fact,) = await service.consolidate("u1")
        assert fact.reinforcement_count == 2
        assert await redis_client.hmget(state, ["runs", "consumed"]) == [b"1", b"2"]
    finally:
        await service.close()


@pytest.mark.parametrize(
    "kind", ["obs", "pending", "facts", "history", "state", "sessions", "checkpoint"]
)
async def test_every_read_refuses_a_key_of_another_type_by_its_kind(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, kind: str
) -> None:
    """Each read raised the driver's WRONGTYPE, which named no key: a host or an operator
    could not tell which of the identity's keys something else had written."""
    service = MemoryService.from_url(redis_url, load_timeout=5.0, clock=FakeClock())
    key = f"{redis_prefix}checkpoint" if kind == "checkpoint" else f"{redis_prefix}{kind}:u1"
    said = "the checkpoint map" if kind == "checkpoint" else f"the identity's {kind} key"
    refused = f"^{said} in Redis holds another type of value"
    try:
        service.emit_observation("u1", tool_ok("t", session="s1"))
        await service.drain()
        await service.consolidate("u1")
        service.emit_observation("u1", tool_ok("t", session="s2"))  # one waits
        await service.drain()
        await redis_client.delete(key)
        await redis_client.set(key, "x")
        store = service.store
        assert isinstance(store, RedisStore)
        reads: dict[str, Callable[[str], Awaitable[object]]] = {
            "facts": store.facts,
            "history": store.history,
            "obs": store.observations,
        }
        if kind in reads:
            with pytest.raises(BadRecord, match=refused):
                await reads[kind]("u1")
        if kind != "history":
            with pytest.raises(BadRecord, match=refused):
                await service.consolidate("u1")
        if kind not in ("history", "state", "sessions"):
            with pytest.raises(BadRecord, match=refused):
                await store.peek("u1")
    finally:
        await service.close()


async def test_stats_count_every_identity(redis_store: RedisStore, redis_url: str) -> None:
    service = MemoryService.from_url(redis_url, load_timeout=5.0, clock=FakeClock())
    try:
        for identity in ("a", "b", "c"):
            service.emit_observation(identity, tool_ok("t"))
            service.emit_observation(identity, domain("royalty"))
        await service.drain()
        await service.consolidate("a")
        stats = await redis_store.stats()
        assert (stats.identities, stats.observations, stats.pending_observations) == (3, 6, 4)
        assert (stats.facts, stats.fact_events) == (2, 2)
        assert stats.used_memory_bytes > 0
    finally:
        await service.close()


async def test_stats_count_a_key_whose_identity_is_not_utf8(
    redis_store: RedisStore, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """identities() gives such a key's identity with surrogate escapes; stats() sent
    those back to Redis and failed with UnicodeEncodeError."""
    await redis_client.zadd(f"{redis_prefix}obs:".encode() + b"\xff\xfe", {b"member": 1})
    await redis_client.zadd(f"{redis_prefix}obs:ok", {b"member": 1})
    stats = await redis_store.stats()
    assert (stats.identities, stats.observations) == (2, 2)


async def test_stats_count_a_key_of_another_type_as_such_and_the_others_all_the_same(
    redis_store: RedisStore, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """One identity's key that something else wrote with another type failed the whole
    count (WRONGTYPE): an operator learnt nothing of the other identities."""
    await redis_client.set(f"{redis_prefix}obs:odd", "x")
    await redis_client.zadd(f"{redis_prefix}obs:ok", {b"a": 1, b"b": 2})
    await redis_client.hset(f"{redis_prefix}facts:odd", "f", "{}")
    stats = await redis_store.stats()
    assert (stats.identities, stats.observations, stats.facts) == (2, 2, 1)
    assert stats.keys_of_another_type == 1
    # Every kind of key the layout types, those it does not count included.
    for kind in ("state", "sessions", "session-times", "batches"):
        await redis_client.set(f"{redis_prefix}{kind}:ok", "x")
    stats = await redis_store.stats()
    assert (stats.identities, stats.observations) == (2, 2)
    assert stats.keys_of_another_type == 5


async def test_a_history_record_that_does_not_parse_is_left_out(
    redis_store: RedisStore, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """One broken record made history() raise JSONDecodeError."""
    service = MemoryService(redis_store, clock=FakeClock())
    service.emit_observation("u1", tool_ok("get_account"))
    await service.drain()
    await service.consolidate("u1")
    await redis_client.lpush(f"{redis_prefix}history:u1", "{broken", '{"subject": 1}', "[]")
    events = await service.history("u1")
    assert [(e.subject, e.kind) for e in events] == [
        ("tool_affinity:get_account", FactEventKind.CREATED)
    ]


async def test_the_prefix_comes_from_the_url_or_the_option(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    by_url = RedisStore.from_url(redis_url)
    by_option = RedisStore.from_url(redis_url, prefix=redis_prefix + "x:")
    try:
        await by_url.append([sanitize_observation("u1", tool_ok("t"), T0)])
        await by_option.append([sanitize_observation("u1", tool_ok("t"), T0)])
        assert await redis_client.zcard(f"{redis_prefix}obs:u1") == 1
        assert await redis_client.zcard(f"{redis_prefix}x:obs:u1") == 1
        members: list[Any] = await redis_client.zrange(f"{redis_prefix}obs:u1", 0, -1)
        member = members[0]
        assert json.loads(member)["id"] == "1"
    finally:
        await by_url.close()
        await by_option.close()


async def test_a_connection_lost_mid_consolidation_names_the_identity_by_its_label(
    redis_store: RedisStore, redis_url: str
) -> None:
    """A host logs what the store raises, and a span records it: the message named the
    identity itself."""
    secret = "alice.secret@example.com"
    await redis_store.append([sanitize_observation(secret, tool_ok("a"), T0)])
    killer = aioredis.Redis.from_url(redis_url.split("?")[0])  # (without the prefix)
    try:
        with pytest.raises(ConnectionLost) as raised:
            async with redis_store.consolidation(secret) as unit:
                await unit.load()
                # The store's connection (its pool hands out the one it got back last).
                await killer.client_kill_filter(_id=str(await redis_store.client.client_id()))
                await unit.load()
    finally:
        await killer.aclose()
    assert secret not in str(raised.value)
    assert identity_label(secret) in str(raised.value)


async def _named(client: aioredis.Redis, name: str) -> int:
    """The server's connections named ``name``."""
    return sum(1 for c in await client.client_list() if c.get("name") == name)


async def _until_named(client: aioredis.Redis, name: str, at_least: int, at_most: int) -> None:
    """Wait (5 s at most) until the server's connections named ``name`` are between
    ``at_least`` and ``at_most``."""
    async with asyncio.timeout(5):
        while not at_least <= await _named(client, name) <= at_most:
            await asyncio.sleep(0.01)


async def test_a_call_that_outlives_the_grace_of_close_leaves_no_connection_open(
    redis_url: str, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() released the store while a consolidate() of the caller's still polled for
    the identity's lock; its next command connected again, and that connection stayed
    open for as long as the process kept the store."""
    monkeypatch.setattr(service_module, "CLOSE_GRACE", 0.1)
    name = f"coda-close-{uuid.uuid4().hex}"
    store = RedisStore.from_url(redis_url, lock_timeout=timedelta(seconds=30), client_name=name)
    service = MemoryService(store, clock=FakeClock())
    lock = store.keys.of("lock", "u1")
    consolidating: asyncio.Task[list[Fact]] | None = None
    # The lock's polls pass a gate: closed, the next poll waits before it is sent, so that
    # close() releases the store between two polls, never under one in flight (whose
    # command would then fail, and nothing would connect again).
    gate, parked = asyncio.Event(), asyncio.Event()
    gate.set()
    poll = store.client.set

    async def gated(*args: Any, **kwargs: Any) -> Any:
        if not gate.is_set():
            parked.set()
            await gate.wait()
        return await poll(*args, **kwargs)

    monkeypatch.setattr(store.client, "set", gated)
    try:
        service.emit_observation("u1", tool_ok("get_account"))
        await service.drain(5)
        await redis_client.set(lock, "another consolidation", px=30_000)
        consolidating = asyncio.create_task(service.consolidate("u1"))
        await _until_named(redis_client, name, 1, 10)  # it polls the lock
        gate.clear()
        await asyncio.wait_for(parked.wait(), 5)
        await service.close()  # past its grace: the consolidation still polls
        assert not consolidating.done()
        gate.set()
        await _until_named(redis_client, name, 1, 10)  # over a connection opened again
        await redis_client.delete(lock)
        [fact] = await consolidating
        assert fact.subject == "tool_affinity:get_account"
        await _until_named(redis_client, name, 0, 0)
    finally:
        if consolidating is not None:
            await asyncio.wait({consolidating}, timeout=5)
        await redis_client.delete(lock)
        await service.close()


async def test_an_option_nobody_takes_is_refused_when_the_service_is_made(redis_url: str) -> None:
    """redis-py took any keyword and failed at the first connection, which load_memory
    does not raise: a mistyped option (``max_fact``) went unnoticed."""
    with pytest.raises(TypeError, match=r"unexpected options for redis://: \['max_fact'\]"):
        MemoryService.from_url(redis_url, max_fact=3)
    # redis-py's own options still reach its client.
    async with MemoryService.from_url(redis_url, socket_timeout=5, max_connections=4) as memory:
        memory.emit_observation("u1", tool_ok("a"))
        await memory.drain()
        assert memory.stats().stored == 1
        pool = memory.store.client.connection_pool  # type: ignore[attr-defined]
        assert pool.max_connections == 4


async def test_a_batch_retried_with_its_key_is_stored_once(
    redis_store: RedisStore, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    # A retry after a lost reply (the append ran, the reply never came) sends the same
    # batch with the same key: it was stored a second time, and consolidated twice.
    records = [
        sanitize_observation(identity, obs, T0)
        for identity, obs in [("u1", tool_ok("t", session=None)), ("u2", tool_ok("t"))]
    ]
    key = str(uuid.uuid4())
    first = await redis_store.append(records, batch_key=key)
    again = await redis_store.append(records, batch_key=key)
    assert first == again and first.stored == 2
    assert await redis_client.zcard(f"{redis_prefix}obs:u1") == 1
    assert await redis_client.zcard(f"{redis_prefix}pending:u2") == 1
    # Another batch (another key) of the same rows is stored.
    await redis_store.append(records, batch_key=str(uuid.uuid4()))
    assert await redis_client.zcard(f"{redis_prefix}obs:u1") == 2
    # The keys expire with the set that holds them.
    assert 0 < await redis_client.pttl(f"{redis_prefix}batches:u1") <= 24 * 3600 * 1000


async def test_forget_keeps_the_identitys_batch_keys_without_its_id(
    redis_store: RedisStore, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """Erased with the identity, its batch keys let a batch stored before the forget be
    stored again when retried after it (the erased observations came back): they are
    kept for a day in a shared set, as hashes that name no identity. That set holding
    another type of value (something else wrote it) stops neither forget nor append."""
    records = [sanitize_observation("u1", tool_ok("t"), T0)]
    key = str(uuid.uuid4())
    await redis_store.append(records, batch_key=key)
    await redis_store.forget("u1")
    forgotten = f"{redis_prefix}forgotten-batches"
    members: Any = await redis_client.zrange(forgotten, 0, -1)
    assert len(members) == 1 and re.fullmatch(rb"[0-9a-f]{40}", members[0])
    assert 0 < await redis_client.pttl(forgotten) <= 24 * 3600 * 1000
    assert await redis_client.exists(f"{redis_prefix}batches:u1") == 0
    assert (await redis_store.append(records, batch_key=key)).stored == 1
    assert await redis_store.observations("u1") == []
    # Another type of value there: read as holding no batch key, and left as it is.
    await redis_client.delete(forgotten)
    await redis_client.set(forgotten, "x")
    await redis_store.append(records, batch_key=key)
    assert len(await redis_store.observations("u1")) == 1
    await redis_store.forget("u1")
    assert await redis_client.get(forgotten) == b"x"


async def test_a_lock_whose_reply_was_lost_is_released(
    redis_store: RedisStore, redis_prefix: str, redis_client: aioredis.Redis, monkeypatch: Any
) -> None:
    # The SET NX reached the server and took the lock, and its reply was lost: nobody held
    # the token to release it, and every consolidation of the identity timed out for
    # lock_ttl (30 s).
    real_set = redis_store.client.set

    async def reply_lost(*args: Any, **kwargs: Any) -> Any:
        await real_set(*args, **kwargs)
        raise RedisConnectionError("Connection closed by server.")

    monkeypatch.setattr(redis_store.client, "set", reply_lost)
    with pytest.raises(ConnectionLost):
        async with redis_store.consolidation("u1"):
            pass
    monkeypatch.undo()
    assert await redis_client.exists(f"{redis_prefix}lock:u1") == 0


@pytest.mark.parametrize(
    ("call", "doing"),
    [
        (lambda s: s.facts("u1"), "reading facts"),
        (lambda s: s.peek("u1"), "reading facts"),
        (lambda s: s.history("u1"), "reading fact history"),
        (lambda s: s.observations("u1"), "reading observations"),
        (lambda s: s.checkpoint("u1"), "reading a checkpoint"),
        (lambda s: s.identities(), "listing identities"),
        (lambda s: s.stats(), "listing identities"),
        (lambda s: s.forget("u1"), "while locking"),
        (lambda s: s.append([sanitize_observation("u1", tool_ok("t"), T0)]), "storing"),
    ],
)
async def test_every_call_raises_connection_lost_when_redis_cannot_be_reached(
    call: Any, doing: str
) -> None:
    # Postgres raises ConnectionLost for a connection that died; the Redis store let
    # redis-py's own ConnectionError out of its reads and of forget, so a host that caught
    # the library's error on one store missed it on the other.
    store = RedisStore.from_url("redis://127.0.0.1:1/0")
    try:
        with pytest.raises(ConnectionLost, match=doing) as raised:
            await call(store)
        assert isinstance(raised.value.__cause__, RedisConnectionError)
    finally:
        await store.close()


async def test_start_reaches_the_server_or_says_it_cannot(redis_url: str) -> None:
    service = MemoryService.from_url(redis_url)
    try:
        await service.start()
    finally:
        await service.close()
    unreachable = MemoryService.from_url("redis://127.0.0.1:1/0")
    try:
        with pytest.raises(ConnectionLost, match=r"cannot reach Redis at 127\.0\.0\.1:1 "):
            await unreachable.start()
    finally:
        await unreachable.close()


async def test_the_writer_retries_a_batch_whose_reply_was_lost_and_it_is_stored_once(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis, monkeypatch: Any
) -> None:
    # The EXEC ran on the server and its reply was lost: the writer retried the batch (the
    # same key), which was stored, and consolidated, a second time.
    real_execute = aioredis.client.Pipeline.execute
    lost: list[int] = []

    async def reply_lost_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = await real_execute(self, *args, **kwargs)
        if not lost:
            lost.append(1)
            raise RedisConnectionError("Connection closed by server.")
        return result

    monkeypatch.setattr(aioredis.client.Pipeline, "execute", reply_lost_once)
    service = MemoryService.from_url(redis_url, load_timeout=5.0, clock=FakeClock())
    try:
        service.emit_observation("u1", tool_ok("t", session=None))
        service.emit_observation("u1", tool_ok("t", session="s2"))
        await service.drain(10)
        assert lost and service.stats().stored == 2
        assert await redis_client.zcard(f"{redis_prefix}obs:u1") == 2
        facts = await service.consolidate("u1")
        assert [(f.subject, f.reinforcement_count) for f in facts] == [("tool_affinity:t", 2)]
    finally:
        await service.close()


async def test_an_identity_whose_key_holds_another_type_refuses_its_rows_alone(
    redis_url: str, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    """MULTI/EXEC rolls nothing back: one identity's script failed on a key of another
    type, the batch was counted as rejected, and the other identities' rows were stored
    all the same (its batch key too, so that a retry stored nothing)."""
    await redis_client.set(f"{redis_prefix}state:bad", "x")
    service = MemoryService.from_url(redis_url, clock=FakeClock(), load_timeout=5.0)
    try:
        await bad_refused_alone(service, redis_client, redis_prefix)
        for identity in ("good1", "good2"):
            assert [f.subject for f in await service.consolidate(identity)] == ["tool_affinity:t"]
    finally:
        await service.close()


# 18 digits: within HINCRBY's range, past the whole numbers Lua's doubles hold exactly
# (the three rows of a batch came out with one id).
@pytest.mark.parametrize("seq", ["x", "1.5", "99999999999999999999", "999999999999999990"])
async def test_an_identity_whose_sequence_is_no_whole_number_refuses_its_rows_alone(
    redis_url: str, redis_client: aioredis.Redis, redis_prefix: str, seq: str
) -> None:
    """A state hash of the right type whose seq something else wrote (not a whole number,
    or past HINCRBY's range) failed the identity's script at HINCRBY, after its batch key
    was written: the whole batch was counted as rejected though the other identities'
    rows were stored, and the identity's retry found its key and stored nothing."""
    await redis_client.hset(f"{redis_prefix}state:bad", "seq", seq)
    service = MemoryService.from_url(redis_url, clock=FakeClock(), load_timeout=5.0)
    try:
        await bad_refused_alone(service, redis_client, redis_prefix)
        assert await redis_client.hget(f"{redis_prefix}state:bad", "seq") == seq.encode()
    finally:
        await service.close()


@pytest.mark.parametrize("record", ["{not json", '[{"subject": 5}]', '"a string"'])
async def test_a_session_record_that_does_not_parse_is_skipped(
    redis_url: str, redis_client: aioredis.Redis, redis_prefix: str, record: str
) -> None:
    """It made every consolidation of the identity raise, for ever: its loads answered
    empty and its observations stayed pending."""
    service = MemoryService.from_url(redis_url, clock=FakeClock(), load_timeout=5.0)
    try:
        service.emit_observation("u1", tool_ok("t", session="s0"))
        await service.drain()
        await service.consolidate("u1")
        await redis_client.hset(f"{redis_prefix}sessions:u1", "s0", record)
        service.emit_observation("u1", tool_ok("u", session="s0"))
        await service.drain()
        facts = await service.consolidate("u1")
        assert {f.subject for f in facts} == {"tool_affinity:t", "tool_affinity:u"}
        assert await redis_client.zcard(f"{redis_prefix}pending:u1") == 0
    finally:
        await service.close()


async def test_a_clock_that_jumps_forward_past_the_session_horizon_forgets_no_session(
    redis_url: str, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    """A consolidation on a clock ahead by more than ``session_horizon`` pruned every
    session's record by its now: once the clock was back, a later observation of a
    session already counted reinforced its fact a second time. Records are pruned only
    once they are past the horizon by the run's now and by the newest reinforcement
    recorded before the run, so memory stays bounded as time really passes."""
    clock = FakeClock()
    horizon = timedelta(days=1)
    service = MemoryService.from_url(
        redis_url, clock=clock, load_timeout=5.0, session_horizon=horizon
    )
    times = f"{redis_prefix}session-times:u1"
    try:
        service.emit_observation("u1", tool_ok("t", session="s1", at=T0))
        await service.drain()
        await service.consolidate("u1")
        clock.advance(days=3)  # one run on a clock three horizons ahead
        service.emit_observation("u1", tool_ok("u", session="s2", at=T0 + timedelta(minutes=1)))
        await service.drain()
        await service.consolidate("u1")
        clock.now = T0 + timedelta(hours=1)  # and the clock is right again
        service.emit_observation("u1", tool_ok("t", session="s1", at=T0 + timedelta(minutes=2)))
        await service.drain()
        facts = await service.consolidate("u1")
        assert summary(facts)["tool_affinity:t"][1] == 1
        assert [e.kind for e in await service.history("u1") if e.session_id == "s1"] == [
            FactEventKind.CREATED,
            FactEventKind.EXTENDED,
        ]
        # Time really passes: the records past the horizon go, a run after the first
        # reinforcement recorded past them.
        for day, session in ((3, "s3"), (4, "s4")):
            clock.now = T0 + timedelta(days=day)
            service.emit_observation("u1", tool_ok("v", session=session, at=clock.now))
            await service.drain()
            await service.consolidate("u1")
        assert sorted(await redis_client.zrange(times, 0, -1)) == [b"s3", b"s4"]
        assert sorted(await redis_client.hkeys(f"{redis_prefix}sessions:u1")) == [b"s3", b"s4"]
    finally:
        await service.close()


@pytest.mark.parametrize(
    "at",
    [
        datetime.min.replace(tzinfo=UTC) + timedelta(microseconds=1),
        datetime.max.replace(tzinfo=UTC) - timedelta(microseconds=1),
    ],
)
async def test_a_time_a_microsecond_inside_the_range_of_datetime_is_read_back(
    redis_store: RedisStore, at: datetime
) -> None:
    """Epoch ms as a double rounded ``datetime.min`` + 1 µs onto ``datetime.min`` (the
    instant a read refuses: Postgres keeps it as -infinity), and ``datetime.max`` - 1 µs
    past the range: the observation, the fact, its event and the checkpoint so dated
    were written, then skipped on every read (the observation consumed unread)."""
    near = timedelta(microseconds=31)  # a double's step that far from 1970
    await redis_store.append([record("edge", created_at=at)])
    (stored,) = await redis_store.observations("alice")
    assert abs(stored.created_at - at) <= near
    loaded = await consolidate(redis_store, upserts=[fact(at=at)], events=[event(at=at)])
    assert contents(loaded.observations) == ["edge"]
    (kept,) = await redis_store.facts("alice")
    assert abs(kept.last_reinforced_at - at) <= near and abs(kept.anchor - at) <= near
    (recorded,) = await redis_store.history("alice")
    assert abs(recorded.at - at) <= near
    checkpoint = await redis_store.checkpoint("alice")
    assert checkpoint is not None and abs(checkpoint - at) <= near


#: How the store refuses a checkpoint that is not epoch ms: by the map, not the identity.
CHECKPOINT_REFUSED = r"^\S+checkpoint \(the checkpoint map\): the checkpoint is not epoch ms"


@pytest.mark.parametrize("checkpoint", ["garbage", "-inf", "0x10", "nan", "1e3", "", "1.5.2"])
async def test_checkpoint_refuses_a_value_that_is_not_epoch_ms_without_quoting_it(
    redis_store: RedisStore, redis_client: aioredis.Redis, redis_prefix: str, checkpoint: str
) -> None:
    """``checkpoint()`` raised a bare ValueError of float() quoting the value, and read
    ``1e3`` as a time where the scripts refuse it: it refuses what they refuse, with the
    BadRecord that a consolidation raises too, naming the checkpoint map and neither the
    identity nor the value (a host logs what it raises)."""
    await redis_client.hset(f"{redis_prefix}checkpoint", "u-4711", checkpoint)
    with pytest.raises(BadRecord, match=CHECKPOINT_REFUSED) as raised:
        await redis_store.checkpoint("u-4711")
    assert "4711" not in str(raised.value)
    assert not checkpoint or checkpoint not in str(raised.value)
    await redis_client.hset(f"{redis_prefix}checkpoint", "u-4711", "1767258000000.5")
    assert await redis_store.checkpoint("u-4711") == datetime(2026, 1, 1, 9, 0, 0, 500, UTC)


@pytest.mark.parametrize(
    "checkpoint",
    ["garbage", "-inf", "0x10", "nan", "1e3", "", "-99999999999999999", "253402300800000"],
)
async def test_a_checkpoint_that_is_not_epoch_ms_is_refused_not_read_as_none(
    redis_url: str, redis_client: aioredis.Redis, redis_prefix: str, checkpoint: str
) -> None:
    """Read as no checkpoint, every observation consumed before counted again (or the
    load and Python parsed it differently, and every consolidation failed): the
    identity's consolidation is refused, and nothing counts twice. The refusal is the
    store's BadRecord, as for every corrupt value (it was the driver's ResponseError)."""
    clock = FakeClock()
    service = MemoryService.from_url(redis_url, clock=clock, load_timeout=5.0)
    try:
        for _ in range(3):
            service.emit_observation("u1", tool_ok("t", session=None))
        await service.drain()
        (fact,) = await service.consolidate("u1")
        await redis_client.hset(f"{redis_prefix}checkpoint", "u1", checkpoint)
        clock.advance(minutes=1)
        with pytest.raises(BadRecord, match=CHECKPOINT_REFUSED):
            await service.consolidate("u1")
        loaded = await service.load_memory("u1")
        assert [f.reinforcement_count for f in loaded.facts] in ([], [1])
        (again,) = await service.facts("u1")
        assert again.reinforcement_count == fact.reinforcement_count == 1
    finally:
        await service.close()


async def test_a_backlog_is_read_and_written_with_turns_of_the_event_loop(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an outage thousands of observations wait: their records were parsed, and the
    commit's document made, in one go each, holding the loop for tens of milliseconds
    (loads of other identities then outlived their timeout). Each record notes the turn of
    the loop it was handled in: in one go, all share one."""
    from coda_memory.redis import codec
    from coda_memory.redis import unit as unit_module

    service = MemoryService.from_url(redis_url, clock=FakeClock(), load_timeout=5.0)
    turns = LoopTurns()
    parsed: list[int] = []
    written: list[int] = []
    parse, value = codec.observation_from_json, codec.event_value

    def parsing(identity_id: str, member: Any) -> Any:
        parsed.append(turns.count)
        return parse(identity_id, member)

    def writing(event: FactEvent) -> Any:
        written.append(turns.count)
        return value(event)

    try:
        for n in range(1_000):
            service.emit_observation("u1", tool_ok(f"tool_{n % 50}", session=f"s{n}"))
        await service.drain(30)
        monkeypatch.setattr(unit_module, "observation_from_json", parsing)
        monkeypatch.setattr(unit_module, "event_value", writing)
        async with turns:
            facts = await service.consolidate("u1")
        assert sum(f.reinforcement_count for f in facts) == 1_000
        assert len(parsed) == 1_000 and len(set(parsed)) >= 1_000 // 200
        assert len(written) >= 1_000 and len(set(written)) >= 1_000 // 200
    finally:
        await service.close()


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis://app:Tr0ub4dor#3@127.0.0.1:6379/0", "the port is not a number"),
        ("redis://app:pa55/w0rd@127.0.0.1:6379/0", "the port is not a number"),
        ("redis://app:8080/s3cret@127.0.0.1:6379/0", "the host part ends before its '@'"),
        ("redis://127.0.0.1:6379/abc", "the database (the path after"),
        ("redis://app:8080#pw@127.0.0.1:6379/0", "the host part ends before its '@'"),
        ("redis://app:1234?z@127.0.0.1:6379/0", "the host part ends before its '@'"),
        ("redis://app:1234567/8@127.0.0.1:6379/0", "the port is out of range (1 to 65535)"),
    ],
)
def test_a_redis_url_that_redis_py_would_misread_is_refused_without_its_password(
    url: str, why: str
) -> None:
    """redis-py's parser said "Port could not be cast to integer value as 'Tr0ub4dor'"
    (part of the password, in a message a host logs at startup), or read /abc as
    database 0; with /s3cret after a password's "/", it reached for host "app"."""
    with pytest.raises(ValueError) as raised:
        MemoryService.from_url(url)
    message = str(raised.value)
    assert why in message
    assert "percent-encoded" in message or "abc" in url
    for secret in ("Tr0ub4dor", "pa55", "w0rd", "s3cret", "8080", "#pw", "1234", "?z", "/8"):
        assert secret not in message
    # Nor in a traceback: redis-py's own error is not chained to it.
    error = raised.value
    assert (error.__cause__ or (None if error.__suppress_context__ else error.__context__)) is None


@pytest.mark.parametrize(
    "url",
    [
        "unix:///run/redis/redis.sock?db=0&password=s3cr@t",
        "redis://127.0.0.1:6379/0?password=p@ss",
        "rediss://127.0.0.1:6379/0?ssl_ca_certs=/etc/certs/ca@corp.pem",
        "unix:///home/a@corp/redis.sock",
        "redis://user:p%40ss@127.0.0.1:6379/0",
    ],
)
def test_an_at_sign_that_is_the_urls_own_is_taken(url: str) -> None:
    MemoryService.from_url(url)  # (no connection is made here)


@pytest.mark.parametrize("port", ["0", "65536", "99999"])
def test_a_redis_port_out_of_range_is_refused_as_such(port: str) -> None:
    """A port of digits past 65535 was refused as "the port is not a number", and port 0
    was taken (every connection then refused), where a Postgres URL's is refused as a
    port outside 1 to 65535."""
    with pytest.raises(ValueError, match=r"the port is out of range \(1 to 65535\)"):
        MemoryService.from_url(f"redis://127.0.0.1:{port}/0")


@pytest.mark.parametrize(
    "url",
    [
        "redis:app:s3cret@db:6379/0",
        "redis:/app:s3cret@db/0",
        "rediss:s3cret@db",
        "redis:",
        "unix:app:s3cret@/run/redis.sock",
        "unix:/app:s3cret@/run/redis.sock",
    ],
)
def test_a_redis_url_without_its_slashes_is_refused_without_quoting_it(url: str) -> None:
    """With no "//" there is no host part, and the mask (of the password in it) did
    nothing: "redis:app:s3cret@db:6379/0" was quoted whole in the error, password and
    all, and one without an "@" was "the database … is not a number"; a unix: one was
    taken whole for a socket's path, which start()'s error quoted."""
    with pytest.raises(ValueError, match=r"no '//' after '(rediss?|unix):'") as raised:
        MemoryService.from_url(url)
    assert "s3cret" not in str(raised.value)


@pytest.mark.parametrize(
    ("query", "unknown"),
    [("?sokcet_timeout=1", "sokcet_timeout"), ("?ssl_cert_reqs=none", "ssl_cert_reqs")],
)
async def test_a_redis_url_parameter_nothing_takes_is_refused_when_the_service_is_made(
    redis_url: str, query: str, unknown: str
) -> None:
    """redis-py handed it to its connections, which refused it as they connected: start()
    raised a TypeError, and without start() every load answered empty and every batch
    failed. (ssl_cert_reqs is a rediss:// one.)"""
    with pytest.raises(ValueError, match=rf"unknown Redis URL parameter\(s\) \['{unknown}'\]"):
        MemoryService.from_url(redis_url.partition("?")[0] + query)
    service = MemoryService.from_url(redis_url.partition("?")[0] + "?socket_timeout=5")
    try:
        await service.start()
    finally:
        await service.close()


def test_a_unix_socket_url_names_the_redis_store(tmp_path: Any) -> None:
    socket_path = tmp_path / "redis.sock"
    with contextlib.contextmanager(_own_server)("--unixsocket", str(socket_path)):

        async def use() -> list[Fact]:
            url = f"unix://{socket_path}?db=3&prefix=unixtest:"
            async with MemoryService.from_url(url, clock=FakeClock()) as memory:
                await memory.start()
                memory.emit_observation("ana", tool_ok("get_account"))
                await memory.drain(5)
                return (await memory.load_memory("ana")).facts

        (fact,) = asyncio.run(use())
        assert fact.subject == "tool_affinity:get_account"


async def test_start_names_what_the_server_refused(redis_url: str) -> None:
    """A database out of range (SELECT fails as the connection opens) raised redis-py's
    bare ResponseError from start(), which a lifespan catching ConnectionLost (as the
    FastAPI example does) did not catch: the app did not start."""
    out_of_range = urlsplit(redis_url)._replace(path="/99", query="").geturl()
    service = MemoryService.from_url(out_of_range)
    try:
        with pytest.raises(ConnectionLost, match=r"\(ResponseError: DB index is out of range\)"):
            await service.start()
    finally:
        await service.close()


@pytest.mark.parametrize(("stored", "kept"), SECOND_FACTS)
async def test_a_second_fact_about_a_subject_is_left_out_by_one_rule_and_erased(
    redis_url: str,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    stored: tuple[tuple[str, float, float], ...],
    kept: str,
) -> None:
    """The original layout may hold two facts about one subject: ``facts`` listed both,
    and a consolidation kept whichever ``HVALS`` gave last (the one written last), where
    the import copies another. Every read keeps one by one rule, and the consolidation
    reinforces that one and erases the other (read again once the kept one decayed below
    its stale confidence, or was deleted, it came back)."""
    facts_key = f"{redis_prefix}facts:u1"
    # The one kept written first: HVALS gives it first, and the other last.
    for field, confidence, updated in sorted(stored, key=lambda s: s[0] != kept):
        await redis_client.hset(
            facts_key, field, stored_fact("u1", "t", confidence, 1, id=field, updatedAt=ms(updated))
        )
    service = MemoryService.from_url(
        redis_url, clock=FakeClock(T0 + timedelta(days=10)), load_timeout=5.0
    )
    try:
        assert [f.id for f in await service.store.facts("u1")] == [kept]
        assert [f.id for f in (await service.store.peek("u1"))[0]] == [kept]
        service.emit_observation("u1", tool_ok("t", session="s1"))
        await service.drain()
        (reinforced,) = await service.consolidate("u1")
        assert reinforced.reinforcement_count == 2
        assert await redis_client.hkeys(facts_key) == [kept.encode()]
    finally:
        await service.close()


async def test_of_two_facts_about_a_subject_the_fresh_one_is_kept_with_its_reinforcements(
    redis_url: str, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    """The rule compared stored confidences, each as of its own anchor: a fact untouched
    since day 1 at 0.9 outranked one reinforced on day 9 at 0.6, was served (decayed), and
    the consolidation erased the fresh one with its five reinforcements."""
    facts_key = f"{redis_prefix}facts:u1"
    stale = stored_fact("u1", "t", 0.9, 1, id="fact:a", updatedAt=ms(1), lastReinforcedAt=ms(1))
    fresh = stored_fact("u1", "t", 0.6, 5, id="fact:b", updatedAt=ms(9), lastReinforcedAt=ms(9))
    await redis_client.hset(facts_key, mapping={"fact:a": stale, "fact:b": fresh})
    service = MemoryService.from_url(
        redis_url, clock=FakeClock(T0 + timedelta(days=10)), load_timeout=5.0
    )
    try:
        assert [f.id for f in await service.store.facts("u1")] == ["fact:b"]
        service.emit_observation("u1", tool_ok("t", session="s1"))
        await service.drain()
        (reinforced,) = await service.consolidate("u1")
        assert (reinforced.id, reinforced.reinforcement_count) == ("fact:b", 6)
        assert await redis_client.hkeys(facts_key) == [b"fact:b"]
    finally:
        await service.close()
