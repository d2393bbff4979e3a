"""LifoSlots: a bounded number of holders, the newest waiter admitted first."""

from __future__ import annotations

import asyncio

import pytest

from coda_memory.slots import LifoSlots


async def test_no_more_holders_than_slots_and_the_newest_waiter_goes_first() -> None:
    slots = LifoSlots(2)
    order: list[str] = []
    release = asyncio.Event()

    async def hold(name: str) -> None:
        async with slots:
            order.append(name)
            await release.wait()

    first = [asyncio.create_task(hold(n)) for n in ("a", "b")]
    await asyncio.sleep(0)
    assert order == ["a", "b"]
    waiting = []
    for name in ("old", "middle", "new"):
        waiting.append(asyncio.create_task(hold(name)))
        await asyncio.sleep(0)
    assert order == ["a", "b"] and slots.waiting == 3
    release.set()
    await asyncio.gather(*first, *waiting)
    assert order == ["a", "b", "new", "middle", "old"]


async def test_a_cancelled_waiter_gives_up_its_place_and_never_its_slot() -> None:
    slots = LifoSlots(1)
    await slots.acquire()
    cancelled = asyncio.create_task(slots.acquire())
    later = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    slots.release()
    await asyncio.wait_for(later, 1)
    slots.release()
    # Back to one free slot: one acquire passes at once, a second waits.
    await asyncio.wait_for(slots.acquire(), 1)
    blocked = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    assert not blocked.done()
    slots.release()
    await asyncio.wait_for(blocked, 1)


async def test_a_waiter_cancelled_and_passed_over_before_it_resumes_only_raises_its_cancel() -> (
    None
):
    """A release between a waiter's cancellation and its resumption pops the cancelled
    waiter: it then failed with ValueError (list.remove) instead of its CancelledError."""
    slots = LifoSlots(1)
    await slots.acquire()
    waiter = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    assert slots.waiting == 1
    waiter.cancel()  # cancels the future it waits on; the task resumes later
    slots.release()  # passes over the cancelled waiter: the slot is free
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.wait_for(slots.acquire(), 1)  # the slot was not lost
    assert slots.waiting == 0


def test_a_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        LifoSlots(0)
