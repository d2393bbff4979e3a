"""What drain() (and so close() and forget()) waits for: every observation emitted before
it began, told by which emits they were, not by how many were processed. An append of
later observations that ends first, and an emit of another thread refused between two
drains, are processed without ending a drain that still has earlier ones to wait for.

The store is the in-memory one, its appends held until the test lets them go, or made
to end in an order drawn from a seed.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from coda_memory import MemoryService, NewObservation, ObservationType
from coda_memory import writer as writer_module
from coda_memory.core.sanitize import MAX_METADATA_BYTES
from coda_memory.ports import AppendOutcome, ObservationRecord
from coda_memory.testing import InMemoryStore
from tests.helpers import FakeClock, tool_ok

#: On both event loops (see tests/conftest.py).
pytestmark = pytest.mark.both_loops


class FirstAppendHeld(InMemoryStore):
    """An in-memory store whose first append waits for :attr:`release`; the others go
    through. :attr:`first_began` is set once the first has begun."""

    def __init__(self) -> None:
        super().__init__()
        self.first_began = asyncio.Event()
        self.release = asyncio.Event()
        self.appends = 0

    async def append(
        self,
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        self.appends += 1
        if self.appends == 1:
            self.first_began.set()
            await self.release.wait()
        return await super().append(records, batch_key=batch_key, first_attempt=first_attempt)


class AppendsInAnyOrder(InMemoryStore):
    """An in-memory store whose appends each take a number of turns of the event loop
    drawn from ``rng``: two in flight end in either order."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    async def append(
        self,
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        for _ in range(self.rng.randrange(30)):
            await asyncio.sleep(0)
        return await super().append(records, batch_key=batch_key, first_attempt=first_attempt)


async def _stored_sessions(store: InMemoryStore) -> set[str | None]:
    """The sessions of u1's stored observations (each test's are all u1's, one each)."""
    return {observation.session_id for observation in await store.observations("u1")}


async def _until(condition: Any) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0)


async def _drains_that_ended_early(seed: int) -> list[int]:
    """Emits, drains and turns of the loop in an order drawn from ``seed``, over
    appends that end in any order; the drains (by how many emits came before each) that
    returned with one of those not stored."""
    rng = random.Random(seed)
    store = AppendsInAnyOrder(rng)
    service = MemoryService(store, clock=FakeClock(), batch_size=rng.choice([1, 2, 3, 5]))
    emitted: list[str] = []
    early: list[int] = []

    async def drain(before: list[str]) -> None:
        await service.drain(timeout=5)
        if not set(before) <= await _stored_sessions(store):
            early.append(len(before))

    drains = []
    try:
        for step in range(300):
            draw = rng.random()
            if draw < 0.7:
                emitted.append(f"s{step}")
                service.emit_observation("u1", tool_ok("get_account", emitted[-1]))
            elif draw < 0.85:
                drains.append(asyncio.ensure_future(drain(list(emitted))))
            else:
                for _ in range(rng.randrange(1, 5)):
                    await asyncio.sleep(0)
        await asyncio.gather(*drains, drain(emitted))
        assert service.stats().stored == len(emitted)
    finally:
        await service.close()
    return early


async def test_drains_wait_for_what_came_before_them_whatever_order_appends_end_in() -> None:
    """Drains begun between emits, over appends of random lengths: each returns with
    every observation emitted before it stored (by counts, some returned early)."""
    for seed in range(40):
        assert await _drains_that_ended_early(seed) == [], f"seed {seed}"


def _paused_off_the_main_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[threading.Event, threading.Event]:
    """Hold an emit of another thread once its sequence is taken (as it sizes the
    observation): set, the first event says it is held, the second lets it go on."""
    entered, go_on = threading.Event(), threading.Event()
    sizing = writer_module._approximate_bytes

    def paused(obs: Any) -> int:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            go_on.wait(5)
        return sizing(obs)

    monkeypatch.setattr(writer_module, "_approximate_bytes", paused)
    return entered, go_on


