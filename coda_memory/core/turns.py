"""Turns of the event loop during long Python work, and the garbage collector held off
while one load's big temporaries live.

A coroutine that converts tens of thousands of rows in one go holds the event loop for
as long: every other request of the process waits, and no timeout can fire. Work that
grows with an identity's facts goes through :func:`mapped`, which gives the loop a turn
after every :data:`SLICE` items. A worker thread would also free the loop, but under the
GIL the loop then waits up to a switch interval (5 ms) each time it wakes up, so every
other request pays for the big one; a turn costs the big one a few microseconds.

The collector. Tens of thousands of new models that live for a while (a load of an
identity with 30,000 facts reads them, plans over them and drops them) make CPython run
full collections, each walking every tracked object of the process: 30 to 50 ms of a
stalled loop, several times per such load. Within a :func:`collector_scope` (the service
opens one per load), a :func:`mapped` of more than :data:`SLICE` items turns the cyclic
collector off until the scope ends, and the scope ends after the temporaries are gone:
created and freed while it is off, they never reach a collection. Scopes of concurrent
loads nest (the collector comes back when the last one ends, and only if it was on); a
small load never touches it. Reference counting frees everything acyclic meanwhile.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

from coda_memory.core.model import gc_paused

T = TypeVar("T")
R = TypeVar("R")

#: Items converted between two turns of the loop (about 0.5 ms of work).
SLICE = 500


class _Holds:
    """How many scopes hold the collector off, and whether it was on before the first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.was_enabled = False

    def take(self) -> None:
        with self.lock:
            if self.count == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.count += 1

    def give_back(self) -> None:
        with self.lock:
            self.count -= 1
            if self.count == 0 and self.was_enabled:
                gc.enable()


_HOLDS = _Holds()
#: The scope of the running load: [whether it holds the collector off].
_SCOPE: ContextVar[list[bool] | None] = ContextVar("coda_memory_collector_scope", default=None)


@contextmanager
def collector_scope() -> Iterator[None]:
    """A span of work (one load) within which a big :func:`mapped` holds the cyclic
    garbage collector off until the span ends (see above)."""
    holds = [False]
    token = _SCOPE.set(holds)
    try:
        yield
    finally:
        _SCOPE.reset(token)
        if holds[0]:
            _HOLDS.give_back()


def collector_held() -> bool:
    """Whether a scope holds the collector off (for tests)."""
    return _HOLDS.count > 0


def _hold_in_scope() -> bool:
    """Hold the collector off until the current scope ends; False outside a scope."""
    holds = _SCOPE.get()
    if holds is None:
        return False
    if not holds[0]:
        holds[0] = True
        _HOLDS.take()
    return True


async def mapped(items: Sequence[T], convert: Callable[[T], R]) -> list[R]:
    """``[convert(item) for item in items]``, with a turn of the event loop after every
    :data:`SLICE` items; ``convert`` must build acyclic objects. The collector is off
    within each slice (see :func:`~coda_memory.core.model.gc_paused`), or from the first
    slice to the end of the current :func:`collector_scope`."""
    if len(items) <= SLICE:
        with gc_paused():
            return [convert(item) for item in items]
    held = _hold_in_scope()
    out: list[R] = []
    for start in range(0, len(items), SLICE):
        if held:
            out.extend([convert(item) for item in items[start : start + SLICE]])
        else:
            with gc_paused():
                out.extend([convert(item) for item in items[start : start + SLICE]])
        await asyncio.sleep(0)
    return out
