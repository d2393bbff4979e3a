"""The consolidation's read of a backlog, in pages: no reply carries more than a page, and
every observation is consumed once, whatever lands or goes between the pages."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from redis.asyncio.connection import Connection

from coda_memory.core.consolidation import plan_consolidation
from coda_memory.core.decay import ExponentialDecay
from coda_memory.core.model import Observation
from coda_memory.core.sanitize import sanitize_observation
from coda_memory.redis import RedisStore
from coda_memory.redis import unit as unit_module
from coda_memory.redis.codec import observation_from_json
from tests.helpers import T0, tool_ok
from tests.redis.test_seed_layout import seed_observation

PAGE = 7


def _records(reply: Any) -> list[bytes]:
    """The observation records a reply carries (at any depth)."""
    if isinstance(reply, bytes):
        is_record = reply.startswith(b'{"id":') and b'"type":"tool_success"' in reply
        return [reply] if is_record else []
    if isinstance(reply, list):
        return [record for part in reply for record in _records(part)]
    return []


#: How many observation records each reply that a _Recording connection read carried.
_COUNTS: list[int] = []
#: How many bytes of observation records each of those replies carried.
_BYTES: list[int] = []


class _Recording(Connection):
    """A connection that notes how many observation records each reply carried."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        reply = await super().read_response(*args, **kwargs)
        records = _records(reply)
        _COUNTS.append(len(records))
        _BYTES.append(sum(len(record) for record in records))
        return reply


async def _seed(store: RedisStore, identity: str, pending: int, original: int) -> None:
    """``pending`` observations appended by coda-memory, and ``original`` ones the
    original server wrote (in ``obs:`` alone), dated among them."""
    for n in range(pending):
        at = T0 + timedelta(minutes=n)
        await store.append([sanitize_observation(identity, tool_ok(f"t{n}", f"s{n}"), at)])
    members = {
        seed_observation(identity, f"orig-{n}", int((T0.timestamp() + 90 * n) * 1000), f"o{n}"): (
            T0.timestamp() + 90 * n
        )
        * 1000
        for n in range(original)
    }
    if members:
        await store.client.zadd(store.keys.of("obs", identity), members)


async def _run(store: RedisStore, identity: str) -> list[Observation]:
    """One consolidation that consumes what it loads; the observations it loaded."""
    async with store.consolidation(identity) as unit:
        loaded = await unit.load()
        plan = plan_consolidation(identity, loaded, T0 + timedelta(days=1), ExponentialDecay())
        await unit.write(plan)
        await unit.commit()
    return list(loaded.observations)


def _names(observations: list[Observation]) -> list[str]:
    return sorted(str(o.metadata["toolName"]) for o in observations)


