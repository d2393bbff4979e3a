"""Slots: how many requests may hold a store connection at once, newest served first.

Under overload, the oldest waiters are most often consolidations whose ``load_memory``
already gave up (they finish in the background); a request that just arrived can still
meet its deadline. So a freed slot goes to the most recent waiter (last in, first out),
and the old ones run when the load drops. Each round trip phase (the peek, then the
consolidation) takes a slot of its own, so a new request's peek, which is what a late
load answers from, waits behind no queued consolidation.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class LifoSlots:
    """An async context manager admitting ``size`` holders at once; the latest waiter is
    admitted first."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        self.size = size
        self._free = size
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def waiting(self) -> int:
        return sum(not w.done() for w in self._waiters)

    async def acquire(self) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # admitted and cancelled at once: pass the slot on
            elif waiter in self._waiters:  # a release may have passed over it already
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.pop()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the newest waiter
                return
        self._free += 1

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
