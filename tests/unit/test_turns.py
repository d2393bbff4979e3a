"""Turns of the event loop in long conversions, and the collector held off in a scope."""

from __future__ import annotations

import asyncio
import gc

import pytest

from coda_memory.core import turns
from coda_memory.core.turns import collector_held, collector_scope, mapped


async def test_a_long_conversion_gives_the_loop_a_turn_after_every_slice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(turns, "SLICE", 10)
    ticks: list[int] = []
    stop = asyncio.Event()

    async def other_task() -> None:
        while not stop.is_set():
            ticks.append(1)
            await asyncio.sleep(0)

    def convert(item: int) -> int:
        return item * 2

    other = asyncio.get_running_loop().create_task(other_task())
    await asyncio.sleep(0)
    before = len(ticks)
    assert await mapped(list(range(100)), convert) == [2 * n for n in range(100)]
    ran = len(ticks) - before
    stop.set()
    await other
    # Ten slices, a turn after each: the other task ran in between.
    assert ran >= 9


async def test_a_short_conversion_takes_no_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turns, "SLICE", 10)
    ticks: list[int] = []

    async def other_task() -> None:
        ticks.append(1)

    other = asyncio.get_running_loop().create_task(other_task())
    assert await mapped(list(range(10)), str) == [str(n) for n in range(10)]
    assert ticks == []
    await other


async def test_a_big_conversion_in_a_scope_holds_the_collector_until_the_scope_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(turns, "SLICE", 10)
    assert gc.isenabled()
    with collector_scope():
        await mapped(list(range(5)), str)
        assert gc.isenabled() and not collector_held()  # small: untouched
        await mapped(list(range(50)), str)
        assert not gc.isenabled() and collector_held()
    assert gc.isenabled() and not collector_held()
    # Outside a scope, the collector is off within a slice only.
    await mapped(list(range(50)), str)
    assert gc.isenabled()


async def test_scopes_of_concurrent_loads_nest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turns, "SLICE", 10)
    first_in, second_done = asyncio.Event(), asyncio.Event()

    async def first() -> None:
        with collector_scope():
            await mapped(list(range(50)), str)
            first_in.set()
            await second_done.wait()
            assert not gc.isenabled()  # the second scope ended: this one still holds
        assert gc.isenabled()

    async def second() -> None:
        await first_in.wait()
        with collector_scope():
            await mapped(list(range(50)), str)
        second_done.set()

    await asyncio.gather(first(), second())
    assert gc.isenabled() and not collector_held()


async def test_a_collector_switched_off_by_the_host_stays_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(turns, "SLICE", 10)
    gc.disable()
    try:
        with collector_scope():
            await mapped(list(range(50)), str)
        assert not gc.isenabled()
    finally:
        gc.enable()


async def test_a_cancelled_load_gives_the_collector_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turns, "SLICE", 10)
    inside = asyncio.Event()

    async def load() -> None:
        with collector_scope():
            await mapped(list(range(50)), str)
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.get_running_loop().create_task(load())
    await inside.wait()
    assert not gc.isenabled()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gc.isenabled() and not collector_held()
