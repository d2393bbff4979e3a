"""Turns of the event loop during long Python work, and CPython's cyclic garbage
collector held off while loads are in flight.

Turns. A coroutine that converts tens of thousands of rows in one go holds the event
loop for as long: every other request of the process waits, and no timeout can fire.
Work that grows with an identity's facts goes through :func:`mapped`, which gives the
loop a turn after every :data:`SLICE` items, or is written as steps: a generator that
yields between them, every :data:`SLICE` facts at most, which :func:`stepped` runs with
a turn of the loop at each yield. The pure core stays pure (its steps know nothing of
the loop, and :func:`finished` runs them in one go where no loop waits). A worker
thread would also free the loop, but under the GIL the loop then waits up to a switch
interval (5 ms) each time it wakes up, so every other request pays for the big one; a
turn costs the big one microseconds.

Freeing is work too: when the last reference to a container goes, everything in it
is freed in one go, in C, with no turn of the loop until it is done. A consolidation of
a backlog of 100,000 observations (an identity that wrote with no load) ends with its
session groups, then its observations and history, unreferenced: freed so, each stalled
the loop for 40 to 140 ms. Such work empties its big containers itself, :data:`SLICE`
items a step (:func:`emptying`, :func:`released`).

Under concurrent requests every turn of the loop runs the next step of each request
that is ready, so a turn lasts as long as their steps together, and that is how late a
timer fires or a new request starts: the smaller the steps, the less they wait (see the
README, "Latency tails and the steps of a load"). So tasks may also take turns
(:func:`taking_turns`): within the block, a task's steps and conversions run only while
it holds a place of a semaphore that the others share, so a turn of the loop runs the
next step of as many of them as it has places.

The collector. A load builds hundreds of models (thousands for a big identity) that
live across its round trips to the store. Every 700 allocations CPython collects the
young objects; the models of the loads in flight survive, are promoted, and every 25 %
of growth of the old generation sets off a full collection, which walks every tracked
object of the process with the event loop stalled: 30 to 50 ms on a 2-core machine,
several times a second under 8 concurrent requests, 15 % of the loop's time. None of it
finds anything: what a load builds holds no reference cycle, so reference counting frees
it all. So while a :func:`collector_scope` is open (the service opens one per load and
per stored batch) the cyclic collector is off: the temporaries are created and freed
without a collection seeing them. It comes back when the last scope closes, and only if
it was on (a host that switched it off itself is left alone). Under load without a gap,
the scopes collect the youngest generation at least every :data:`YOUNG_EVERY` seconds,
the two young ones every :data:`MIDDLE_EVERY` seconds, so a host's own cyclic garbage
still goes; and everything every :data:`FULL_EVERY` seconds at most, when the objects the
collector walks grew by :data:`FULL_GROWTH` since the last full collection. That is
CPython's own rule, on the objects that remain rather than on what young collections
moved to the old generation: they move there the models of the loads in flight at the
time, and those are freed soon after. Objects that do not grow are
not walked again; cyclic garbage stays and grows them, so it still goes. Counting them
takes milliseconds (10 ms for 110,000 on the benchmark machine, a sixth of a full
collection of them), so they are counted only once the heap grew by as much
(``sys.getallocatedblocks``, tens of microseconds): a heap that grows with what the
collector does not walk (the flat tuples of observations queued while a table is held)
costs a count, not a full collection.

The young collections age what they find as CPython's own do: what survives the youngest
generation's moves to the middle one, and only what still lives at the next collection
of that one moves to the old generation. Most of what a load builds is freed before
then. Moved there at once (every young collection collected both young generations),
the models of the loads in flight at each collection piled up in the old generation as
if they were long-lived: CPython counts them, and once they come to a quarter of it, its
own rule sets off a full collection at the next allocation after the last scope closed,
in the middle of the next request. With a 30,000-fact identity loading next to others,
that was a 55 to 75 ms stall in three runs out of three, and none in three runs once
young collections aged what they found.

These collections stall the loop: a full one for as long as it walks every object of the
process, 30 to 120 ms under load on a 2-core machine, a young one up to 25 ms. A load
that is near its timeout when one starts returns that much late. So a scope may say when
a collection that is due may run (``may_collect``): the service lets one run only while
no load in flight is past a third of its timeout. A collection waits at most another of
its periods, then runs anyway.

A young collection walks everything made since the one before that still lives, and a
big work in flight makes a lot: the consolidation of a backlog of 100,000 observations
holds its rows, observations, session groups and history, about 600,000 objects a
second. Each young collection during it walked 200,000 to 350,000 of them, a stall of
50 to 170 ms every half second, for nothing: the work frees them all itself at its end
(see "Freeing is work too"), and what is freed before a collection is never walked. So
a young collection that is due also waits while the youngest generation holds more than
:data:`YOUNG_LIMIT` objects (:func:`young_objects`), for at most :data:`YOUNG_WAIT`
seconds since the last one: the same backlog's load then stalled the loop at most 18
and 23 ms (two runs), at the turns of its own work. Only the young collections wait so:
a full one that is due (once a minute at most, the heap grown) runs, and walks such
objects too. And the count is CPython's, what was made less what was freed since the
last young collection, objects of older generations included: it may say less than the
youngest generation holds (a collection of 31,000 objects, 14 ms, under an emit burst).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from coda_memory.core.model import gc_paused

T = TypeVar("T")
R = TypeVar("R")

#: Work written as steps: a generator that yields between them and returns the result.
Steps = Generator[None, None, R]

#: Items converted between two turns of the loop (about 0.2 ms of work).
SLICE = 200
#: While scopes keep the collector off without a gap: the youngest generation is
#: collected at least this often (seconds). Each collection stalls the loop for as long
#: as it walks what was made since the one before and still lives, mostly the models of
#: the loads in flight: 2 to 10 ms under 8 concurrent requests on the benchmark machine
#: (at 1 s, fewer stalls of up to 11 ms, and no lower lag p99 in an A/B run).
YOUNG_EVERY = 0.25
#: … and both young generations this often: what lived through a collection of the
#: youngest and still lives moves to the old generation. Ten young collections to one,
#: as CPython's own thresholds have it.
MIDDLE_EVERY = 10 * YOUNG_EVERY
#: … and every generation at most this often, when the objects the collector walks
#: grew by FULL_GROWTH since the last full collection.
FULL_EVERY = 60.0
#: A young collection that is due waits while the youngest generation holds more than
#: this many objects (walking them stalls the loop about 5 ms on the benchmark
#: machine)...
YOUNG_LIMIT = 20_000
#: ... for at most this long (seconds) since the last one.
YOUNG_WAIT = 10.0
FULL_GROWTH = 0.25


def heap_size() -> int:
    """The memory blocks the interpreter has allocated (tens of microseconds)."""
    return sys.getallocatedblocks()


def young_objects() -> int:
    """About how many objects a young collection would walk now: those made since the
    last one, less those freed since (CPython's own count, which is all it costs)."""
    return gc.get_count()[0]


def tracked_objects() -> int:
    """The objects the collector walks in a full collection (milliseconds)."""
    return len(gc.get_objects())


@dataclass(slots=True)
class Heap:
    """The heap and the collector's objects, as noted after a full collection."""

    blocks: int
    objects: int

    @classmethod
    def now(cls) -> Heap:
        return cls(heap_size(), tracked_objects())

    def grown(self) -> bool:
        """Whether the collector's objects grew by FULL_GROWTH since noted; counted only
        once the heap grew by as much (what it did otherwise is noted, not counted
        again)."""
        blocks = heap_size()
        if blocks < self.blocks * (1 + FULL_GROWTH):
            return False
        if tracked_objects() >= self.objects * (1 + FULL_GROWTH):
            return True
        self.blocks = blocks
        return False


class _Holds:
    """How many scopes hold the collector off, and whether it was on before the first."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.count = 0
        self.was_enabled = False
        #: Each hold by its token, with the event loop its scope opened on (None: none).
        self.holders: dict[int, asyncio.AbstractEventLoop | None] = {}
        #: How many holds each of those loops has: what :meth:`_drop_stranded` looks at
        #: (one or two loops, where the holds may be thousands).
        self.loops: dict[asyncio.AbstractEventLoop, int] = {}
        self.tokens = itertools.count()
        #: When each generation was last collected (a collection of one collects the
        #: younger ones too).
        self.young_at = self.middle_at = self.full_at = 0.0
        #: The heap after the last full collection (None: not known yet; the first look
        #: counts from then on).
        self.heap: Heap | None = None

    def take(self, may_collect: Callable[[], bool] | None = None) -> int:
        """Hold the collector off; the token for :meth:`give_back`."""
        with self.lock:
            if self.loops:
                self._drop_stranded()
            token = next(self.tokens)
            loop = self.holders[token] = _running_loop()
            if loop is not None:
                self.loops[loop] = self.loops.get(loop, 0) + 1
            now = self.clock()
            if self.count == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
                # The collector ran as usual until now.
                self.young_at = self.middle_at = self.full_at = now
            self.count += 1
            if not self.was_enabled:
                return token
            generation = self._due(now, may_collect)
            if generation is not None:
                self._collected(generation, now)
        if generation == 2 and not self._grown():
            generation = 1  # the young ones instead, due at least as long
        if generation is not None:
            # Outside the lock: a finalizer the collection runs may open a scope.
            gc.collect(generation)
            if generation == 2:
                self.heap = Heap.now()
        return token

    def _drop_stranded(self) -> None:
        """Drop the holds of scopes whose event loop is closed (one closed with a load in
        flight, its tasks never cancelled): they can never close, and the collector would
        stay off for the rest of the process. Looks at each loop, not at each hold: with
        2,000 loads in flight, a look at every hold for every new one stalled the event
        loop for 0.4 s."""
        closed = {loop for loop in self.loops if loop.is_closed()}
        if not closed:
            return
        stranded = [t for t, loop in self.holders.items() if loop in closed]
        for token in stranded:
            del self.holders[token]
            self.count -= 1
        for loop in closed:
            del self.loops[loop]
        if stranded and self.count == 0 and self.was_enabled:
            gc.enable()

    def forked(self) -> None:
        """In a forked child: none of the parent's scopes will close there."""
        self.lock = threading.Lock()  # (another thread may have held it at the fork)
        if self.count and self.was_enabled:
            gc.enable()
        self.count = 0
        self.holders.clear()
        self.loops.clear()

    def _collected(self, generation: int, now: float) -> None:
        """Note a collection of ``generation`` (and of the younger ones) at ``now``."""
        self.young_at = now
        if generation >= 1:
            self.middle_at = now
        if generation == 2:
            self.full_at = now

    def _grown(self) -> bool:
        """Whether the heap grew since the last full collection (see ``Heap``; the first
        time, never: it is noted)."""
        if self.heap is None:
            self.heap = Heap.now()
            return False
        return self.heap.grown()

    def _due(self, now: float, may_collect: Callable[[], bool] | None) -> int | None:
        """The generation to collect now, if any. One that is due waits while
        ``may_collect`` says no, for at most another of its periods."""
        for generation, since, every in (
            (2, now - self.full_at, FULL_EVERY),
            (1, now - self.middle_at, MIDDLE_EVERY),
            (0, now - self.young_at, YOUNG_EVERY),
        ):
            if since < every:
                continue
            if generation < 2 and since < YOUNG_WAIT and young_objects() > YOUNG_LIMIT:
                continue  # a big work in flight: its objects may be gone soon (see above)
            if since >= 2 * every or may_collect is None or may_collect():
                return generation
        return None

    def give_back(self, token: int) -> None:
        with self.lock:
            if token not in self.holders:
                return  # dropped already (its loop closed, or a fork)
            loop = self.holders.pop(token)
            if loop is not None:
                left = self.loops[loop] - 1
                if left:
                    self.loops[loop] = left
                else:
                    del self.loops[loop]
            self.count -= 1
            if self.count == 0 and self.was_enabled:
                gc.enable()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The running event loop, or None (a scope opened off any loop, in a thread)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


_HOLDS = _Holds()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HOLDS.forked)