async def test_a_drain_waits_for_an_earlier_append_that_a_later_one_overtakes() -> None:
    """Two appends run at once under a backlog: the second, of observations emitted after
    the drain began, ended first, its count made up the drain's, and the drain returned
    with the observations emitted before it not stored."""
    store = FirstAppendHeld()
    service = MemoryService(store, clock=FakeClock(), batch_size=2)
    try:
        for n in (1, 2):
            service.emit_observation("u1", tool_ok("get_account", f"before{n}"))
        async with asyncio.timeout(5):
            await store.first_began.wait()
        draining = asyncio.ensure_future(service.drain())
        await asyncio.sleep(0)  # the drain's first step: it waits for before1 and before2
        for n in (1, 2, 3, 4):  # two full batches: the first beside the held append
            service.emit_observation("u1", tool_ok("get_account", f"after{n}"))
        # The second batch goes once the first is counted: the drain has looked since.
        await _until(lambda: service.stats().stored == 4)
        assert await _stored_sessions(store) == {"after1", "after2", "after3", "after4"}
        assert not draining.done()
        store.release.set()
        async with asyncio.timeout(5):
            await draining
        assert len(await _stored_sessions(store)) == 6
        stats = service.stats()
        assert (stats.emitted, stats.stored, stats.pending) == (6, 6, 0)
    finally:
        store.release.set()
        await service.close()


async def test_an_emit_refused_between_two_drains_ends_neither_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread's emit began after the first drain and before the second, and was
    refused after both had begun: the wait mark was the second's alone, so it counted as
    processed for the first too, which returned with the observation it waited for not
    stored."""
    store = FirstAppendHeld()
    service = MemoryService(store, clock=FakeClock(), queue_bytes=4096)
    entered, go_on = _paused_off_the_main_thread(monkeypatch)
    too_large = tool_ok("get_account", "refused").model_copy(update={"content": "x" * 8192})
    thread = threading.Thread(target=lambda: service.emit_observation("u1", too_large))
    try:
        service.emit_observation("u1", tool_ok("get_account", "waited"))
        async with asyncio.timeout(5):
            await store.first_began.wait()
        first = asyncio.ensure_future(service.drain())
        await asyncio.sleep(0)  # the first drain's first step: it waits for "waited"
        thread.start()
        await asyncio.to_thread(entered.wait, 5)  # that emit is under way
        second = asyncio.ensure_future(service.drain())
        await asyncio.sleep(0)  # the second drain's first step: it waits for both
        go_on.set()
        # Dropped (larger than queue_bytes), it woke the drains before the join returned
        # (through the loop, in order): they have looked since.
        await asyncio.to_thread(thread.join)
        assert service.stats().dropped == 1
        assert not first.done()
        assert not second.done()
        store.release.set()
        async with asyncio.timeout(5):
            await asyncio.gather(first, second)
        assert await _stored_sessions(store) == {"waited"}
        stats = service.stats()
        assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (2, 1, 1, 0)
    finally:
        go_on.set()
        store.release.set()
        await service.close()


async def test_a_drain_waiting_for_an_emit_of_another_thread_rejected_as_it_came_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The emit was under way as the drain began, so the drain waited for it; rejected
    as it came (metadata of more values than validation takes), it was counted without
    waking the drain, which waited for something else to be processed: for ever, when
    nothing else came."""
    service = MemoryService(InMemoryStore(), clock=FakeClock())
    entered, go_on = _paused_off_the_main_thread(monkeypatch)
    rows = list(range(MAX_METADATA_BYTES + 1))
    too_many = NewObservation.model_construct(
        type=ObservationType.TOOL_SUCCESS, content="", metadata={"toolName": "t", "rows": rows}
    )
    thread = threading.Thread(target=lambda: service.emit_observation("u1", too_many))
    try:
        service.emit_observation("u1", tool_ok("get_account", "warmup"))
        await service.drain()
        thread.start()
        await asyncio.to_thread(entered.wait, 5)  # that emit is under way
        draining = asyncio.ensure_future(service.drain())
        await asyncio.sleep(0)  # the drain's first step: it waits for that emit
        go_on.set()
        await asyncio.to_thread(thread.join)
        async with asyncio.timeout(5):
            await draining
        stats = service.stats()
        assert (stats.emitted, stats.stored, stats.rejected, stats.pending) == (2, 1, 1, 0)
    finally:
        go_on.set()
        await service.close()
