"""``to_the_end``: work that a cancellation of its caller does not cut off."""

from __future__ import annotations

import asyncio

import pytest

from coda_memory.core.cancellation import to_the_end


async def test_the_work_ends_through_every_cancellation_which_is_then_returned() -> None:
    release = asyncio.Event()
    ended: list[str] = []

    async def work() -> str:
        await release.wait()
        ended.append("work")
        return "taken"

    async def caller() -> tuple[str, bool]:
        result, cancelled = await to_the_end(work())
        return result, cancelled is not None

    task = asyncio.ensure_future(caller())
    for _ in range(5):  # as an anyio cancel scope does, at every turn of the loop
        await asyncio.sleep(0)
        task.cancel()
    assert not task.done() and ended == []
    release.set()
    assert await task == ("taken", True)
    assert ended == ["work"]


async def test_work_whose_task_is_cancelled_before_it_began_begins_again() -> None:
    """A host cancelling every task of the loop cancelled the work's own task too, before
    its first step: asyncio ran none of it (its finally clauses neither), and work that
    must run to its end (giving a connection back to its pool) was left undone."""
    ended: list[str] = []

    async def work() -> str:
        await asyncio.sleep(0)
        ended.append("work")
        return "done"

    caller = asyncio.ensure_future(to_the_end(work()))
    await asyncio.sleep(0)  # the caller made the work's task, which has not begun
    for task in asyncio.all_tasks() - {asyncio.current_task()}:
        task.cancel()
    result, cancelled = await caller
    assert (result, cancelled is not None) == ("done", True)
    assert ended == ["work"]


async def test_without_a_cancellation_it_is_the_result() -> None:
    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    assert await to_the_end(work()) == (7, None)


async def test_the_works_own_error_is_raised() -> None:
    async def work() -> None:
        await asyncio.sleep(0)
        raise LookupError("gone")

    with pytest.raises(LookupError, match="gone"):
        await to_the_end(work())


async def test_work_cancelled_by_itself_raises_cancelled() -> None:
    async def work() -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await to_the_end(work())


async def test_a_failure_after_the_caller_was_cancelled_raises_the_cancellation() -> None:
    """The work's error was raised instead, and the cancellation, delivered once, was
    lost: the caller ran on (and asyncio.timeout never raised)."""
    fail = asyncio.Event()

    async def work() -> None:
        await fail.wait()
        raise ConnectionError("gone")

    task = asyncio.ensure_future(to_the_end(work()))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    fail.set()
    with pytest.raises(asyncio.CancelledError) as raised:
        await task
    assert isinstance(raised.value.__cause__, ConnectionError)


async def test_once_cancelled_the_caller_waits_at_most_the_limit() -> None:
    never = asyncio.Event()
    started: list[asyncio.Task[None]] = []

    async def work() -> None:
        started.append(asyncio.current_task())  # type: ignore[arg-type]
        await never.wait()

    task = asyncio.ensure_future(to_the_end(work(), limit=0.05))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    (running,) = started
    assert not running.done()  # left to end by itself
    running.cancel()
