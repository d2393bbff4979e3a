"""Work that must not be cut off half-way by a cancellation of its caller.

Hosts cancel: a client disconnects, a shutdown deadline passes, and anyio's cancel scopes
(FastAPI, Starlette) cancel the task at every turn of the loop until it ends. Some work
must still run to its end once started, or it leaves something behind that nobody can
clean up: a connection handed back to its pool inside its transaction, a lock taken on
the server whose token only the cancelled frame knew. :func:`to_the_end` runs such work
as a task of its own and waits for it through every cancellation; the caller then acts on
its result (releases what it took) and raises the cancellation, as SQLAlchemy's
``async with engine.connect()`` does for its own close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def to_the_end(
    work: Awaitable[T], *, limit: float | None = None
) -> tuple[T, asyncio.CancelledError | None]:
    """``work``'s result once it has ended, and the caller's cancellation meanwhile (None:
    none came), which the caller raises once it has acted on the result.

    Once the caller is cancelled, ``limit`` (seconds) bounds the wait: past it the
    cancellation is raised and the work is left to end by itself (for work whose effect
    lapses by then anyway, such as a lock's expiry). An exception of ``work`` is raised
    as it is, or, when the caller was cancelled meanwhile, the cancellation is raised
    from it (a cancellation is delivered once: dropped here, it would be lost).

    A coroutine whose task is cancelled before it began (a host cancelling every task of
    the loop, this one too) is begun again in a new task: asyncio runs none of a task
    cancelled before its first step, its ``finally`` clauses neither, so the work was
    otherwise left undone (a connection never given back to its pool)."""
    began = False

    async def begin() -> T:
        nonlocal began
        began = True
        return await work

    # (A future given runs by itself: it can't be begun again.)
    restartable = asyncio.iscoroutine(work)
    task = asyncio.ensure_future(begin() if restartable else work)
    cancelled: asyncio.CancelledError | None = None
    deadline: float | None = None
    loop = asyncio.get_running_loop()
    while not task.done() or (restartable and not began and task.cancelled()):
        if task.done():  # cancelled before it began: again
            task = asyncio.ensure_future(begin())
        left = None
        if cancelled is not None and limit is not None:
            deadline = loop.time() + limit if deadline is None else deadline
            left = deadline - loop.time()
            if left <= 0:
                task.add_done_callback(_outcome_retrieved)  # nobody awaits it now
                raise cancelled
        try:
            await asyncio.wait({task}, timeout=left)  # (waiting never cancels the task)
        except asyncio.CancelledError as error:
            cancelled = error
    if task.cancelled():
        raise cancelled or asyncio.CancelledError()  # the work itself was cancelled
    failure = task.exception()
    if failure is not None:
        if cancelled is not None:
            raise cancelled from failure
        raise failure
    return task.result(), cancelled


async def run_to_end(work: Awaitable[T], *, limit: float | None = None) -> T:
    """:func:`to_the_end` for a caller with nothing to do on the result before it raises
    the cancellation: ``work``'s result, or the caller's cancellation once it has ended."""
    result, cancelled = await to_the_end(work, limit=limit)
    if cancelled is not None:
        raise cancelled
    return result


def _outcome_retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
