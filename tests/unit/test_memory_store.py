"""The ``memory://`` store's own bookkeeping (its semantics are the contract suite's)."""

from __future__ import annotations

import asyncio

from coda_memory.testing import InMemoryStore


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
