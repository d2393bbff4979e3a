"""The ``memory://`` store's own bookkeeping (its semantics are the contract suite's)."""

from __future__ import annotations

import asyncio
from typing import Any

from coda_memory import MemoryService, NewObservation, ObservationType
from coda_memory.testing import InMemoryStore
from tests.helpers import FakeClock


async def test_an_identity_lock_lives_only_while_held_or_awaited() -> None:
    """A lock per identity ever consolidated or forgotten was kept for good: a
    long-lived store (a replay, a dev server) grew by one for every identity it saw."""
    store = InMemoryStore()
    for number in range(500):
        async with store.consolidation(f"id-{number}"):
            pass
        await store.forget(f"gone-{number}")
    assert len(store._locks) == 0


async def test_an_identity_lock_still_keeps_its_consolidations_apart() -> None:
    store = InMemoryStore()
    inside: list[str] = []
    entered = asyncio.Event()
    release = asyncio.Event()

    async def first() -> None:
        async with store.consolidation("ana"):
            inside.append("first in")
            entered.set()
            await release.wait()
            inside.append("first out")

    async def second() -> None:
        await entered.wait()
        async with store.consolidation("ana"):
            inside.append("second in")

    tasks = [asyncio.create_task(first()), asyncio.create_task(second())]
    await entered.wait()
    for _ in range(5):  # the second reaches the lock and waits there
        await asyncio.sleep(0)
    assert inside == ["first in"] and len(store._locks) == 1
    release.set()
    await asyncio.gather(*tasks)
    assert inside == ["first in", "first out", "second in"]
    assert len(store._locks) == 0


class _Name(str):
    """A host's str subclass (a str enum's member is one too)."""


class _Count(int):
    def __str__(self) -> str:
        return "a count"


class _Ratio(float):
    pass


def _types(value: Any) -> set[type]:
    """The types of ``value`` and of every key and value inside it."""
    if isinstance(value, dict):
        return {dict} | {type(key) for key in value} | set().union(*map(_types, value.values()))
    if isinstance(value, list):
        return {list}.union(*map(_types, value))
    return {type(value)}


async def test_values_of_a_str_int_or_float_subclass_are_stored_as_plain_ones() -> None:
    """Postgres and Redis store metadata as JSON, which gives back plain values; the
    memory:// store kept what sanitising gave it, and a str subclass went through as
    itself (a key, a value, an item of a list, the content, an entity's id), so the
    host's tests on memory:// saw other types, and other equality, than production."""
    service = MemoryService(InMemoryStore(), clock=FakeClock())
    try:
        tool = NewObservation.model_construct(
            type=ObservationType.TOOL_SUCCESS,
            content=_Name("get_account ok"),
            metadata={
                "toolName": _Name("get_account"),
                "durationMs": _Ratio(12.5),
                _Name("note"): _Name("kept"),
                "nested": {_Name("k"): [_Name("a"), _Count(2), _Ratio(0.5)]},
                "count": _Count(3),
            },
            session_id="s1",
            created_at=None,
        )
        entity = NewObservation(
            type=ObservationType.ENTITY_ACCESS,
            content="Looked at acct-1",
            metadata={"entityType": _Name("account"), "entityId": _Name("acct-1")},
        )
        numbered = NewObservation(
            type=ObservationType.ENTITY_ACCESS,
            content="Looked at 7",
            metadata={"entityType": "account", "entityId": _Count(7)},
        )
        for observation in (tool, entity, numbered):
            service.emit_observation("alice", observation)
        await service.drain(5)
        assert service.stats().stored == 3
        stored = await service.store.observations("alice")  # type: ignore[attr-defined]
        assert [o.metadata for o in stored] == [
            {
                "toolName": "get_account",
                "durationMs": 12.5,
                "note": "kept",
                "nested": {"k": ["a", 2, 0.5]},
                "count": 3,
            },
            {"entityType": "account", "entityId": "acct-1"},
            {"entityType": "account", "entityId": "7"},
        ]
        for observation in stored:
            assert _types(observation.metadata) <= {dict, list, str, int, float}
            assert type(observation.content) is str
    finally:
        await service.close()