@contextmanager
def collector_scope(
    hold: bool = True, may_collect: Callable[[], bool] | None = None
) -> Iterator[None]:
    """Hold the cyclic garbage collector off until the scope closes (see above); nothing
    when ``hold`` is False. ``may_collect``: whether a collection that is due may stall
    the loop now (see above); it is not asked once one is overdue by another period."""
    if not hold:
        yield
        return
    token = _HOLDS.take(may_collect)
    try:
        yield
    finally:
        _HOLDS.give_back(token)


def collector_held() -> bool:
    """Whether a scope holds the collector off."""
    return _HOLDS.count > 0


#: The semaphore whose places the current task's steps and conversions take turns for
#: (see :func:`taking_turns`; None: they don't).
_TURNS: ContextVar[asyncio.Semaphore | None] = ContextVar("coda_memory_turns", default=None)


@contextmanager
def taking_turns(turns: asyncio.Semaphore) -> Iterator[None]:
    """Within the block, this task's :func:`stepped` and :func:`mapped` run only while it
    holds a place of ``turns``, which other tasks share (tasks it creates meanwhile too).
    Both hold it without waiting for anything else, so taking turns cannot deadlock."""
    token = _TURNS.set(turns)
    try:
        yield
    finally:
        _TURNS.reset(token)