async def test_a_backlog_is_read_in_pages_of_bounded_replies(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog read in one reply outlived redis-py's socket timeout (5 s) at every
    attempt, and the identity was never consolidated: no reply carries more than a page,
    and every observation, pending or the original server's, is read once."""
    monkeypatch.setattr(unit_module, "LOAD_PAGE", PAGE, raising=False)
    store = RedisStore.from_url(redis_url, connection_class=_Recording)
    try:
        await _seed(store, "u1", pending=40, original=17)
        _COUNTS.clear()
        _BYTES.clear()
        loaded = await _run(store, "u1")
        assert len(loaded) == 57
        assert _names(loaded) == sorted([f"t{n}" for n in range(40)] + [f"o{n}" for n in range(17)])
        # The first read's two pages (pending, then the original server's), each with
        # its last member read again as the next one's cursor; then one page a reply.
        largest, second = sorted(_COUNTS)[-2:][::-1]
        assert 0 < largest <= 2 * (PAGE + 1) and second <= PAGE + 1
        assert await store.client.zcard(store.keys.of("pending", "u1")) == 0
        assert await store.client.hget(store.keys.of("state", "u1"), "consumed") == b"57"
        # The checkpoint moved past every observation read: nothing waits.
        assert (await store.peek("u1"))[1] is False
        assert await _run(store, "u1") == []
    finally:
        await store.close()
        _COUNTS.clear()
        _BYTES.clear()


async def test_a_page_ends_once_its_records_reach_the_byte_budget(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records of up to 2,000 characters of content and 16 KiB of metadata made pages of
    10,000 of them hundreds of megabytes: a page also ends with the record that reaches
    ``LOAD_PAGE_BYTES``."""
    budget = 1_000
    monkeypatch.setattr(unit_module, "LOAD_PAGE_BYTES", budget, raising=False)
    store = RedisStore.from_url(redis_url, connection_class=_Recording)
    try:
        await _seed(store, "u1", pending=30, original=20)
        longest = max(
            len(member) for member in await store.client.zrange(store.keys.of("obs", "u1"), 0, -1)
        )
        _COUNTS.clear()
        _BYTES.clear()
        assert len(await _run(store, "u1")) == 50
        # Each page: records up to the one that reaches the budget, and its last record
        # again (the next page's cursor); the first read holds two pages.
        assert 0 < max(_BYTES) <= 2 * (budget + 2 * longest)
        assert sorted(_BYTES)[-2] <= budget + 2 * longest
    finally:
        await store.close()
        _COUNTS.clear()
        _BYTES.clear()


def _between_pages(store: RedisStore, act: Callable[[list[Any]], Any]) -> list[list[Any]]:
    """The arguments of each call of the load script; ``act`` awaited with them before
    each call of a later page."""
    calls: list[list[Any]] = []
    load = store._load_script

    async def paged(*, keys: list[str], args: list[Any]) -> Any:
        calls.append(list(args))
        if len(args) > 3:
            await act(args)
        return await load(keys=keys, args=args)

    store._load_script = paged  # type: ignore[method-assign]
    return calls


async def test_what_lands_between_the_pages_is_left_for_the_next_run(
    redis_store: RedisStore, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Appends between two pages (one dated before the backlog, one after, both scored
    after the checkpoint in ``obs:``) are neither read nor consumed: the next run
    consumes them, once."""
    monkeypatch.setattr(unit_module, "LOAD_PAGE", 5)
    await _seed(redis_store, "u1", pending=23, original=12)
    writer = RedisStore.from_url(redis_url)
    appended: list[str] = []

    async def append(args: list[Any]) -> None:
        if appended:
            return
        for name, at in (("late", T0 - timedelta(hours=1)), ("fresh", T0 + timedelta(days=3))):
            await writer.append([sanitize_observation("u1", tool_ok(name, name), at)])
            appended.append(name)

    try:
        calls = _between_pages(redis_store, append)
        first = await _run(redis_store, "u1")
        assert {str(call[3]) for call in calls[1:]} == {"pending", "obs"}
        assert len(first) == 35 and len({o.id for o in first}) == 35
        assert "late" not in _names(first) and "fresh" not in _names(first)
        assert await redis_store.client.zcard(redis_store.keys.of("pending", "u1")) == 2
        assert _names(await _run(redis_store, "u1")) == ["fresh", "late"]
        assert await _run(redis_store, "u1") == []
        state = redis_store.keys.of("state", "u1")
        assert await redis_store.client.hget(state, "consumed") == b"37"
    finally:
        await writer.close()


async def test_a_member_removed_between_the_pages_moves_no_other_out_of_the_read(
    redis_store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Something else removes the last member a page of ``obs:`` read before the next
    page (the original server pruning): the next page starts from its score, and every
    other member is read once."""
    monkeypatch.setattr(unit_module, "LOAD_PAGE", 4)
    await _seed(redis_store, "u1", pending=0, original=15)
    removed: list[bytes] = []

    async def remove(args: list[Any]) -> None:
        removed.append(args[6])
        await redis_store.client.zrem(redis_store.keys.of("obs", "u1"), args[6])

    calls = _between_pages(redis_store, remove)
    loaded = await _run(redis_store, "u1")
    assert len(calls) == 4 and len(removed) == 3
    assert _names(loaded) == sorted(f"o{n}" for n in range(15))


async def test_the_commit_removes_the_pending_members_read_by_their_numbers(
    redis_store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit sent every consumed pending member back (a backlog's made a request of
    hundreds of megabytes): it sends the highest number read, and removes those numbered
    up to it."""
    monkeypatch.setattr(unit_module, "LOAD_PAGE", 5)
    await _seed(redis_store, "u1", pending=23, original=0)
    sent: list[int] = []
    commit = redis_store._commit_script

    async def counted(*, keys: list[str], args: list[Any]) -> Any:
        sent.append(len(args))
        return await commit(keys=keys, args=args)

    redis_store._commit_script = counted  # type: ignore[method-assign]
    assert len(await _run(redis_store, "u1")) == 23
    assert sent == [5]
    assert await redis_store.client.zcard(redis_store.keys.of("pending", "u1")) == 0
    assert await _run(redis_store, "u1") == []


async def test_a_sequence_reset_under_a_run_leaves_the_members_it_did_not_read(
    redis_store: RedisStore, redis_url: str
) -> None:
    """Something deletes the identity's state (its sequence) while a run holds the lock,
    and an append numbers its member from 1 again, among those the run read: the commit
    removes the members the run read, by member, and the new one is the next run's."""
    await _seed(redis_store, "u1", pending=6, original=0)
    writer = RedisStore.from_url(redis_url)
    sent: list[int] = []
    commit = redis_store._commit_script

    async def counted(*, keys: list[str], args: list[Any]) -> Any:
        sent.append(len(args))
        return await commit(keys=keys, args=args)

    redis_store._commit_script = counted  # type: ignore[method-assign]
    try:
        async with redis_store.consolidation("u1") as unit:
            loaded = await unit.load()
            await redis_store.client.delete(redis_store.keys.of("state", "u1"))
            late = sanitize_observation("u1", tool_ok("again", "again"), T0)
            await writer.append([late])
            plan = plan_consolidation("u1", loaded, T0 + timedelta(days=1), ExponentialDecay())
            await unit.write(plan)
            await unit.commit()
        assert len(loaded.observations) == 6
        assert sent == [5, 5 + 6]  # refused by number, then sent with its members
        assert await redis_store.client.zcard(redis_store.keys.of("pending", "u1")) == 1
        assert _names(await _run(redis_store, "u1")) == ["again"]
    finally:
        await writer.close()


async def _stored(store: RedisStore, identity: str) -> list[Observation]:
    """The identity's observations in one read of the whole sorted set."""
    members: list[Any] = await store.client.zrange(store.keys.of("obs", identity), 0, -1)
    return [observation_from_json(identity, member) for member in members]


async def test_the_observations_are_read_in_pages_of_bounded_replies(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``observations`` read the identity's sorted set in one reply, which redis-py's
    socket timeout (5 s) cut at every attempt once it held hundreds of thousands: no
    reply carries more than a page, and the read is the one of the whole set."""
    monkeypatch.setattr(unit_module, "LOAD_PAGE", PAGE)
    store = RedisStore.from_url(redis_url, connection_class=_Recording)
    try:
        await _seed(store, "u1", pending=40, original=17)
        whole = await _stored(store, "u1")
        assert len(whole) == 57
        _COUNTS.clear()
        assert await store.observations("u1") == whole
        assert max(_COUNTS) <= PAGE and sum(_COUNTS) == 57 and len(_COUNTS) >= 57 // PAGE
    finally:
        await store.close()
        _COUNTS.clear()


async def test_the_observations_read_across_an_append_and_a_prune_between_the_pages(
    redis_store: RedisStore, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between two pages, an append dated before what was read and one after it, and the
    removal of the oldest observation and of the last one read: every other observation
    is read once, in order, and none twice."""
    monkeypatch.setattr(unit_module, "LOAD_PAGE", 5)
    await _seed(redis_store, "u1", pending=0, original=23)
    before = await _stored(redis_store, "u1")
    writer = RedisStore.from_url(redis_url)
    key = redis_store.keys.of("obs", "u1")
    script = redis_store._script
    cursors: list[bytes] = []

    async def meanwhile(last: bytes) -> None:
        cursors.append(last)
        if len(cursors) == 1:
            for name, at in (("early", T0 - timedelta(hours=1)), ("late", T0 + timedelta(days=3))):
                await writer.append([sanitize_observation("u1", tool_ok(name, name), at)])
            oldest = await redis_store.client.zrange(key, 0, 0)
            await redis_store.client.zrem(key, *oldest, last)

    def paged(name: str) -> Any:
        page = script(name)
        if name != "page":
            return page

        async def call(*, keys: list[str], args: list[Any]) -> Any:
            if len(args) > 2:
                await meanwhile(args[2])
            return await page(keys=keys, args=args)

        return call

    monkeypatch.setattr(redis_store, "_script", paged)
    try:
        read = await redis_store.observations("u1")
        # Four pages: the one after the removed last member starts from its score.
        assert len(cursors) == 4
        ids = [o.id for o in read]
        assert len(ids) == len(set(ids))
        # Those read before they were removed, and those after the first page (the
        # late append among them); the early one, dated before what was read, is not.
        assert [str(o.metadata["toolName"]) for o in read] == [
            *(f"o{n}" for n in range(23)),
            "late",
        ]
        assert [o for o in read if o.id in {b.id for b in before}] == before
        assert read == sorted(read, key=lambda o: o.created_at)
    finally:
        await writer.close()
