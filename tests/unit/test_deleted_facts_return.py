"""A fact deleted since its session reinforced it (expired, or evicted by the cap) and
observed again by that session starts anew at 0.5, whether or not a consolidation
deleted it in between: how often consolidation runs never changes the result.

The session's earlier reinforcement was taken for "this session already counted", and
the observation was dropped without a trace once a consolidation had deleted the fact."""

from __future__ import annotations

from datetime import timedelta

from coda_memory import Fact, MemoryService
from coda_memory.testing import InMemoryStore
from tests.helpers import T0, FakeClock, tool_ok


def _state(facts: list[Fact]) -> dict[str, tuple[float, int, object]]:
    return {
        f.subject: (round(f.confidence, 9), f.reinforcement_count, f.last_reinforced_at)
        for f in facts
    }


async def _expired_then_seen(consolidate_between: bool) -> dict[str, tuple[float, int, object]]:
    clock = FakeClock()
    service = MemoryService.from_url("memory://", clock=clock)
    try:
        service.emit_observation("ana", tool_ok("get_account", session="s1", at=T0))
        await service.drain()
        await service.consolidate("ana")
        clock.advance(days=39)  # 0.5 * 0.95^39 < 0.1: expired
        if consolidate_between:
            assert await service.consolidate("ana") == []  # deleted
        clock.advance(days=1)
        service.emit_observation("ana", tool_ok("get_account", session="s1", at=clock.now))
        await service.drain()
        return _state(await service.consolidate("ana"))
    finally:
        await service.close()


async def test_an_expired_fact_seen_again_by_its_session_starts_anew() -> None:
    deleted_between = await _expired_then_seen(consolidate_between=True)
    still_there = await _expired_then_seen(consolidate_between=False)
    assert deleted_between == still_there
    (confidence, count, at) = deleted_between["tool_affinity:get_account"]
    assert (confidence, count, at) == (0.5, 1, T0 + timedelta(days=40))  # the new one's date


async def _late_extension(consolidate_between: bool) -> dict[str, tuple[float, int, object]]:
    """Five sessions reinforce a fact (count 5, 0.9); the last one's later observation,
    dated while the fact as it was before that session (count 4, 0.8) was still alive,
    is stored only after the fact expired (a writer's outage, another process's
    backlog)."""
    clock = FakeClock()
    service = MemoryService.from_url("memory://", clock=clock)
    try:
        for i in range(5):
            at = T0 + timedelta(minutes=i)
            service.emit_observation("ana", tool_ok("get_account", session=f"s{i}", at=at))
        await service.drain()
        await service.consolidate("ana")
        clock.advance(days=43)  # 0.9 * 0.95^43 < 0.1: expired
        if consolidate_between:
            assert await service.consolidate("ana") == []  # deleted
        late = T0 + timedelta(days=40)  # 0.8 * 0.95^40 > 0.1
        service.emit_observation("ana", tool_ok("get_account", session="s4", at=late))
        await service.drain()
        return _state(await service.consolidate("ana"))
    finally:
        await service.close()


async def test_a_late_observation_extends_a_deleted_fact_as_one_still_stored() -> None:
    deleted_between = await _late_extension(consolidate_between=True)
    still_there = await _late_extension(consolidate_between=False)
    assert deleted_between == still_there
    (_, count, at) = deleted_between["tool_affinity:get_account"]
    assert (count, at) == (5, T0 + timedelta(days=40))


async def test_a_fact_the_cap_evicted_seen_again_by_its_session_starts_anew() -> None:
    clock = FakeClock()
    store = InMemoryStore()
    capped = MemoryService(store, clock=clock, max_facts=1)
    try:
        for session in ("s0", "s9"):  # get_account, reinforced: ranked first
            capped.emit_observation("ana", tool_ok("get_account", session=session))
        capped.emit_observation("ana", tool_ok("run_sql", session="s1"))
        await capped.drain()
        facts = await capped.consolidate("ana")
        assert [f.subject for f in facts] == ["tool_affinity:get_account"]
    finally:
        await capped.close()
    clock.advance(minutes=1)
    service = MemoryService(store, clock=clock, max_facts=2)
    try:
        service.emit_observation("ana", tool_ok("run_sql", session="s1", at=clock.now))
        await service.drain()
        by_subject = {f.subject: f for f in await service.consolidate("ana")}
        assert set(by_subject) == {"tool_affinity:get_account", "tool_affinity:run_sql"}
        assert by_subject["tool_affinity:run_sql"].reinforcement_count == 1
        assert by_subject["tool_affinity:run_sql"].last_reinforced_at == clock.now
    finally:
        await service.close()
