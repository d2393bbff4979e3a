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
from typing import TypeVar

T = TypeVar("T")


async def to_the_end(work: Awaitable[T]) -> tuple[T, asyncio.CancelledError | None]:
    """``work``'s result once it has ended, and the caller's cancellation meanwhile (None:
    none came), which the caller raises once it has acted on the result. An exception of
    ``work`` is raised as it is (the cancellation, if any, is then left to the caller's
    next await)."""
    task = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError as error:
            if not task.done():
                cancelled = error
                continue
            if task.cancelled():
                raise  # the work itself was cancelled
            return task.result(), error  # the caller was, as the work ended
        else:
            return result, cancelled
