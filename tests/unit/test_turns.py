"""Turns of the event loop in long conversions, and the collector held off in scopes."""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import threading
import warnings
import weakref

import pytest

from coda_memory.core import turns
from coda_memory.core.turns import collector_held, collector_scope, mapped
from tests.helpers import (
    LoopTurns,
    held_collector_clock,
    held_collector_heap,
    recorded_collections,
)


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

    other = asyncio.get_running_loop().create_task(other_task())
    await asyncio.sleep(0)
    before = len(ticks)
    assert await mapped(list(range(100)), lambda n: n * 2) == [2 * n for n in range(100)]
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


async def test_big_containers_are_emptied_with_a_turn_after_every_slice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the last reference to a container frees goes in one go, with no turn of the
    loop until it is done (a backlog's 100,000 observations: 50 to 140 ms); emptied with
    :func:`released`, SLICE items at most are freed between two turns."""
    monkeypatch.setattr(turns, "SLICE", 10)
    ticks = LoopTurns()
    freed: list[int] = []  # the turn in which each item was freed

    class Item:
        pass

    def watched() -> Item:
        item = Item()
        held.append(weakref.ref(item, lambda _: freed.append(ticks.count)))
        return item

    held: list[weakref.ref[Item]] = []
    items = [watched() for _ in range(45)]
    table = {n: watched() for n in range(30)}

    async with ticks:
        await asyncio.sleep(0)
        await turns.released(items, table)
    assert (items, table, len(freed)) == ([], {}, 75)
    assert max(collections.Counter(freed).values()) == 10
    assert len(set(freed)) >= 8


async def test_tasks_taking_turns_convert_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversions of tasks that take turns on one place run one after another, each
    whole; a task that takes no turns runs beside them (a load's answer from the facts at
    hand does not wait)."""
    monkeypatch.setattr(turns, "SLICE", 2)
    ran: list[str] = []
    place = asyncio.Semaphore(1)

    async def converting(name: str, take_turns: bool) -> list[int]:
        def convert(item: int) -> int:
            ran.append(name)
            return item * 2

        if not take_turns:
            return await mapped(range(6), convert)
        with turns.taking_turns(place):
            return await mapped(range(6), convert)

    results = await asyncio.gather(
        converting("a", True), converting("b", True), converting("free", False)
    )
    assert list(results) == [[0, 2, 4, 6, 8, 10]] * 3
    in_turn = [name for name in ran if name != "free"]
    assert in_turn == ["a"] * 6 + ["b"] * 6  # whole, one after the other
    # The free task's slices ran while "a" held the place.
    last_a = len(ran) - 1 - ran[::-1].index("a")
    assert ran.index("free") < last_a


def test_a_scope_holds_the_collector_off_until_it_closes() -> None:
    assert gc.isenabled()
    with collector_scope():
        assert not gc.isenabled() and collector_held()
    assert gc.isenabled() and not collector_held()
    with collector_scope(hold=False):
        assert gc.isenabled() and not collector_held()


async def test_scopes_of_concurrent_loads_nest() -> None:
    first_in, second_done = asyncio.Event(), asyncio.Event()

    async def first() -> None:
        with collector_scope():
            first_in.set()
            await second_done.wait()
            assert not gc.isenabled()  # the second scope closed: this one still holds
        assert gc.isenabled()

    async def second() -> None:
        await first_in.wait()
        with collector_scope():
            await asyncio.sleep(0)
        second_done.set()

    await asyncio.gather(first(), second())
    assert gc.isenabled() and not collector_held()


def test_a_collector_switched_off_by_the_host_stays_off_and_is_never_run() -> None:
    gc.disable()
    try:
        with collector_scope():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


async def test_a_cancelled_load_gives_the_collector_back() -> None:
    inside = asyncio.Event()

    async def load() -> None:
        with collector_scope():
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.get_running_loop().create_task(load())
    await inside.wait()
    assert not gc.isenabled()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gc.isenabled() and not collector_held()


@pytest.fixture
def now(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The scopes' clock, moved by hand: ``now[0]``."""
    return held_collector_clock(monkeypatch)


def test_scopes_without_a_gap_collect_young_and_everything_once_the_heap_grew(
    monkeypatch: pytest.MonkeyPatch, now: list[float]
) -> None:
    collected = recorded_collections(monkeypatch)
    heap = held_collector_heap(monkeypatch)
    young_per_full = int(turns.FULL_EVERY / turns.YOUNG_EVERY)
    young_per_middle = int(turns.MIDDLE_EVERY / turns.YOUNG_EVERY)
    # The youngest generation every YOUNG_EVERY, both young ones every MIDDLE_EVERY.
    period = ([0] * (young_per_middle - 1) + [1]) * (young_per_full // young_per_middle)

    def one_full_period() -> None:
        for _ in range(young_per_full * 4):
            now[0] += turns.YOUNG_EVERY / 4
            with collector_scope():
                pass

    with collector_scope():  # a load that stays in flight while others come and go
        # One young collection per YOUNG_EVERY; a full one is due after FULL_EVERY, but
        # the first look notes the heap, and the second finds it no bigger.
        one_full_period()
        one_full_period()
        assert collected == period * 2
        collected.clear()
        heap[:] = [1249, 2000]  # the heap not yet a quarter bigger: objects not counted
        one_full_period()
        assert collected == period
        collected.clear()
        heap[:] = [1250, 1249]  # the heap grew, the collector's objects not as much
        one_full_period()
        assert collected == period
        collected.clear()
        heap[:] = [1250, 1250]  # that heap was noted: its objects are not counted again
        one_full_period()
        assert collected == period
        collected.clear()
        heap[:] = [1563, 1250]  # a quarter more again: counted, and they grew too
        one_full_period()  # the full one instead of the young ones
        assert collected == [*period[:-1], 2]
        collected.clear()
        one_full_period()  # what it left is the heap noted: no growth since
        assert collected == period
        assert not gc.isenabled()
    # With a gap (no scope open), the collector ran as usual: the clocks start again.
    collected.clear()
    now[0] += 0.5
    with collector_scope():
        pass
    assert collected == []


def test_a_finalizer_that_a_scopes_collection_runs_may_open_a_scope(now: list[float]) -> None:
    opened: list[bool] = []

    class Cyclic:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            with collector_scope():
                opened.append(True)

    def load() -> None:
        with collector_scope():
            Cyclic()  # garbage in a cycle: only a collection frees it
            now[0] += turns.YOUNG_EVERY
            with collector_scope():  # due: the young collection runs the finalizer
                pass

    # In a thread, so that a deadlock fails the test instead of hanging it.
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive() and opened == [True]
    assert gc.isenabled() and not collector_held()


def test_a_due_full_collection_waits_for_its_gate_but_not_past_another_period(
    monkeypatch: pytest.MonkeyPatch, now: list[float]
) -> None:
    collected = recorded_collections(monkeypatch)
    heap = held_collector_heap(monkeypatch, noted=(500, 500))  # it grew since the last
    gate = [False]
    with collector_scope():  # a load in flight throughout
        now[0] += turns.FULL_EVERY
        with collector_scope(may_collect=lambda: gate[0]):
            pass
        assert collected == [1]  # due, but the gate is shut: the young ones only
        now[0] += turns.YOUNG_EVERY
        gate[0] = True
        with collector_scope(may_collect=lambda: gate[0]):
            pass
        assert collected == [1, 2]
        # Overdue by another period: it runs whatever the gate says.
        collected.clear()
        heap[:] = [2000, 2000]  # grew again
        gate[0] = False
        now[0] += turns.FULL_EVERY
        with collector_scope(may_collect=lambda: gate[0]):
            pass
        assert collected == [1]
        now[0] += turns.FULL_EVERY
        with collector_scope(may_collect=lambda: gate[0]):
            pass
        assert collected == [1, 2]


def test_a_due_young_collection_waits_for_its_gate_but_not_past_another_period(
    monkeypatch: pytest.MonkeyPatch, now: list[float]
) -> None:
    collected = recorded_collections(monkeypatch)
    gate = [False]
    with collector_scope():  # a load in flight throughout
        now[0] += turns.YOUNG_EVERY
        with collector_scope(may_collect=lambda: gate[0]):
            pass
        assert collected == []  # due, but the gate is shut
        gate[0] = True
        with collector_scope(may_collect=lambda: gate[0]):
            pass
        assert collected == [0]
        gate[0] = False
        now[0] += 2 * turns.YOUNG_EVERY  # overdue by another period: it runs anyway
        with collector_scope(may_collect=lambda: gate[0]):
            pass
        assert collected == [0, 0]


def test_a_due_young_collection_waits_while_the_youngest_generation_is_big(
    monkeypatch: pytest.MonkeyPatch, now: list[float]
) -> None:
    """A big work in flight (a backlog's consolidation) makes hundreds of thousands of
    objects that it frees itself: a young collection meanwhile walked them all, a stall of
    50 to 170 ms, for nothing. It waits for them to go, but not past YOUNG_WAIT."""
    collected = recorded_collections(monkeypatch)
    young = [turns.YOUNG_LIMIT + 1]
    monkeypatch.setattr(turns, "young_objects", lambda: young[0])
    with collector_scope():  # a load in flight throughout
        now[0] += turns.YOUNG_EVERY
        with collector_scope():
            pass
        assert collected == []  # due, but the youngest generation is big
        young[0] = turns.YOUNG_LIMIT  # the work freed what it made
        with collector_scope():
            pass
        assert collected == [0]
        young[0] = turns.YOUNG_LIMIT + 1
        now[0] += turns.YOUNG_WAIT - turns.YOUNG_EVERY - 0.01
        with collector_scope():  # the middle one is due too, and waits as well
            pass
        assert collected == [0]
        now[0] += 0.02  # YOUNG_WAIT since the middle one last ran (the first scope opened)
        with collector_scope():
            pass
        assert collected == [0, 1]


def test_young_collections_age_what_they_find_before_the_old_generation_takes_it(
    now: list[float],
) -> None:
    """What a load holds across a young collection moves to the middle generation, not the
    old one: CPython counts what reaches the old generation, and a quarter more of it sets
    off a full collection of everything at its next chance (see the module)."""

    def generation_of(thing: object) -> int | None:
        return next(
            (g for g in range(3) if any(o is thing for o in gc.get_objects(generation=g))),
            None,
        )

    with collector_scope():  # a load in flight throughout
        held = [object()]  # what a load in flight holds (a list: the collector tracks it)
        assert generation_of(held) == 0
        for _ in range(int(turns.MIDDLE_EVERY / turns.YOUNG_EVERY) - 1):
            now[0] += turns.YOUNG_EVERY
            with collector_scope():  # due: the youngest generation is collected
                pass
            assert generation_of(held) == 1  # the youngest only, nine times
        now[0] += turns.YOUNG_EVERY
        with collector_scope():  # MIDDLE_EVERY since the last of both: both
            pass
        assert generation_of(held) == 2  # still alive: long-lived after all


def test_a_forked_child_collects_again() -> None:
    """A child forked while a load was in flight (a worker of a process pool) had the
    collector off for good: none of the parent's scopes closes there."""
    assert gc.isenabled()
    with collector_scope():
        assert not gc.isenabled()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (threads at the fork)
            pid = os.fork()
        if pid == 0:
            os._exit(0 if gc.isenabled() and not collector_held() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()  # the parent's scope closed as usual


def test_the_hold_of_a_load_left_on_a_closed_loop_is_dropped_by_the_next_scope() -> None:
    """A loop closed with a load in flight, its tasks never cancelled: the scope never
    closed, and the collector stayed off for the rest of the process."""
    assert gc.isenabled()
    loop = asyncio.new_event_loop()
    entered = loop.create_future()

    async def load() -> None:
        with collector_scope():
            entered.set_result(None)
            await loop.create_future()  # never done

    task = loop.create_task(load())
    loop.run_until_complete(entered)
    loop.close()
    assert not gc.isenabled() and collector_held()
    with collector_scope():
        assert not gc.isenabled()
    assert gc.isenabled() and not collector_held()
    task.get_coro().close()  # its scope closes at last: it gives back nothing twice
    assert gc.isenabled() and not collector_held()
    with collector_scope():
        assert collector_held()
    assert not collector_held()


def test_a_new_hold_looks_at_each_loop_not_at_each_hold() -> None:
    """Whether any hold's loop is closed was asked of every hold at each new one: with
    2,000 loads in flight, that stalled the event loop for 0.4 s."""
    holds = turns._Holds()
    loop = asyncio.new_event_loop()
    asked = 0
    is_closed = loop.is_closed

    def counted() -> bool:
        nonlocal asked
        asked += 1
        return is_closed()

    loop.is_closed = counted  # type: ignore[method-assign]

    async def hold_many() -> list[int]:
        return [holds.take() for _ in range(200)]

    tokens: list[int] = []
    try:
        tokens = loop.run_until_complete(hold_many())
    finally:
        for token in tokens:
            holds.give_back(token)
        loop.close()
    assert asked < 400  # once a take (and the loop's own asks): 19,900 before
    assert (holds.count, holds.holders, holds.loops) == (0, {}, {})