async def _in_turn(work: Coroutine[None, None, R]) -> R:
    """``work``'s result, awaited in the task's turn when it takes turns (closed unrun
    when the task is cancelled while it waits for its turn)."""
    turns = _TURNS.get()
    try:
        if turns is None:
            return await work
        async with turns:
            return await work
    finally:
        work.close()  # nothing once it ran


async def mapped(items: Sequence[T], convert: Callable[[T], R]) -> list[R]:
    """``[convert(item) for item in items]``, with a turn of the event loop after every
    :data:`SLICE` items, and in the task's turn when it takes turns (:func:`taking_turns`);
    ``convert`` must build acyclic objects. Outside a scope the collector is off within
    each slice (see :func:`~coda_memory.core.model.gc_paused`)."""
    return await _in_turn(_mapped(items, convert))


async def _mapped(items: Sequence[T], convert: Callable[[T], R]) -> list[R]:
    if len(items) <= SLICE:
        with gc_paused():
            return [convert(item) for item in items]
    out: list[R] = []
    for start in range(0, len(items), SLICE):
        with gc_paused():
            out.extend([convert(item) for item in items[start : start + SLICE]])
        await asyncio.sleep(0)
    return out


async def stepped(steps: Steps[R]) -> R:
    """The result of ``steps``, with a turn of the event loop at each of its yields, in
    the task's turn when it takes turns (:func:`taking_turns`)."""
    return await _in_turn(_stepped(steps))


