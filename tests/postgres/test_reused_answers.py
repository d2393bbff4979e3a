"""Answers given again while nothing changed (coda_memory.core.answers): only while the
facts keep their version, nothing waits and the answer is recent; always the caller's own."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from coda_memory import MemoryService
from coda_memory.core.answers import RecentAnswers
from coda_memory.core.caps import DEFAULT_MAX_FACTS
from coda_memory.core.model import LoadedMemory
from coda_memory.postgres import PostgresStore, unit
from coda_memory.postgres import store as store_module
from tests.helpers import FakeClock, tool_failed, tool_ok
from tests.postgres.helpers import NOW, fact, locked


async def test_a_load_of_an_unchanged_identity_gives_its_recent_answer_again(
    pg_url: str,
) -> None:
    clock = FakeClock(NOW)
    service = MemoryService(PostgresStore.from_url(pg_url), clock=clock, load_timeout=5)
    other = MemoryService(PostgresStore.from_url(pg_url), clock=clock, load_timeout=5)
    try:
        for tool in ("get_account", "get_contract"):
            service.emit_observation("alice", tool_ok(tool))
        await service.drain()
        # A load that consolidates keeps no answer; one that finds nothing new does.
        first = await service.load_memory("alice")
        assert len(first.facts) == 2
        second = await service.load_memory("alice")
        assert service.stats().loads_reused == 0
        assert second == first
        third = await service.load_memory("alice")
        assert service.stats().loads_reused == 1
        assert third == first
        # The caller's own lists: what one caller does to its answer, the next won't see.
        kept = third.model_copy(deep=True)
        for answer in (second, third):
            answer.facts.clear()
            answer.tool_affinities.clear()
        fourth = await service.load_memory("alice")
        assert service.stats().loads_reused == 2
        assert fourth == kept and len(fourth.facts) == 2

        # Another process consolidates new observations: the version moved.
        other.emit_observation("alice", tool_failed("get_invoice"))
        await other.drain()
        await other.consolidate("alice")
        moved = await service.load_memory("alice")
        assert service.stats().loads_reused == 2
        assert len(moved.facts) == 3
        assert (await service.load_memory("alice")) == moved
        assert service.stats().loads_reused == 3

        # Observations waiting (stored by another process, not consolidated yet): the
        # load consolidates them and keeps no answer, the next one keeps its own.
        other.emit_observation("alice", tool_ok("get_payment"))
        await other.drain()
        waited = await service.load_memory("alice")
        assert service.stats().loads_reused == 3
        assert len(waited.facts) == 4
        assert (await service.load_memory("alice")) == waited
        assert service.stats().loads_reused == 3

        # Recent only: a second later, the answer is made anew, its facts decayed.
        assert (await service.load_memory("alice")) == waited
        assert service.stats().loads_reused == 4
        clock.advance(seconds=1.5)
        later = await service.load_memory("alice")
        assert service.stats().loads_reused == 4
        assert [f.confidence for f in later.facts] < [f.confidence for f in waited.facts]

        # Observations this service stored: consolidated, never answered from before.
        service.emit_observation("alice", tool_ok("get_payment", session="s2"))
        await service.drain()
        reinforced = await service.load_memory("alice")
        assert service.stats().loads_reused == 4
        assert reinforced != later

        await service.forget("alice")
        assert (await service.load_memory("alice")).facts == []
    finally:
        await service.close()
        await other.close()


def test_recent_answers_hold_few_facts_in_all_and_only_for_a_while() -> None:
    def answer(facts: int) -> LoadedMemory:
        return LoadedMemory.model_construct(facts=[fact()] * facts)

    recent = RecentAnswers(reuse_for=timedelta(seconds=1), capacity_facts=10)
    recent.put("a", "v1", NOW, answer(4))
    recent.put("b", "v1", NOW, answer(4))
    assert recent.fresh("a", NOW) is not None  # a is now the most recently used
    recent.put("c", "v1", NOW, answer(4))  # 12 facts: b, the least recent, goes
    assert recent.fresh("b", NOW) is None
    assert recent.fresh("a", NOW) is not None and recent.fresh("c", NOW) is not None
    recent.put("d", "v1", NOW, answer(11))  # over the capacity alone: not kept
    assert recent.fresh("d", NOW) is None and len(recent) == 2
    assert recent.fresh("a", NOW + timedelta(seconds=1)) is not None
    assert recent.fresh("a", NOW + timedelta(seconds=1.001)) is None
    assert len(recent) == 1


def test_by_default_two_answers_at_the_fact_cap_are_kept_and_no_more() -> None:
    """Kept answers are walked by the collector while they live (see core/answers.py):
    the default keeps an identity loading in a loop at the cap, and another."""
    at_cap = LoadedMemory.model_construct(facts=[fact()] * DEFAULT_MAX_FACTS)
    recent = RecentAnswers()
    recent.put("a", "v1", NOW, at_cap)
    recent.put("b", "v1", NOW, at_cap)
    assert recent.fresh("a", NOW) is not None and recent.fresh("b", NOW) is not None
    recent.put("c", "v1", NOW, LoadedMemory.model_construct(facts=[fact()]))
    assert recent.fresh("a", NOW) is None  # the least recently used went
    assert len(recent) == 2


async def test_a_held_table_during_the_check_sends_the_load_the_usual_way(pg_url: str) -> None:
    service = MemoryService(PostgresStore.from_url(pg_url), clock=FakeClock(NOW), load_timeout=5)
    try:
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain()
        first = await service.load_memory("alice")
        await service.load_memory("alice")  # nothing new: this answer is kept
        async with locked(pg_url, "observations"):
            held = await service.load_memory("alice")
        stats = service.stats()
        assert held == first
        assert (stats.loads_reused, stats.load_errors, stats.peeks_held_out) == (0, 0, 1)
    finally:
        await service.close()


async def test_an_answer_is_kept_with_the_version_of_the_facts_it_was_made_from(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consolidation of the identity that ends while a load's peek is on its way back
    moves the version the store keeps; the load's answer is still of the version its
    peek read, and is not given again for the new one."""
    clock = FakeClock(NOW)
    store = PostgresStore.from_url(pg_url)
    service = MemoryService(store, clock=clock, load_timeout=5)
    other = MemoryService(PostgresStore.from_url(pg_url), clock=clock, load_timeout=5)
    raced = False

    async def racing_peek(*args: Any, **kwargs: Any) -> Any:
        nonlocal raced
        peeked = await unit.peek(*args, **kwargs)
        if not raced:
            raced = True
            other.emit_observation("alice", tool_ok("get_invoice"))
            await other.drain()
            await service.consolidate("alice")  # while the load's peek is in flight
        return peeked

    try:
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain()
        await service.load_memory("alice")
        clock.advance(seconds=2)  # the first answer is no longer recent
        monkeypatch.setattr(store_module, "peek", racing_peek)
        during = await service.load_memory("alice")
        assert raced and [f.subject for f in during.facts] == ["tool_affinity:get_account"]
        after = await service.load_memory("alice")
        assert service.stats().loads_reused == 0
        assert [f.subject for f in after.facts] == [
            "tool_affinity:get_account",
            "tool_affinity:get_invoice",
        ]
    finally:
        await service.close()
        await other.close()


def test_empty_answers_count_and_stale_ones_go_as_new_ones_come() -> None:
    """An empty answer counted nothing against the capacity, and an answer older than
    reuse_for went only when its identity asked again: a stream of identities with no
    facts grew the answers without bound (700 bytes each)."""
    empty = LoadedMemory.model_construct(facts=[])
    recent = RecentAnswers(reuse_for=timedelta(seconds=1), capacity_facts=10)
    for n in range(100):
        recent.put(f"id-{n}", "v1", NOW, empty)
    assert len(recent) == 10
    recent.put("late", "v1", NOW + timedelta(seconds=2), empty)
    assert len(recent) == 1  # the ten made two seconds before are of no use any more
