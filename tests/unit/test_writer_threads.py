"""Counters that an emit of another thread changes too: the loop's updates of them must
not be split by a switch of threads, or the other thread's update is lost.

CPython hands the GIL to another thread at a call's end (and a loop's jump back, a
function's start), never between two plain instructions. These tests trace the writer's
methods instruction by instruction and run an emit of "another thread" at every such
point that follows a call, which is where a real switch could run it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from coda_memory import MemoryService, NewObservation, ObservationType
from coda_memory.testing import InMemoryStore
from coda_memory.writer import ObservationWriter
from tests.helpers import FakeClock, tool_ok
from tests.thread_switches import switches_after_calls

#: On both event loops (see tests/conftest.py).
pytestmark = pytest.mark.both_loops


def _held_bytes_of_queue(service: MemoryService) -> int:
    return sum(item[5] for item in service._queue)


@dataclass
class EmitsOfAnotherThread:
    """A switch (see :func:`switches_after_calls`): an emit of ``observation`` for
    ``identity`` by another thread, ``limit`` of them at the most; ``count`` says how
    many ran."""

    service: MemoryService
    identity: str
    observation: NewObservation
    limit: int
    count: int = 0

    def __call__(self) -> None:
        if self.count < self.limit:
            self.count += 1
            self.service.emit_observation(self.identity, self.observation)


#: Larger than the queue's bound of the ``service`` fixture: each emit of it is refused.
_TOO_BIG = NewObservation(
    type=ObservationType.TOOL_SUCCESS, content="x" * 200_000, metadata={"toolName": "t"}
)


@pytest.fixture
async def service() -> AsyncIterator[MemoryService]:
    """A service whose queue holds 100,000 bytes at the most, closed after the test."""
    service = MemoryService(InMemoryStore(), clock=FakeClock(), queue_bytes=100_000)
    try:
        yield service
    finally:
        await service.close(timeout=1)


def _queue_three(service: MemoryService) -> None:
    """Queue two observations of "u1" with one of "u2" between them, which the writer
    takes at the test's next await."""
    for identity in ("u1", "u2", "u1"):
        service.emit_observation(identity, tool_ok("get_account"))


@pytest.fixture
def emit_queued(service: MemoryService) -> EmitsOfAnotherThread:
    """Up to 20 emits of another thread that the queue takes."""
    return EmitsOfAnotherThread(service, "u4", tool_ok("get_account"), limit=20)


async def test_forget_loses_no_count_of_an_emit_refused_on_another_thread(
    service: MemoryService,
) -> None:
    """forget()'s count of what it dropped from the queue was added to ``dropped`` with a
    call between its read and its write: an emit refused meanwhile on another thread (a
    full queue) was lost from the count, and ``pending`` stayed at 1 for ever, which
    drain() and close() waited out."""
    _queue_three(service)
    emit_refused = EmitsOfAnotherThread(service, "u3", _TOO_BIG, limit=50)
    with switches_after_calls(ObservationWriter._forget_queued, emit_refused):
        assert service._forget_queued("u1") == 2
    refused = emit_refused.count
    assert refused
    await service.drain(timeout=5)
    stats = service.stats()
    assert stats.emitted == 3 + refused
    assert (stats.stored, stats.dropped, stats.pending) == (1, 2 + refused, 0)


async def test_bytes_held_lose_no_emit_of_another_thread(
    service: MemoryService, emit_queued: EmitsOfAnotherThread
) -> None:
    """The bytes an emit of another thread added to the queue's count were lost when the
    writer or forget() took a batch's bytes off it across a call (sum()): the count fell
    below what the queue holds, and ``queue_bytes`` held more than its bound."""
    _queue_three(service)
    with switches_after_calls(ObservationWriter._forget_queued, emit_queued):
        assert service._forget_queued("u1") == 2
    assert emit_queued.count
    assert service._held_bytes == _held_bytes_of_queue(service)
    emit_queued.count = 0
    with switches_after_calls(ObservationWriter._settled, emit_queued):
        await service.drain(timeout=5)
    assert emit_queued.count
    # (It counts what is queued and what the writer holds.)
    assert service._held_bytes >= _held_bytes_of_queue(service) > 0
    await service.drain(timeout=5)
    assert service._held_bytes == _held_bytes_of_queue(service) == 0


async def test_dropping_what_the_writer_holds_loses_no_bytes_of_another_threads_emit(
    service: MemoryService, emit_queued: EmitsOfAnotherThread
) -> None:
    """Letting go of what the writer held (close, a writer that failed, a closed loop) set
    the bytes held anew from a copy of the queue, across calls: an emit of another thread
    between the copy and the write was lost from the count."""
    _queue_three(service)
    with switches_after_calls(ObservationWriter._drop_held, emit_queued):
        assert service._drop_held("closing", queued=True) == 3
    assert emit_queued.count
    assert service._held_bytes == _held_bytes_of_queue(service) > 0