async def _stepped(steps: Steps[R]) -> R:
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: R = done.value
            return result
        await asyncio.sleep(0)


def emptying(containers: Iterable[list[Any] | dict[Any, Any]], step: int = SLICE) -> Steps[None]:
    """Empty each of ``containers``, yielding after every ``step`` items removed (over all
    of them): what removing an item frees, when nothing else holds it, is freed a step at
    a time rather than all at once when the container goes (see above). Removing from the
    end costs nothing per item but the freeing (a list shifts nothing, a dict's
    ``popitem`` takes its last entry)."""
    left = step
    for items in containers:
        while items:
            count = min(left, len(items))
            if isinstance(items, dict):
                for _ in range(count):
                    items.popitem()
            else:
                del items[-count:]
            left -= count
            if not left:
                yield
                left = step


async def released(*containers: list[Any] | dict[Any, Any]) -> None:
    """Empty ``containers`` (the caller's own: they are left empty) as :func:`emptying`
    does, with a turn of the event loop after every :data:`SLICE` items, in the task's
    turn when it takes turns (none for up to SLICE items: what they free takes
    microseconds)."""
    if sum(map(len, containers)) > SLICE:
        await stepped(emptying(containers, SLICE))
    else:
        for items in containers:
            items.clear()


def finished(steps: Steps[R]) -> R:
    """The result of ``steps``, run in one go (where no event loop waits for a turn)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: R = done.value
            return result
