"""MemoryService mechanics: the writer, back-pressure, timeouts, closing.

These use the in-memory store, wrapped where a test needs a store that stalls or fails;
the same behaviours against Postgres are in tests/postgres.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import re
import sys
import threading
import warnings
import weakref
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import Any

import pytest
import uvloop

from coda_memory import (
    Fact,
    Forgotten,
    LoadedMemory,
    MemoryService,
    NewObservation,
    ObservationType,
)
from coda_memory import service as service_module
from coda_memory import writer as writer_module
from coda_memory.core import consolidation, prompt, turns
from coda_memory.core.logs import identity_label
from coda_memory.errors import ServiceClosed, StoreBusy
from coda_memory.ports import HELD_OUT, AppendOutcome, ObservationRecord
from coda_memory.testing import InMemoryConsolidationUnit, InMemoryStore
from coda_memory.writer import MAX_AHEAD
from tests.helpers import (
    T0,
    FakeClock,
    entity,
    held_collector_clock,
    held_collector_heap,
    recorded_collections,
    tool_failed,
    tool_ok,
)

#: On both event loops (see tests/conftest.py).
pytestmark = pytest.mark.both_loops


class GatedStore(InMemoryStore):
    """An in-memory store whose writes and consolidations wait for a gate to open, or fail
    while ``failing`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        #: Holds consolidations only (peeks and appends go through).
        self.consolidation_gate = asyncio.Event()
        self.consolidation_gate.set()
        self.failing = False
        self.append_calls = 0

    async def append(
        self,
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        self.append_calls += 1
        await self.gate.wait()
        if self.failing:
            raise ConnectionError("database unavailable")
        return await super().append(records, batch_key=batch_key, first_attempt=first_attempt)

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        await self.gate.wait()
        if self.failing:
            raise ConnectionError("database unavailable")
        return await super().peek(identity_id)

    @asynccontextmanager
    async def consolidation(self, identity_id: str) -> AsyncIterator[InMemoryConsolidationUnit]:
        await self.gate.wait()
        await self.consolidation_gate.wait()
        if self.failing:
            raise ConnectionError("database unavailable")
        async with super().consolidation(identity_id) as unit:
            yield unit


@pytest.fixture
async def gated() -> AsyncIterator[tuple[MemoryService, GatedStore]]:
    store = GatedStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=0.05, queue_size=100)
    yield service, store
    store.gate.set()
    store.failing = False
    await service.close()


async def _old_consolidated_new_stored(service: MemoryService) -> None:
    """u1 with the fact of a consolidated observation (tool "old") and a newer one
    (tool "new") stored, waiting for the next consolidation."""
    service.emit_observation("u1", tool_ok("old"))
    await service.drain()
    await service.consolidate("u1")
    service.emit_observation("u1", tool_ok("new"))
    await service.drain()


async def test_load_memory_gives_facts_prompt_and_affinities() -> None:
    service = MemoryService.from_url("memory://", clock=FakeClock())
    for session in ("s1", "s2"):
        service.emit_observation("u1", tool_ok("get_account", session))
        service.emit_observation("u1", entity("account", "42", "Acme", session))
    service.emit_observation("u1", tool_failed("run_query"))
    await service.drain()
    memory = await service.load_memory("u1")
    assert {f.subject for f in memory.facts} == {
        "tool_affinity:get_account",
        "entity_frequency:account:42",
        "tool_avoidance:run_query",
    }
    assert memory.tool_affinities == {"get_account": 0.6, "run_query": -0.5}
    lines = memory.prompt_section.splitlines()
    assert lines[0] == "## What you know about this user"
    assert "- Uses get_account successfully" in lines
    assert '- Works with account "Acme" (id "42")' in lines
    assert "- run_query has failed for this user" in lines
    await service.close()


async def test_a_token_counter_that_fails_is_logged_by_its_class_not_its_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The host's counter is given the prompt section's text, and its error's message may
    quote it (a tokenizer quoting what it refused): the load's log line said it all."""

    def count(text: str) -> int:
        raise ValueError(f"cannot count {text!r}")

    service = MemoryService.from_url(
        "memory://", clock=FakeClock(), load_timeout=5.0, token_counter=count
    )
    try:
        service.emit_observation("u1", entity("account", "42", "Alice Smith", "s1"))
        await service.drain()
        with caplog.at_level(logging.WARNING, "coda_memory"):
            memory = await service.load_memory("u1")
    finally:
        await service.close()
    assert memory.prompt_section == ""
    assert service.stats().load_errors == 1
    assert "(HostCallbackError: token_counter raised ValueError)" in caplog.text
    assert "Alice" not in caplog.text and "cannot count" not in caplog.text


@pytest.mark.parametrize("odd", [float("nan"), -1, -0.5, "3", None])
async def test_a_token_counter_that_returns_no_count_fails_the_load(
    odd: object, caplog: pytest.LogCaptureFixture
) -> None:
    """A count that is NaN or negative passed every comparison with the budget (NaN is
    neither above nor below it; a negative one let any line in): the prompt section
    held every fact, far over ``prompt_budget_tokens``. It fails the load as a counter
    that raises does, naming the type only (a str may quote the section)."""
    service = MemoryService.from_url(
        "memory://",
        clock=FakeClock(),
        load_timeout=5.0,
        prompt_budget_tokens=10,
        token_counter=lambda text: odd,
    )
    try:
        for n in range(20):
            service.emit_observation("u1", entity("account", str(n), f"Account {n}", "s1"))
        await service.drain()
        with caplog.at_level(logging.WARNING, "coda_memory"):
            memory = await service.load_memory("u1")
    finally:
        await service.close()
    assert memory == LoadedMemory.empty()
    assert service.stats().load_errors == 1
    assert f"(HostCallbackError: token_counter returned {type(odd).__name__}," in caplog.text


async def test_a_token_counter_may_count_in_floats() -> None:
    """A count that is a float (characters over 4) is a count."""
    service = MemoryService.from_url(
        "memory://", clock=FakeClock(), load_timeout=5.0, token_counter=lambda t: len(t) / 4
    )
    try:
        service.emit_observation("u1", entity("account", "42", "Acme", "s1"))
        await service.drain()
        memory = await service.load_memory("u1")
    finally:
        await service.close()
    assert 'Works with account "Acme"' in memory.prompt_section
    assert service.stats().load_errors == 0


async def test_concurrent_loads_of_one_identity_get_answers_of_their_own() -> None:
    """They shared one consolidation and got the same object: a request that changed its
    answer (popped an affinity, cleared the facts) changed the other request's too."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    service.emit_observation("u1", tool_ok("get_account", "s1"))
    service.emit_observation("u1", tool_ok("list_orders", "s1"))
    await service.drain()
    first, second = await asyncio.gather(service.load_memory("u1"), service.load_memory("u1"))
    assert first is not second
    first.tool_affinities.clear()
    first.facts.clear()
    assert set(second.tool_affinities) == {"get_account", "list_orders"}
    assert len(second.facts) == 2
    await service.close()


async def test_load_memory_returns_empty_on_timeout_and_finishes_in_the_background(
    gated: tuple[MemoryService, GatedStore],
) -> None:
    service, store = gated
    service.emit_observation("u1", tool_ok("t"))
    await service.drain()
    store.gate.clear()
    memory = await service.load_memory("u1")
    assert (memory.facts, memory.prompt_section, memory.tool_affinities) == ([], "", {})
    assert service.stats().load_timeouts == 1
    store.gate.set()
    await service.drain()  # waits for the background consolidation
    assert [f.subject for f in await service.facts("u1")] == ["tool_affinity:t"]
    # The next call works.
    assert [f.subject for f in (await service.load_memory("u1")).facts] == ["tool_affinity:t"]


async def test_a_load_outliving_its_timeout_answers_with_the_last_consolidated_facts(
    gated: tuple[MemoryService, GatedStore],
) -> None:
    service, store = gated
    await _old_consolidated_new_stored(service)
    store.consolidation_gate.clear()
    memory = await service.load_memory("u1")
    assert [f.subject for f in memory.facts] == ["tool_affinity:old"]
    assert memory.tool_affinities == {"old": 0.5}
    assert "Uses old successfully" in memory.prompt_section
    stats = service.stats()
    assert (stats.load_stale, stats.load_timeouts) == (1, 0)
    store.consolidation_gate.set()
    await service.drain()
    subjects = [f.subject for f in (await service.load_memory("u1")).facts]
    assert subjects == ["tool_affinity:new", "tool_affinity:old"]


async def test_a_load_that_finishes_as_its_timeout_fires_answers_with_its_result(
    gated: tuple[MemoryService, GatedStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a busy loop the consolidation can finish between the timeout and the end of
    wait's cancellation, which then still raises TimeoutError: the load
    answers with the finished result, not empty."""
    service, store = gated
    service.emit_observation("u1", tool_ok("t"))
    await service.drain()
    real_within = service_module._within

    async def late_within(task: Any, seconds: float) -> Any:
        try:
            return await real_within(task, seconds)
        except TimeoutError:
            # What a busy loop does: the consolidation goes on and finishes before the
            # timed-out wait is through.
            (task,) = service._loading.values()
            store.consolidation_gate.set()
            await asyncio.gather(task)
            raise

    store.consolidation_gate.clear()
    monkeypatch.setattr(service_module, "_within", late_within)
    memory = await service.load_memory("u1")
    assert [f.subject for f in memory.facts] == ["tool_affinity:t"]
    stats = service.stats()
    assert (stats.load_timeouts, stats.load_stale) == (0, 0)


async def test_a_cancelled_load_always_raises_its_cancellation() -> None:
    """A host cancels a request's task when its client goes away. Python 3.11's wait_for
    returned the load's result instead when the load finished in the same turn of the
    loop: the cancellation was lost, and the request went on."""
    service = MemoryService.from_url("memory://", clock=FakeClock(), load_timeout=5)
    service.emit_observation("u1", tool_ok("t"))
    await service.drain()
    await service.load_memory("u1")
    swallowed = []
    for waited in range(40):
        load = asyncio.create_task(service.load_memory("u1"))
        for _ in range(waited):
            await asyncio.sleep(0)
        if load.done():
            continue
        load.cancel()
        try:
            await load
            swallowed.append(waited)
        except asyncio.CancelledError:
            pass
    assert swallowed == []
    await service.close()


async def test_close_ends_the_loads_in_flight_with_an_answer_not_an_exception(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``close`` cancels the consolidations in flight; a load waiting for one raised that
    CancelledError in the host's request, which nobody had cancelled."""
    store = GatedStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=5)
    service.emit_observation("u1", tool_ok("t"))
    await service.drain()
    store.consolidation_gate.clear()
    load = asyncio.create_task(service.load_memory("u1"))
    while not service._loading:
        await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, "coda_memory"):
        await service.close(timeout=0.01)
        memory = await load
    assert memory.facts == []
    assert service.stats().load_errors == 1
    assert "LoadCancelled" in caplog.text


async def test_a_closed_service_takes_no_more_work() -> None:
    """After ``close`` its store was opened again by the next call (new connections that
    nothing closed); now loads answer empty and the rest raises ServiceClosed."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    service.emit_observation("u1", tool_ok("t"))
    await service.close()
    memory = await service.load_memory("u1")
    assert memory.facts == [] and service.stats().load_errors == 1
    for call in (
        service.consolidate("u1"),
        service.facts("u1"),
        service.history("u1"),
        service.forget("u1"),
        service.start(),
    ):
        with pytest.raises(ServiceClosed):
            await call


async def test_a_second_close_returns_when_the_first_has_released_the_store() -> None:
    """A host's shutdown hooks may both close the service: the second returned at once,
    while the first was still draining, and the host went on to exit."""
    closed: list[str] = []

    class ClosingStore(GatedStore):
        async def close(self) -> None:
            closed.append("store")

    store = ClosingStore()
    service = MemoryService(store, clock=FakeClock(), queue_size=100)
    store.gate.clear()  # the writer's append waits
    service.emit_observation("u1", tool_ok("t"))
    first = asyncio.create_task(service.close(timeout=0.05))
    await asyncio.sleep(0)
    await service.close()
    assert closed == ["store"]
    await first


async def test_close_gives_up_on_a_call_that_does_not_end_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """close() waits for the caller's calls in flight, but at most its grace: one stuck
    for good can't hold the host's shutdown up."""
    monkeypatch.setattr(service_module, "CLOSE_GRACE", 0.05)
    closed: list[str] = []
    never = asyncio.Event()

    class StuckStore(InMemoryStore):
        async def facts(self, identity_id: str) -> list[Fact]:
            await never.wait()
            return []

        async def close(self) -> None:
            closed.append("store")

    service = MemoryService(StuckStore(), clock=FakeClock())
    reading = asyncio.create_task(service.facts("u1"))
    await asyncio.sleep(0)  # the call is in flight
    with caplog.at_level(logging.WARNING, "coda_memory"):
        await asyncio.wait_for(service.close(timeout=0.05), 5)
    assert closed == ["store"]
    assert "1 call(s) still used the store" in caplog.text
    assert not reading.done()
    # When it ends, what it opened in the store since is released too (a Redis client
    # connects again on its next command).
    never.set()
    assert await reading == []
    assert closed == ["store", "store"]


async def test_close_gives_its_waits_one_grace_not_one_each(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the database no longer answering, the writer's stop, the consolidations and the
    caller's calls in flight share one grace, counted from the drain's end: an append and
    a call that both stall take the grace once, not one after the other, and close()
    returns within its timeout and twice the grace."""
    grace = 1.0  # large against the scheduling noise of a loaded machine
    monkeypatch.setattr(service_module, "CLOSE_GRACE", grace)
    monkeypatch.setattr(writer_module, "CLOSE_GRACE", grace)
    never = asyncio.Event()

    class StuckStore(GatedStore):
        async def facts(self, identity_id: str) -> list[Fact]:
            await never.wait()
            return []

    store = StuckStore()
    service = MemoryService(store, clock=FakeClock())
    store.gate.clear()  # the append in flight does not end
    service.emit_observation("u1", tool_ok("t"))
    await _until(lambda: store.append_calls == 1)
    reading = asyncio.create_task(service.facts("u1"))  # nor does this call
    await _until(lambda: service._calls_in_flight == 1)
    loop = asyncio.get_running_loop()
    with caplog.at_level(logging.WARNING, "coda_memory"):
        began = loop.time()
        await asyncio.wait_for(service.close(timeout=0), 10)
        took = loop.time() - began
    # One after the other, the append's moment (grace / 2) and the call's grace took 1.5
    # grace; shared, the call's wait ends with the grace that the append's began.
    assert 0.95 * grace <= took < 1.4 * grace  # (the call is waited for: its grace)
    assert "1 call(s) still used the store" in caplog.text
    assert service.stats().dropped == 1
    assert not reading.done()
    never.set()
    assert await reading == []


async def test_load_memory_returns_empty_on_store_errors(
    gated: tuple[MemoryService, GatedStore], caplog: pytest.LogCaptureFixture
) -> None:
    service, store = gated
    store.failing = True
    with caplog.at_level(logging.WARNING, "coda_memory"):
        memory = await service.load_memory("u1")
    assert memory.prompt_section == ""
    assert service.stats().load_errors == 1
    # The identity is named by its hash, the error by its class and message.
    assert f"{identity_label('u1')} failed (ConnectionError: database unavailable)" in caplog.text
    assert "'u1'" not in caplog.text
    store.failing = False
    with pytest.raises(ConnectionError):
        store.failing = True
        await service.consolidate("u1")  # consolidate itself raises


async def test_a_full_queue_drops_and_counts_and_keeps_memory_bounded(
    gated: tuple[MemoryService, GatedStore], caplog: pytest.LogCaptureFixture
) -> None:
    service, store = gated
    store.gate.clear()
    with caplog.at_level(logging.WARNING, "coda_memory"):
        for i in range(1_000):
            service.emit_observation("u1", tool_ok("t", session=f"s{i}"))
        await asyncio.sleep(0)  # let the writer take its first batch
        for i in range(1_000):
            service.emit_observation("u1", tool_ok("t", session=f"x{i}"))
    stats = service.stats()
    assert stats.emitted == 2_000
    # At most queue_size waiting plus one batch in the writer's hands.
    assert stats.pending <= 100 + 100
    assert stats.dropped == 2_000 - stats.pending
    assert "dropped 1 observation(s) (queue full)" in caplog.text
    store.gate.set()
    await service.drain()
    assert service.stats().stored == stats.pending


async def test_an_observation_larger_than_queue_bytes_is_dropped_as_such(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It was logged as "queue full" with nothing queued."""
    service = MemoryService.from_url("memory://", clock=FakeClock(), queue_bytes=4_096)
    with caplog.at_level(logging.WARNING, "coda_memory"):
        service.emit_observation("u1", tool_ok("t", session="x" * 100))
        service.emit_observation(
            "u1",
            NewObservation(
                type=ObservationType.TOOL_SUCCESS,
                content="x" * 10_000,
                metadata={"toolName": "big"},
            ),
        )
    assert service.stats().dropped == 1
    assert "dropped 1 observation(s) (observation larger than queue_bytes)" in caplog.text
    assert "full)" not in caplog.text  # neither bound of the queue is met
    await service.close()


async def test_the_writer_retries_while_the_store_is_down(
    gated: tuple[MemoryService, GatedStore],
) -> None:
    service, store = gated
    store.failing = True
    service.emit_observation("u1", tool_ok("t"))
    while store.append_calls < 2:  # wait until it has failed and retried
        await asyncio.sleep(0.01)
    assert service.stats().pending == 1
    store.failing = False
    await service.drain()
    assert (service.stats().stored, service.stats().pending) == (1, 0)


async def test_emit_from_another_thread_reaches_the_store() -> None:
    service = MemoryService.from_url("memory://", clock=FakeClock())
    service.emit_observation("u1", tool_ok("warmup"))  # starts the writer on this loop

    def emit_many() -> None:
        for i in range(50):
            service.emit_observation("u1", tool_ok(f"t{i}"))

    thread = threading.Thread(target=emit_many)
    thread.start()
    thread.join()
    await service.drain()
    assert service.stats().stored == 51
    await service.close()


async def test_emit_from_another_thread_starts_the_writer_a_load_did_not() -> None:
    """A load binds the service to its loop without starting the writer (no start()):
    what threads emitted then stayed pending until something was emitted on the loop."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    stored = asyncio.Event()
    append = service.store.append

    async def appending(records: Any, **options: Any) -> Any:
        result = await append(records, **options)
        stored.set()
        return result

    service.store.append = appending  # type: ignore[method-assign]
    assert (await service.load_memory("u1")).facts == []
    thread = threading.Thread(target=lambda: service.emit_observation("u1", tool_ok("t")))
    thread.start()
    thread.join()
    await asyncio.wait_for(stored.wait(), timeout=5)  # stored with no drain() to start it
    await service.drain()  # (the writer counts it once the append has returned)
    assert service.stats().stored == 1
    await service.close()


def test_a_host_that_runs_each_request_with_run_until_complete_stores_what_it_emits() -> None:
    """Emitted on the loop's own thread between its runs, where no loop runs: nothing
    woke the writer, and nothing was stored while the process lived (until close())."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(service.start())
        for n in range(3):
            service.emit_observation("u1", tool_ok("t", session=f"s{n}"))
        loop.run_until_complete(_until(lambda: service.stats().stored == 3))
        loop.run_until_complete(service.close())
    finally:
        loop.close()


async def test_what_threads_emitted_before_any_load_is_stored_once_a_load_binds_the_loop() -> None:
    """No start(), and nothing emitted on the loop: the first load bound the service to
    its loop without starting the writer, and what threads had emitted stayed pending."""
    service = MemoryService.from_url("memory://", clock=FakeClock())

    def emit_two() -> None:
        for _ in "ab":
            service.emit_observation("u1", tool_ok("t"))

    await asyncio.to_thread(emit_two)
    assert (await service.load_memory("u1")).facts == []
    await _until(lambda: service.stats().stored == 2)
    await service.close()


async def test_emits_of_other_threads_share_one_wake_up_of_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each emit of another thread scheduled a callback of its own: 8 threads emitting
    while the loop was held for a second queued 72,000, and its next turn took 58 ms."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    service.emit_observation("u1", tool_ok("warmup"))  # the writer runs on this loop
    await service.drain()
    woken = 0
    wake = service._wake_on_loop

    def counted() -> None:
        nonlocal woken
        woken += 1
        wake()

    monkeypatch.setattr(service, "_wake_on_loop", counted)

    def emit_many() -> None:
        for n in range(500):
            service.emit_observation("u1", tool_ok(f"t{n}"))

    thread = threading.Thread(target=emit_many)
    thread.start()
    thread.join()  # (the loop is held meanwhile)
    await service.drain()
    assert (woken, service.stats().stored) == (1, 501)
    await service.close()


class _PausedClock:
    """A clock that holds the emitting thread (between the service's check that it is
    open and its queueing) until released."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.pause: threading.Thread | None = None

    def __call__(self) -> datetime:
        if threading.current_thread() is self.pause:
            self.entered.set()
            self.release.wait(5)
        return T0

    async def emit_held(self, service: MemoryService) -> None:
        """Emit one observation to ``service`` from another thread, held by this clock
        (until :meth:`resume`)."""
        self.pause = threading.Thread(target=lambda: service.emit_observation("u1", tool_ok("t")))
        self.pause.start()
        await asyncio.to_thread(self.entered.wait, 5)

    async def resume(self) -> None:
        """Let the held emit go on, and wait until it has returned."""
        assert self.pause is not None
        self.release.set()
        await asyncio.to_thread(self.pause.join)


async def test_an_emit_of_another_thread_that_close_overtakes_is_stored_by_it() -> None:
    """The thread found the service open, then close() began: its wake-up of the loop
    was ignored (the service was closed), so close() waited its whole timeout and the
    observation was dropped."""
    clock = _PausedClock()
    service = MemoryService.from_url("memory://", clock=clock)
    service.emit_observation("u1", tool_ok("warmup"))
    await service.drain()
    await clock.emit_held(service)
    closing = asyncio.ensure_future(service.close(timeout=30))
    await asyncio.sleep(0)  # close() began: the service is closed, its drain waits
    assert service._closed
    await clock.resume()
    async with asyncio.timeout(5):
        await closing
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (2, 2, 0, 0)


async def test_an_emit_of_another_thread_queued_after_close_ended_is_counted_dropped() -> None:
    """It stayed pending for ever: never stored, never counted, no log line."""
    clock = _PausedClock()
    service = MemoryService.from_url("memory://", clock=clock)
    service.emit_observation("u1", tool_ok("warmup"))
    await service.drain()
    await clock.emit_held(service)
    await service.close(timeout=0.1)  # (it waits for that emit, counted as emitted)
    await clock.resume()
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (2, 1, 1, 0)


async def test_close_racing_an_emit_of_another_thread_on_a_service_never_started() -> None:
    """No writer had ever run: close()'s drain met no event to wait on (AssertionError),
    or took the thread's wake-up for one after the writer's stop and waited its whole
    timeout."""
    clock = _PausedClock()
    service = MemoryService.from_url("memory://", clock=clock)
    await clock.emit_held(service)
    closing = asyncio.ensure_future(service.close(timeout=30))
    await asyncio.wait([closing], timeout=0.05)  # close() waits in its drain
    await clock.resume()
    async with asyncio.timeout(5):
        await closing
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (1, 1, 0, 0)


async def test_no_writer_runs_again_once_close_has_stopped_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A drain() while close() still waited for calls in flight started a writer for
    what another thread queued after the stop, and it ran on after close()."""
    clock = _PausedClock()
    service = MemoryService.from_url("memory://", clock=clock)
    service.emit_observation("u1", tool_ok("warmup"))
    await service.drain()
    calls_end = service._calls_end
    calls_ended = asyncio.Event()

    async def held_calls_end(grace: float) -> None:  # a call still in flight
        await calls_ended.wait()
        await calls_end(grace)

    monkeypatch.setattr(service, "_calls_end", held_calls_end)
    await clock.emit_held(service)
    closing = asyncio.ensure_future(service.close(timeout=0.05))
    await _until(lambda: service._stopped and service._writer is None)
    await clock.resume()  # queued after the stop
    await asyncio.wait_for(service.drain(), 1)
    assert service._writer is None
    calls_ended.set()
    await closing
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (2, 1, 1, 0)


def test_an_emit_from_a_loop_of_another_thread_between_the_services_runs_is_stored() -> None:
    """The service's loop, driven with run_until_complete, was idle: the emit was logged
    as from "an event loop the service does not run on" and never stored."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(service.start())

        async def emit() -> None:
            service.emit_observation("u1", tool_ok("t"))

        thread = threading.Thread(target=lambda: asyncio.run(emit()))
        thread.start()
        thread.join()
        loop.run_until_complete(_until(lambda: service.stats().stored == 1))
        loop.run_until_complete(service.close())
    finally:
        loop.close()


def test_stats_after_the_loop_closed_under_a_waiting_drain_counts_and_raises_nothing() -> None:
    """A drain() waiting when the host closed its loop (run_until_complete): the count of
    what was lost woke it through the closed loop, and stats() raised RuntimeError."""
    service = MemoryService.from_url("memory://", clock=FakeClock())

    async def stuck(records: Any, **_: Any) -> Any:
        await asyncio.Event().wait()

    service.store.append = stuck  # type: ignore[method-assign]
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(service.start())
        service.emit_observation("u1", tool_ok("t"))
        draining = loop.create_task(service.drain())
        loop.run_until_complete(asyncio.wait([draining], timeout=0.05))
        assert not draining.done()
    finally:
        loop.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the tasks left pending on the closed loop)
        stats = service.stats()
    assert (stats.emitted, stats.dropped, stats.pending) == (1, 1, 0)


def test_a_service_whose_loop_was_closed_without_its_shutdown_is_not_kept_for_ever() -> None:
    """The loop keeps an unclosed service until its shutdown closes it (see "Closing" in
    the README); a loop closed with loop.close() alone never shuts down, and its service
    must not stay held by the watch of its end once another service starts one."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(service.start())
    finally:
        loop.close()
    held = weakref.ref(service)
    del service

    async def another() -> None:
        async with MemoryService.from_url("memory://", clock=FakeClock()) as other:
            await other.start()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the tasks left pending on the closed loop)
        asyncio.run(another())
        gc.collect()
    assert held() is None


async def test_an_emit_whose_writer_could_not_start_stays_queued_and_counts_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A host's task factory that raised as the first emit started the writer: the
    observation was queued, and counted as rejected too ("not queued"), so it counted
    twice and pending went below zero once it was stored."""
    loop = asyncio.get_running_loop()
    service = MemoryService.from_url("memory://", clock=FakeClock())

    def refusing(loop: asyncio.AbstractEventLoop, coro: Any, **_: Any) -> asyncio.Task[Any]:
        coro.close()
        raise RuntimeError("no tasks now")

    loop.set_task_factory(refusing)
    try:
        service.emit_observation("ana", tool_ok("t"))
    finally:
        loop.set_task_factory(None)
    try:
        stats = service.stats()
        assert (stats.emitted, stats.rejected, stats.pending) == (1, 0, 1)
        assert "writer could not be started (RuntimeError)" in caplog.text
        await service.drain(timeout=5)
        stats = service.stats()
        assert (stats.stored, stats.rejected, stats.pending) == (1, 0, 0)
    finally:
        await service.close()


#: The loops of the lifecycle tests that run their own (asyncio.Runner): the standard
#: library's, and uvloop's, which uvicorn picks when it is installed.
each_loop = pytest.mark.parametrize(
    "new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)


@each_loop
def test_a_service_not_closed_under_warnings_made_errors_says_so_in_its_log(
    caplog: pytest.LogCaptureFixture, new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    """Under ``-W error`` (pytest's ``filterwarnings = error``, a host's too), the
    ResourceWarning of a service that closed itself at its loop's end was raised out of
    the loop's shutdown, which logged an error of asyncio's with a traceback, and the
    warning itself was never seen."""

    async def main() -> None:
        service = MemoryService.from_url("memory://", clock=FakeClock())
        await service.start()

    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(main())
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    said = [r.getMessage() for r in caplog.records if r.name == "coda_memory"]
    assert said == [
        "coda-memory: a MemoryService was not closed before its event loop ended; it closed "
        "itself then (call `await memory.close()` at shutdown, or use `async with memory:`)"
    ]


@each_loop
def test_a_service_never_closed_closes_itself_as_its_loop_ends_on_either_loop(
    caplog: pytest.LogCaptureFixture, new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    """The loop's shutdown of its async generators closes a service its host never
    closed, on uvloop's loop as on asyncio's: what was queued is stored, one
    ResourceWarning says so, asyncio reports nothing, and the next loop is told why."""
    service = MemoryService.from_url("memory://", clock=FakeClock())

    async def serve() -> None:
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain(5)
        service.emit_observation("alice", tool_ok("run_sql"))  # queued as the loop ends

    async def later() -> None:
        with pytest.raises(ServiceClosed, match=r"event loop ended without close\(\)"):
            await service.consolidate("alice")

    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(serve())
        gc.collect()
    assert [(w.category, str(w.message)) for w in seen] == [
        (
            ResourceWarning,
            "a MemoryService was not closed before its event loop ended; it closed itself "
            "then (call `await memory.close()` at shutdown, or use `async with memory:`)",
        )
    ]
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (2, 2, 0, 0)
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(later())


@each_loop
@pytest.mark.parametrize("warned", ["always", "error"])
def test_a_service_first_used_as_its_loop_shuts_down_closes_quietly_on_either_loop(
    caplog: pytest.LogCaptureFixture,
    new_loop: Callable[[], asyncio.AbstractEventLoop],
    warned: Any,
) -> None:
    """A service first used in the ``finally`` of an async generator that the loop's
    shutdown_asyncgens() closes, and closed there: its watch of the loop's end, parked
    once the shutdown began, would never be closed. asyncio's loop was recognised by a
    private attribute that uvloop's does not have: there the watch was parked all the
    same, and the loop warned of a coda-memory generator "scheduled after
    loop.shutdown_asyncgens() call"."""
    served: list[MemoryService] = []

    async def serve() -> None:
        async def streaming() -> AsyncGenerator[None, None]:
            try:
                yield
            finally:  # run by the loop's shutdown_asyncgens()
                async with MemoryService.from_url("memory://", clock=FakeClock()) as service:
                    served.append(service)
                    service.emit_observation("alice", tool_ok("get_account"))
                    await service.load_memory("alice")
                    service.emit_observation("alice", tool_ok("run_sql"))

        response = streaming()
        await response.asend(None)
        held.append(response)  # (left open: the shutdown closes it)

    held: list[AsyncGenerator[None, None]] = []
    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter(warned)  # (also where warnings are errors)
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(serve())
        held.clear()
        gc.collect()
    assert [str(w.message) for w in seen] == []
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    stats = served[0].stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (2, 2, 0, 0)


def test_a_service_not_closed_stays_held_on_a_loop_whose_clock_jumps_a_year() -> None:
    """The loop holds a service not yet closed by a timer set a year ahead; on a loop
    whose clock jumps (a test's fake or virtual clock), the timer fired, the loop let go
    of the service, and its writer's task was destroyed while pending."""

    class Jumping(asyncio.SelectorEventLoop):
        ahead = 0.0

        def time(self) -> float:
            return super().time() + self.ahead

    loop = Jumping()
    service = MemoryService.from_url("memory://", clock=FakeClock())
    try:
        loop.run_until_complete(service.start())
        service.emit_observation("ana", tool_ok("t"))
        held = weakref.ref(service)
        del service
        loop.ahead = 2 * 365 * 24 * 3600.0
        loop.run_until_complete(asyncio.sleep(0.01))
        gc.collect()
        kept = held()
        assert kept is not None
        loop.run_until_complete(kept.close())
        assert kept.stats().stored == 1
    finally:
        loop.close()


def test_a_service_whose_loop_is_dropped_unclosed_goes_with_it() -> None:
    """A host that runs each job on a loop of its own with ``run_until_complete``, never
    closing the loop nor the service: a registry of the module's held every such service,
    its loop and its connections, for the life of the process (60 Postgres connections
    after 30 jobs). The loop holds the service now, and goes with it."""
    held = []
    for _ in range(3):
        service = MemoryService.from_url("memory://", clock=FakeClock())
        loop = asyncio.new_event_loop()
        loop.run_until_complete(service.start())
        held.append(weakref.ref(service))
        del service, loop
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the loops' own "unclosed event loop")
        gc.collect()
    assert [ref() for ref in held] == [None, None, None]


async def test_a_drain_waiting_as_another_threads_emit_is_dropped_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counted in the drain's target, the emit found the service closed and dropped the
    observation without waking the drain: it waited for ever."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    service.emit_observation("u1", tool_ok("warmup"))
    await service.drain()
    entered, release = threading.Event(), threading.Event()
    sizing = writer_module._approximate_bytes

    def paused(obs: Any) -> int:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(5)
        return sizing(obs)

    monkeypatch.setattr(writer_module, "_approximate_bytes", paused)
    thread = threading.Thread(target=lambda: service.emit_observation("u1", tool_ok("t")))
    thread.start()
    await asyncio.to_thread(entered.wait, 5)
    draining = asyncio.ensure_future(service.drain())
    await asyncio.wait([draining], timeout=0.02)
    await service.close(timeout=0.05)
    release.set()
    await asyncio.to_thread(thread.join)
    async with asyncio.timeout(5):
        await draining
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (2, 1, 1, 0)


async def test_close_drains_and_later_emits_are_dropped() -> None:
    service = MemoryService.from_url("memory://", clock=FakeClock())
    for i in range(10):
        service.emit_observation("u1", tool_ok(f"t{i}"))
    await service.close()
    assert service.stats().stored == 10
    service.emit_observation("u1", tool_ok("late"))
    assert (service.stats().dropped, service.stats().pending) == (1, 0)


async def test_close_gives_up_after_its_timeout_and_counts_what_it_lost(
    gated: tuple[MemoryService, GatedStore], caplog: pytest.LogCaptureFixture
) -> None:
    service, store = gated
    store.failing = True
    for i in range(5):
        service.emit_observation("u1", tool_ok(f"t{i}"))
    with caplog.at_level(logging.WARNING, "coda_memory"):
        await service.close(timeout=0.2)
    stats = service.stats()
    assert (stats.stored, stats.dropped, stats.pending) == (0, 5, 0)
    # What it waited for when it gave up (it said "0 pending" while consolidations ran).
    assert "close timed out with 5 observation(s) pending and 0 consolidation(s) running" in (
        caplog.text
    )


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="unsupported memory URL scheme"):
        MemoryService.from_url("mongodb://localhost")
    with pytest.raises(ValueError, match="load_timeout"):
        MemoryService.from_url("memory://", load_timeout=0)


@pytest.mark.parametrize(
    ("options", "error", "says"),
    [
        # Each failed later with "'>' not supported between 'int' and 'timedelta'".
        ({"retention": 7}, TypeError, "retention must be a timedelta, e.g. timedelta(days=7)"),
        ({"max_clock_skew": 300.0}, TypeError, "max_clock_skew must be a timedelta"),
        ({"load_timeout": timedelta(seconds=1)}, TypeError, "load_timeout must be a number"),
        # Taken as a set of characters: every tool observation was rejected.
        ({"tool_catalog": "get_account"}, TypeError, "tool_catalog must be a collection"),
        ({"prompt_budget_tokens": -5}, ValueError, "prompt_budget_tokens must not be negative"),
        # NaN passed "<= 0": loads then timed out at once, now and then.
        ({"load_timeout": float("nan")}, ValueError, "load_timeout must be a positive, finite"),
        # An int past the floats: accepted, then every load failed (OverflowError).
        ({"load_timeout": 10**400}, ValueError, "load_timeout must be a positive, finite"),
        ({"queue_size": "1000"}, TypeError, "queue_size must be a whole number, not str"),
        ({"max_facts": 10.0}, TypeError, "max_facts must be a whole number, not float"),
        # "false" from an environment variable logged every identity in the clear.
        ({"log_identities": "false"}, TypeError, "log_identities must be True or False"),
        ({"hold_gc": 1}, TypeError, "hold_gc must be True or False, not int"),
        # Each made every load empty (and every observation rejected, for the clock).
        ({"clock": "now"}, TypeError, "clock must be a function (or None), not str"),
        # A naive clock: every observation rejected ("created_at is not timezone-aware"),
        # every load of an identity with facts empty, and facts() raised a TypeError.
        ({"clock": lambda: datetime(2026, 1, 1)}, ValueError, "clock must return a timezone-aware"),
        ({"clock": lambda: "2026-01-01"}, TypeError, "clock must return a datetime, not str"),
        ({"token_counter": 5}, TypeError, "token_counter must be a function"),
        ({"decay": "exponential"}, TypeError, "decay must be a decay strategy"),
        ({"tool_catalog": 3}, TypeError, "tool_catalog must be a collection of tool names"),
        # Accepted, then every tool observation was rejected as not in the catalogue.
        ({"tool_catalog": [1]}, TypeError, "tool_catalog holds a int, not a tool name"),
    ],
)
def test_options_of_the_wrong_kind_are_refused_by_name(
    options: dict[str, Any], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=re.escape(says)):
        MemoryService.from_url("memory://", **options)


@pytest.mark.parametrize(
    "option", ["statement_timeout", "lock_timeout", "writer_lock_timeout", "table_lock_timeout"]
)
def test_a_postgres_timeout_given_in_seconds_is_refused_by_name(option: str) -> None:
    options: dict[str, Any] = {option: 1.0}
    with pytest.raises(TypeError, match=f"{option} must be a timedelta"):
        MemoryService.from_url("postgresql://u@127.0.0.1:1/x", **options)


@pytest.mark.parametrize(
    ("option", "value", "error", "says"),
    [
        # Seconds where the others take timedeltas: each failed inside every connection
        # attempt, so every load came back empty and every observation was rejected.
        ("connect_timeout", timedelta(seconds=5), TypeError, "connect_timeout must be a number"),
        ("connect_timeout", "10", TypeError, "connect_timeout must be a number of seconds"),
        ("connect_timeout", None, TypeError, "connect_timeout must be a number of seconds"),
        ("command_timeout", timedelta(seconds=5), TypeError, "command_timeout must be a number"),
        ("admin_command_timeout", "60", TypeError, "admin_command_timeout must be a number"),
        ("command_timeout", float("nan"), ValueError, "command_timeout must be a finite number"),
        ("pool_size", "8", TypeError, "pool_size must be a whole number, not str"),
        ("known_facts", 1.5, TypeError, "known_facts must be a whole number, not float"),
    ],
)
def test_a_postgres_option_of_the_wrong_kind_is_refused_by_name(
    option: str, value: object, error: type[Exception], says: str
) -> None:
    options: dict[str, Any] = {option: value}
    with pytest.raises(error, match=re.escape(says)):
        MemoryService.from_url("postgresql://u@127.0.0.1:1/x", **options)


def test_a_url_that_is_not_a_string_is_refused() -> None:
    # An unset environment variable: "'NoneType' object has no attribute 'split'".
    with pytest.raises(TypeError, match="the memory URL must be a str, not NoneType"):
        MemoryService.from_url(None)  # type: ignore[arg-type]


async def test_a_timeout_past_the_floats_is_refused_by_name() -> None:
    """An int too large for a float passed the check (it is below infinity), then
    failed converting: an OverflowError rather than the ValueError of an infinite one."""
    service = MemoryService(InMemoryStore(), clock=FakeClock())
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds"):
        await service.drain(timeout=10**400)
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds"):
        await service.close(timeout=10**400)
    await service.close()


async def test_a_timeout_of_the_wrong_kind_loses_nothing_queued() -> None:
    """close(timeout="10") (read from the environment) marked the service closed, then
    failed in its drain and dropped the whole queue."""
    service = MemoryService(InMemoryStore(), clock=FakeClock())
    for i in range(5):
        service.emit_observation("u1", tool_ok(f"t{i}"))
    with pytest.raises(TypeError, match="timeout must be a number of seconds"):
        await service.drain(timeout="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout must be a number of seconds"):
        await service.close(timeout="10")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be a finite number"):
        await service.close(timeout=float("nan"))
    await service.close(timeout=10)
    assert (service.stats().stored, service.stats().dropped) == (5, 0)


async def test_a_closed_service_cannot_be_entered_again() -> None:
    """A module-level service entered by a second lifespan ran with memory off, saying
    so only in warnings."""
    service = MemoryService(InMemoryStore(), clock=FakeClock())
    async with service:
        pass
    with pytest.raises(ServiceClosed, match="the memory service is closed"):
        async with service:
            pass


async def test_history_refuses_a_subject_that_is_not_text() -> None:
    service = MemoryService(InMemoryStore(), clock=FakeClock())
    try:
        with pytest.raises(TypeError, match="subject must be a str"):
            await service.history("u1", subject=5)  # type: ignore[arg-type]
    finally:
        await service.close()


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ("lock_timeout", "lock_timeout must be a timedelta (or None), not float"),
        ("lock_ttl", "lock_ttl must be a timedelta, not float"),
        ("session_horizon", "session_horizon must be a timedelta, not float"),
    ],
)
def test_a_redis_duration_given_in_seconds_is_refused_by_name(option: str, says: str) -> None:
    pytest.importorskip("redis")
    options: dict[str, Any] = {option: 5.0}
    with pytest.raises(TypeError, match=re.escape(says)):
        MemoryService.from_url("redis://127.0.0.1:1/0", **options)


@pytest.mark.parametrize("limit", [-1, 2**31, sys.maxsize])
def test_a_redis_history_limit_outside_0_to_2_31_is_refused(limit: int) -> None:
    """``sys.maxsize`` for "unbounded" (0 is): the commit's LTRIM got it as a double,
    which Redis refused after the facts were written, so every later consolidation
    applied the same observations to the facts again."""
    pytest.importorskip("redis")
    with pytest.raises(ValueError, match=r"history_limit must be 0 \(unbounded\) to 2,147,483,647"):
        MemoryService.from_url("redis://127.0.0.1:1/0", history_limit=limit)
    MemoryService.from_url("redis://127.0.0.1:1/0", history_limit=2**31 - 1)


@pytest.mark.parametrize("horizon", [timedelta(0), timedelta(seconds=-1), timedelta(days=36_501)])
def test_a_redis_session_horizon_that_is_not_positive_or_past_a_century_is_refused(
    horizon: timedelta,
) -> None:
    """Not positive, every consolidation pruned every session's record, so a session
    reinforced a fact again at each run; a million days made every commit fail (its now
    less the horizon is before year 1)."""
    pytest.importorskip("redis")
    with pytest.raises(ValueError, match="session_horizon must be positive, at most 36,500"):
        MemoryService.from_url("redis://127.0.0.1:1/0", session_horizon=horizon)
    MemoryService.from_url("redis://127.0.0.1:1/0", session_horizon=timedelta(days=36_500))


@pytest.mark.parametrize(
    ("option", "value"),
    [
        # Each made every peek, consolidation or write fail (a bigint read limit, a
        # date past year 9999, a date before year 1).
        ("max_facts", 2**62),
        ("max_clock_skew", timedelta(days=999_999_999)),
        ("retention", timedelta(days=999_999)),
        ("retention", timedelta(seconds=-1)),
    ],
)
def test_options_past_what_the_service_can_use_are_refused(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option):
        options: dict[str, Any] = {option: value}
        MemoryService.from_url("memory://", **options)
    # The largest accepted are accepted.
    MemoryService.from_url("memory://", max_facts=2**31 - 1, retention=timedelta(days=36_500))


@pytest.mark.parametrize(
    "now", [datetime(1, 1, 3, tzinfo=UTC), datetime(9999, 12, 31, 23, tzinfo=UTC)]
)
async def test_a_clock_at_the_edge_of_the_dates_still_consolidates(now: datetime) -> None:
    """A clock within ``retention`` of year 1 (one a test sets there) made the prune
    bound, now less the retention, leave the range of dates: every consolidation failed
    with OverflowError, every load came back empty and counted in ``load_errors``."""
    service = MemoryService.from_url("memory://", clock=lambda: now, load_timeout=5.0)
    try:
        service.emit_observation("u1", entity("account", "42", "Acme", "s1"))
        await service.drain()
        memory = await service.load_memory("u1")
        assert [f.subject for f in await service.consolidate("u1")] == [
            "entity_frequency:account:42"
        ]
    finally:
        await service.close()
    assert [f.subject for f in memory.facts] == ["entity_frequency:account:42"]
    assert service.stats().load_errors == 0


@pytest.mark.parametrize("call", ["consolidate", "facts", "history", "forget"])
@pytest.mark.parametrize(
    ("identity", "error", "says"),
    [
        (42, TypeError, "identity_id must be a str, not int"),
        (None, TypeError, "identity_id must be a str, not NoneType"),
        (b"alice", TypeError, "identity_id must be a str, not bytes"),
        ("", ValueError, "identity_id is empty"),
        ("al\x00ice", ValueError, "identity_id contains NUL"),
        ("secret-person-" * 40, ValueError, "identity_id is longer than 256 characters"),
    ],
)
async def test_an_identity_the_store_cannot_take_is_a_clear_error(
    call: str, identity: object, error: type[Exception], says: str
) -> None:
    """They failed in the driver (a DBAPIError quoting the identity among the statement's
    parameters, or a NotNullViolationError), or quietly returned [] for None."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    with pytest.raises(error, match=says) as raised:
        await getattr(service, call)(identity)
    assert "secret-person" not in str(raised.value)
    await service.close()


async def test_forget_with_the_store_unreachable_raises_instead_of_waiting_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """forget waits for the observations on their way to the store (some may be the
    identity's): with the store unreachable, the writer retries forever, and so did
    forget, while consolidate, facts and history raise at once."""
    monkeypatch.setattr(service_module, "FORGET_WAIT", 0.05)
    store = GatedStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=5)
    try:
        service.emit_observation("bob", tool_ok("get_account"))
        await service.drain()
        store.failing = True
        calls = store.append_calls
        service.emit_observation("bob", tool_ok("run_sql"))

        async def taken() -> None:  # the writer took it, and its append failed
            while store.append_calls == calls:
                await asyncio.sleep(0)

        await asyncio.wait_for(taken(), 5)
        with pytest.raises(TimeoutError, match="nothing stored was erased, run it again"):
            await asyncio.wait_for(service.forget("bob"), 5)
        assert len(await store.observations("bob")) == 1
        store.failing = False
        monkeypatch.setattr(service_module, "FORGET_WAIT", 5.0)  # the writer's back-off
        forgotten = await asyncio.wait_for(service.forget("bob"), 5)
        assert forgotten.observations == 2
        assert await store.observations("bob") == []
    finally:
        store.failing = False
        await service.close()


async def test_forget_does_not_wait_for_other_identities_consolidations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """forget waited for every background consolidation (a drain): one slow
    consolidation of another identity made it time out with the store healthy."""
    monkeypatch.setattr(service_module, "FORGET_WAIT", 2.0)
    store = GatedStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=0.05)
    try:
        for who in ("ana", "bob"):
            service.emit_observation(who, tool_ok("get_account"))
        await service.drain()
        store.consolidation_gate.clear()  # ana's consolidation hangs
        await service.load_memory("ana")  # answers after its timeout; goes on behind
        assert service._background
        forgotten = await asyncio.wait_for(service.forget("bob"), 5)
        assert forgotten.observations == 1
        assert service._background  # ana's is still under way
    finally:
        store.consolidation_gate.set()
        await service.close()


async def test_a_str_enum_identity_is_stored_and_read_under_its_value() -> None:
    """The writer stored it under str(member), "Tenant.ANA", and loads read "ana"."""

    class Tenant(str, Enum):  # noqa: UP042 (its str() is "Tenant.ANA", not a StrEnum's)
        ANA = "ana"

    service = MemoryService.from_url("memory://", clock=FakeClock())
    service.emit_observation(Tenant.ANA, tool_ok("get_account", "s1"))
    await service.drain()
    assert set((await service.load_memory(Tenant.ANA)).tool_affinities) == {"get_account"}
    assert [f.subject for f in await service.facts("ana")] == ["tool_affinity:get_account"]
    assert await service.facts("Tenant.ANA") == []
    await service.close()


async def test_a_host_passing_a_non_string_identity_gets_a_rejection_not_a_crash() -> None:
    service = MemoryService.from_url("memory://", clock=FakeClock())
    service.emit_observation(42, tool_ok("t"))  # type: ignore[arg-type]
    service.emit_observation("u1", tool_ok("t"))
    await service.drain()
    stats = service.stats()
    assert (stats.stored, stats.rejected, stats.pending) == (1, 1, 0)
    memory = await service.load_memory(None)  # type: ignore[arg-type]
    assert memory.prompt_section == ""
    await service.close()


async def test_validating_a_large_batch_lets_the_event_loop_run_between_chunks() -> None:
    """A batch that piled up is validated in chunks of VALIDATE_CHUNK, with a turn of the
    loop between them: other tasks run before the batch reaches the store."""
    from coda_memory.writer import VALIDATE_CHUNK

    turns_before_append: list[int] = []
    turns = 0

    class CountingStore(InMemoryStore):
        async def append(
            self,
            records: Sequence[ObservationRecord],
            *,
            batch_key: str | None = None,
            first_attempt: bool = False,
        ) -> AppendOutcome:
            turns_before_append.append(turns)
            return await super().append(records, batch_key=batch_key, first_attempt=first_attempt)

    service = MemoryService(CountingStore(), batch_size=10 * VALIDATE_CHUNK)
    for n in range(10 * VALIDATE_CHUNK):
        service.emit_observation("alice", tool_ok(f"tool_{n % 7}"))

    async def other_task() -> None:
        nonlocal turns
        while not turns_before_append:
            turns += 1
            await asyncio.sleep(0)

    await asyncio.gather(service.drain(), other_task())
    assert service.stats().stored == 10 * VALIDATE_CHUNK
    # One batch, validated in ten chunks: the other task ran at least once per chunk.
    assert len(turns_before_append) == 1
    assert turns_before_append[0] >= 9
    await service.close()


class OverlapStore(GatedStore):
    """Records the size of each append and how many were in flight at once."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def append(
        self,
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        self.sizes.append(len(records))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await super().append(records, batch_key=batch_key, first_attempt=first_attempt)
        finally:
            self.in_flight -= 1

    def release(self) -> None:
        """Let every append through."""
        self.gate.set()


@asynccontextmanager
async def _writing(store: OverlapStore, **options: Any) -> AsyncIterator[MemoryService]:
    """A service storing into ``store`` in batches of 10, closed with the store released
    however the test ends."""
    service = MemoryService(store, clock=FakeClock(), batch_size=10, **options)
    try:
        yield service
    finally:
        store.release()
        await service.close()


async def _until(condition: Any) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0)


async def test_a_consolidating_load_gives_the_loop_a_turn_between_its_steps() -> None:
    """Reading the batch, planning, writing and making the answer run in turns of their
    own, so concurrent loads do not add their Python up into one long stall of the loop:
    another task runs between each step and the next, even when the store never waits."""
    steps: list[tuple[str, int]] = []
    turns = 0

    class RecordingStore(InMemoryStore):
        @asynccontextmanager
        async def consolidation(self, identity_id: str) -> AsyncIterator[InMemoryConsolidationUnit]:
            async with super().consolidation(identity_id) as unit:
                load, write = unit.load, unit.write

                async def recorded_load() -> Any:
                    batch = await load()
                    steps.append(("loaded", turns))
                    return batch

                async def recorded_write(plan: Any) -> None:
                    steps.append(("write", turns))
                    await write(plan)

                unit.load = recorded_load  # type: ignore[method-assign]
                unit.write = recorded_write  # type: ignore[method-assign]
                yield unit

    service = MemoryService(RecordingStore(), clock=FakeClock(), load_timeout=5.0)
    plan, answer = service._planning, service._answer_steps

    def recorded_plan(*args: Any) -> Any:
        steps.append(("plan", turns))
        return (yield from plan(*args))

    def recorded_answer(*args: Any) -> Any:
        steps.append(("answer", turns))
        return (yield from answer(*args))

    service._planning = recorded_plan  # type: ignore[method-assign,assignment]
    service._answer_steps = recorded_answer  # type: ignore[method-assign,assignment]
    service.emit_observation("alice", tool_ok("search"))
    await service.drain()

    async def other_task() -> None:
        nonlocal turns
        while not any(step == "answer" for step, _ in steps):
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.ensure_future(other_task())
    loaded = await service.load_memory("alice")
    await other
    assert loaded.tool_affinities == {"search": pytest.approx(loaded.facts[0].confidence)}
    names = [step for step, _ in steps]
    assert names == ["loaded", "plan", "write", "answer"]
    at = [turn for _, turn in steps]
    assert all(later > earlier for earlier, later in itertools.pairwise(at)), steps
    await service.close()


async def test_one_load_at_a_time_runs_its_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent loads take turns for their steps: each runs its plan, or its answer, to
    the end before another's steps run, so a turn of the loop runs one load's step, not a
    step of every load in flight."""
    monkeypatch.setattr(consolidation, "SLICE", 10)
    monkeypatch.setattr(prompt, "SLICE", 10)
    service = MemoryService(InMemoryStore(), clock=FakeClock(), load_timeout=5.0)
    identities = ["alice", "bob", "carol"]
    for identity in identities:
        for n in range(30):
            service.emit_observation(identity, tool_ok(f"tool_{n:02}", "s1"))
    await service.drain()
    for identity in identities:
        await service.consolidate(identity)
        service.emit_observation(identity, tool_ok("tool_30", "s2"))
    await service.drain()
    ran: list[tuple[str, str]] = []
    plan, answer = service._planning, service._answer_steps

    def recorded(tag: tuple[str, str], steps: Any) -> Any:
        while True:
            ran.append(tag)  # a step of this load's plan or answer runs
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            yield

    service._planning = lambda identity, batch: recorded(  # type: ignore[method-assign,assignment]
        ("plan", identity), plan(identity, batch)
    )
    service._answer_steps = lambda facts: recorded(  # type: ignore[method-assign]
        ("answer", facts[0].identity_id), answer(facts)
    )
    loaded = await asyncio.gather(*(service.load_memory(i) for i in identities))
    assert [len(memory.facts) for memory in loaded] == [31, 31, 31]
    # Every plan and answer ran in several steps, none of them between another's.
    runs = [tag for n, tag in enumerate(ran) if n == 0 or ran[n - 1] != tag]
    assert sorted(runs) == sorted({*runs}) and len(runs) == 6
    assert all(ran.count(tag) >= 4 for tag in runs)
    await service.close()


async def test_the_plan_and_the_answer_of_a_load_run_in_steps_with_turns_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load of many facts plans them and makes its answer in steps of at most SLICE
    facts, another task running between two: under concurrent loads, a turn of the loop
    then lasts one small step of each, not a whole plan of each."""
    monkeypatch.setattr(consolidation, "SLICE", 10)
    monkeypatch.setattr(prompt, "SLICE", 10)
    service = MemoryService(InMemoryStore(), clock=FakeClock(), load_timeout=5.0)
    for n in range(30):
        service.emit_observation("alice", tool_ok(f"tool_{n:02}", "s1"))
    await service.drain()
    await service.consolidate("alice")
    service.emit_observation("alice", tool_ok("tool_30", "s2"))
    await service.drain()
    turns_seen = 0
    inside: dict[str, list[int]] = {}
    plan, answer = service._planning, service._answer_steps

    def counted(name: str, steps: Any) -> Any:
        start = turns_seen
        result = yield from steps
        inside[name] = [start, turns_seen]
        return result

    service._planning = lambda *a: counted("plan", plan(*a))  # type: ignore[method-assign]
    service._answer_steps = lambda *a: counted("answer", answer(*a))  # type: ignore[method-assign]

    async def other_task() -> None:
        nonlocal turns_seen
        while "answer" not in inside:
            turns_seen += 1
            await asyncio.sleep(0)

    other = asyncio.ensure_future(other_task())
    loaded = await service.load_memory("alice")
    await other
    assert len(loaded.facts) == 31
    # The plan: a step for the folding, then one per ten facts decayed (31 of them).
    start, end = inside["plan"]
    assert end - start >= 1 + 3
    start, end = inside["answer"]  # ranking, then the prompt section ten facts a step
    assert end - start >= 1 + 3
    await service.close()


async def test_a_backlog_of_full_batches_is_stored_two_appends_at_a_time() -> None:
    store = OverlapStore()
    async with _writing(store) as service:
        store.gate.clear()
        for n in range(35):
            service.emit_observation("u1", tool_ok("get_account", f"s{n}"))
        await _until(lambda: store.append_calls == 2)
        for _ in range(100):  # the writer gets every chance to start a third
            await asyncio.sleep(0)
        assert store.append_calls == 2 and store.in_flight == 2
        store.gate.set()
        await service.drain()
        assert store.sizes == [10, 10, 10, 5]
        assert store.most_in_flight == 2
        assert service.stats().stored == 35


async def test_without_a_backlog_one_append_at_a_time_and_what_arrives_meanwhile_waits() -> None:
    store = OverlapStore()
    async with _writing(store) as service:
        store.gate.clear()
        for n in range(3):
            service.emit_observation("u1", tool_ok("get_account", f"s{n}"))
        await _until(lambda: store.append_calls == 1)
        for n in range(5):
            service.emit_observation("u1", tool_ok("get_account", f"t{n}"))
        for _ in range(100):
            await asyncio.sleep(0)
        assert store.append_calls == 1
        store.gate.set()
        await service.drain()
        assert store.sizes == [3, 5]
        assert store.most_in_flight == 1


class BusyStore(OverlapStore):
    """Refuses every append with StoreBusy (a lock) while ``busy``; records the sizes of
    the appends that went through."""

    def __init__(self) -> None:
        super().__init__()
        self.busy = True
        self.stored_sizes: list[int] = []
        #: The batches it was given (one key each, whatever the attempts).
        self.batch_keys: set[str | None] = set()

    async def append(
        self,
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        self.batch_keys.add(batch_key)
        if self.busy:
            await asyncio.sleep(0)
            raise StoreBusy("a table is locked")
        outcome = await super().append(records, batch_key=batch_key, first_attempt=first_attempt)
        self.stored_sizes.append(len(records))
        return outcome

    def release(self) -> None:
        super().release()
        self.busy = False


def _counting_validations(service: MemoryService) -> list[int]:
    """The sizes of the batches the writer validates, in order."""
    validated: list[int] = []
    validate = service._validate

    async def counted(items: list[Any]) -> tuple[list[Any], list[ObservationRecord]]:
        kept, records = await validate(items)
        validated.append(len(records))
        return kept, records

    service._validate = counted  # type: ignore[method-assign]
    return validated


async def _two_appends_then(service: MemoryService, appends: Callable[[], int], more: int) -> None:
    """3 observations, which the first append takes, then 10, which the second takes,
    then ``more``; ``appends`` counts the appends started."""
    for count, started in ((3, 1), (10, 2)):
        for n in range(count):
            service.emit_observation("u1", tool_ok("get_account", f"s{count}-{n}"))
        await _until(lambda: appends() == started)  # noqa: B023
    for n in range(more):
        service.emit_observation("u1", tool_ok("get_account", f"t{n}"))


async def test_a_batch_that_fills_while_the_first_append_waits_starts_a_second() -> None:
    store = OverlapStore()
    async with _writing(store) as service:
        store.gate.clear()
        # The second append starts while the first waits: this waits for it.
        await _two_appends_then(service, lambda: store.append_calls, 0)
        assert store.in_flight == 2
        store.gate.set()
        await service.drain()
        assert store.sizes == [3, 10]


async def test_while_appends_are_merely_slow_no_batch_is_validated_ahead() -> None:
    store = OverlapStore()
    async with _writing(store) as service:
        validated = _counting_validations(service)
        store.gate.clear()
        await _two_appends_then(service, lambda: store.append_calls, 10 * (MAX_AHEAD + 1))
        for _ in range(100):  # the writer gets every chance to validate ahead
            await asyncio.sleep(0)
        assert validated == [3, 10]
        store.gate.set()
        await service.drain()
        assert store.sizes == [3] + [10] * (MAX_AHEAD + 2)


async def test_while_an_append_waits_to_be_retried_full_batches_are_validated_ahead() -> None:
    store = BusyStore()
    async with _writing(store) as service:
        validated = _counting_validations(service)
        # A backlog from the start: two appends take a batch each, and the rest waits
        # until an append is refused and waits to be retried.
        for n in range(10 * (2 + MAX_AHEAD + 1) + 3):
            service.emit_observation("u1", tool_ok("get_account", f"s{n}"))
        await _until(lambda: len(validated) == 2 + MAX_AHEAD)
        for _ in range(100):  # the writer gets every chance to validate one more
            await asyncio.sleep(0)
        # MAX_AHEAD full batches are validated behind the two appends; the rest (a full
        # batch and 3) stays queued.
        assert validated == [10] * (2 + MAX_AHEAD)
        assert len(store.batch_keys) == 2
        assert service._ahead == 10 * MAX_AHEAD
        assert service.stats().pending == 10 * (2 + MAX_AHEAD + 1) + 3
        store.busy = False
        await service.drain()
        assert store.stored_sizes == [10] * (2 + MAX_AHEAD + 1) + [3]
        assert validated == [10] * (2 + MAX_AHEAD + 1) + [3]  # each batch validated once
        assert service.stats().stored == 10 * (2 + MAX_AHEAD + 1) + 3
        assert service._retrying == 0


async def test_a_writer_cancelled_while_appends_retry_keeps_what_it_validated_ahead() -> None:
    """A host that cancels the writer (cancelling every task before close()) lost the
    batches validated ahead, counted as dropped, and the appends' batches too; close()
    now stores them all, each once."""
    store = BusyStore()
    async with _writing(store) as service:
        validated = _counting_validations(service)
        total = 10 * (2 + MAX_AHEAD + 1) + 3
        for n in range(total):
            service.emit_observation("u1", tool_ok("get_account", f"s{n}"))
        await _until(lambda: len(validated) == 2 + MAX_AHEAD)
        assert service._ahead == 10 * MAX_AHEAD
        writer = service._writer
        assert writer is not None
        writer.cancel()
        await asyncio.wait([writer])
        assert service.stats().pending == total  # kept, none dropped
        store.busy = False
        await service.drain()
        assert sorted(store.stored_sizes) == sorted([10] * (2 + MAX_AHEAD + 1) + [3])
        stats = service.stats()
        assert (stats.stored, stats.dropped, stats.pending) == (total, 0, 0)


async def test_a_writer_cancelled_while_it_validates_puts_the_batch_back_in_order() -> None:
    """Taken off the queue and cut short between two chunks of its validation, the
    batch was in no append: counted as dropped, or (kept in flight) never settled."""
    service = MemoryService.from_url("memory://", clock=FakeClock(), batch_size=200)
    for n in range(200):
        service.emit_observation("u1", tool_ok(f"t{n}"))
    validating = asyncio.Event()
    validate = service._validate

    async def noted(items: Any) -> Any:
        validating.set()
        return await validate(items)

    service._validate = noted  # type: ignore[method-assign]
    await validating.wait()
    await asyncio.sleep(0)  # the writer validates its first chunk, and yields
    writer = service._writer
    assert writer is not None and not writer.done()
    writer.cancel()
    await asyncio.wait([writer])
    assert [item[2] for item in service._queue] == [f"t{n} ok" for n in range(200)]
    assert (service.stats().pending, service.stats().dropped) == (200, 0)
    await service.drain()
    assert (service.stats().stored, service.stats().pending) == (200, 0)
    await service.close()


async def test_batches_validated_ahead_count_against_the_queue_size() -> None:
    store = BusyStore()
    async with _writing(store, queue_size=25) as service:
        await _two_appends_then(service, lambda: len(store.batch_keys), 10)
        await _until(lambda: service._ahead == 10)  # validated ahead, off the queue
        for n in range(16):  # 15 more fill the queue's 25 with the 10 ahead
            service.emit_observation("u1", tool_ok("get_account", f"u{n}"))
        assert service.stats().dropped == 1
        store.busy = False
        await service.drain()
        assert service.stats().stored == 23 + 15


class CollectorWatchingStore(InMemoryStore):
    """Notes whether the cyclic collector is on while the service uses the store."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled_during: list[bool] = []

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        self.enabled_during.append(gc.isenabled())
        return await super().peek(identity_id)

    async def append(
        self,
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        self.enabled_during.append(gc.isenabled())
        return await super().append(records, batch_key=batch_key, first_attempt=first_attempt)


@pytest.mark.parametrize("hold_gc", [True, False])
async def test_loads_appends_and_consolidations_hold_the_collector_off_unless_told_not_to(
    hold_gc: bool,
) -> None:
    store = CollectorWatchingStore()
    service = MemoryService(store, hold_gc=hold_gc)
    service.emit_observation("u1", tool_ok("get_account"))
    await service.drain()
    await service.load_memory("u1")
    # A consolidation asked for by the host is held too: a backlog's, run with the
    # collector on, set off full collections of 80 to 450 ms as its objects piled up.
    await service.consolidate("u2")
    await service.close()
    assert store.enabled_during == [not hold_gc] * 3
    assert gc.isenabled()


class KeepingStore(GatedStore):
    """A gated store that keeps each identity's facts between requests, as the Postgres
    store does."""

    async def kept_facts(self, identity_id: str) -> list[Fact]:
        # New models each call, as the Postgres store's: the service may change them.
        return [fact.model_copy() for fact in await InMemoryStore.facts(self, identity_id)]


@contextmanager
def collector_keeping_cycles() -> Iterator[None]:
    """The collector off, after a collection, and what a collection finds kept in
    ``gc.garbage`` rather than freed (see :func:`left_in_cycles`); all as it was after."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def left_in_cycles(kind: type) -> list[object]:
    """The objects of ``kind`` a collection finds in reference cycles, under
    :func:`collector_keeping_cycles`."""
    gc.collect()
    return [o for o in gc.garbage if isinstance(o, kind)]


async def test_a_load_whose_consolidation_fails_answers_from_the_facts_at_hand(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = KeepingStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=0.05)
    try:
        service.emit_observation("u1", tool_ok("old"))
        await service.drain()
        await service.consolidate("u1")
        store.failing = True
        with caplog.at_level(logging.WARNING, "coda_memory"):
            memory = await service.load_memory("u1")
            assert [f.subject for f in memory.facts] == ["tool_affinity:old"]
            assert "Uses old successfully" in memory.prompt_section
            # Nothing at hand: empty.
            assert (await service.load_memory("u2")).facts == []
        stats = service.stats()
        assert (stats.load_errors, stats.load_stale, stats.load_timeouts) == (2, 1, 0)
        # One line per cause a second: the failure is logged once.
        assert "failed (ConnectionError: database unavailable)" in caplog.text
    finally:
        store.failing = False
        await service.close()


async def test_a_failed_load_leaves_no_reference_cycle_for_the_collector() -> None:
    store = KeepingStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=5.0)
    try:
        for identity in ("u1", "u2"):
            service.emit_observation(identity, tool_ok("old"))
        await service.drain()
        await service.consolidate("u1")
        store.failing = True
        with collector_keeping_cycles():
            for _ in range(10):
                assert (await service.load_memory("u1")).facts  # stale, from the kept facts
                assert (await service.load_memory("u2")).facts == []  # nothing at hand
            await service.drain()
            assert service.stats().load_errors == 20
            # Each failed load's error, traceback and frames were freed as soon as they
            # were done with, not left in a cycle for a (full) collection to find.
            assert left_in_cycles(ConnectionError) == []
    finally:
        store.failing = False
        await service.close()


class BrokenKeepingStore(KeepingStore):
    async def kept_facts(self, identity_id: str) -> list[Fact]:
        raise RuntimeError("the kept facts are unreadable")


async def test_a_failing_load_whose_kept_facts_fail_too_still_returns_empty() -> None:
    store = BrokenKeepingStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=0.05)
    try:
        service.emit_observation("u1", tool_ok("old"))
        await service.drain()
        await service.consolidate("u1")
        store.failing = True
        assert (await service.load_memory("u1")).facts == []
        assert (service.stats().load_errors, service.stats().load_stale) == (1, 0)
    finally:
        store.failing = False
        await service.close()


class TimingOutStore(KeepingStore):
    """An in-memory store whose consolidation raises a TimeoutError of its own at once,
    while ``timing_out`` is set (a lock held past the store's lock timeout, a driver's
    command timeout)."""

    timing_out = False

    @asynccontextmanager
    async def consolidation(self, identity_id: str) -> AsyncIterator[InMemoryConsolidationUnit]:
        if self.timing_out:
            raise TimeoutError("lock held past lock_timeout")
        async with InMemoryStore.consolidation(self, identity_id) as unit:
            yield unit


@pytest.mark.parametrize("at_hand", [False, True])
async def test_a_store_timeout_is_a_load_error_not_the_loads_timeout(
    at_hand: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The store's TimeoutError, raised at once, was read as the load's own timeout:
    counted in load_timeouts (not load_errors), and logged as a load that took over
    load_timeout. It is an error, answered from the facts at hand when there are some."""
    store = TimingOutStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=5.0)
    try:
        if at_hand:
            service.emit_observation("u1", tool_ok("old"))
            await service.drain()
            await service.consolidate("u1")
        store.timing_out = True
        service.emit_observation("u1", tool_ok("new"))
        await service.drain()
        with caplog.at_level(logging.WARNING, "coda_memory"):
            memory = await asyncio.wait_for(service.load_memory("u1"), 1.0)
    finally:
        await service.close()
    stats = service.stats()
    assert (stats.load_errors, stats.load_timeouts, stats.load_stale) == (1, 0, int(at_hand))
    assert "failed (TimeoutError: lock held past lock_timeout)" in caplog.text
    assert "took over" not in caplog.text and "timed out" not in caplog.text
    assert [f.subject for f in memory.facts] == (["tool_affinity:old"] if at_hand else [])


class FailingConsolidationStore(InMemoryStore):
    """An in-memory store (it keeps no facts between requests, as the Redis store) whose
    consolidation fails at once while ``failing`` is set; its peek goes through."""

    failing = False

    @asynccontextmanager
    async def consolidation(self, identity_id: str) -> AsyncIterator[InMemoryConsolidationUnit]:
        if self.failing:
            raise ConnectionError("database unavailable")
        async with super().consolidation(identity_id) as unit:
            yield unit


async def test_a_load_whose_consolidation_fails_answers_from_the_facts_its_peek_read() -> None:
    """The peek's facts were dropped as the consolidation failed, before the loads that
    waited for it read them: over a store that keeps no facts (Redis, memory://), every
    such load came back empty, though the facts were at hand."""
    store = FailingConsolidationStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=5.0)
    try:
        service.emit_observation("u1", tool_ok("old"))
        await service.drain()
        await service.consolidate("u1")
        store.failing = True
        service.emit_observation("u1", tool_ok("new"))
        await service.drain()
        first, second = await asyncio.gather(service.load_memory("u1"), service.load_memory("u1"))
        assert [f.subject for f in first.facts] == ["tool_affinity:old"]
        assert [f.subject for f in second.facts] == ["tool_affinity:old"]
        assert "Uses old successfully" in first.prompt_section
        stats = service.stats()
        assert (stats.load_errors, stats.load_stale, stats.load_timeouts) == (2, 2, 0)
        assert service._stale == {}  # nothing left behind
        with collector_keeping_cycles():
            for _ in range(5):
                assert (await service.load_memory("u1")).facts
            # The error and the facts that went with it were freed as soon as they were
            # done with, not left in a cycle for a collection to find.
            assert left_in_cycles(ConnectionError) == []
    finally:
        store.failing = False
        await service.close()


class TimedKeepingStore(KeepingStore):
    """A keeping store that notes, on the loop's clock, when its kept facts are read, and
    can open its gate as it reads them (while the gate is shut the peek waits, so a
    late load's answer comes from the kept facts)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept_read_at: list[float] = []
        self.release_on_kept_read = False

    async def kept_facts(self, identity_id: str) -> list[Fact]:
        self.kept_read_at.append(asyncio.get_running_loop().time())
        if self.release_on_kept_read:
            self.gate.set()
        return await super().kept_facts(identity_id)


@pytest.fixture
async def timed() -> AsyncIterator[tuple[MemoryService, TimedKeepingStore]]:
    store = TimedKeepingStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=0.2)
    await _old_consolidated_new_stored(service)
    store.gate.clear()
    yield service, store
    store.gate.set()
    await service.close()


async def test_a_late_load_makes_its_fallback_before_the_timeout_fires(
    timed: tuple[MemoryService, TimedKeepingStore],
) -> None:
    """The answer from the facts at hand is made while the consolidation still runs, so
    the load returns at its timeout instead of the timeout plus the making."""
    service, store = timed
    started = asyncio.get_running_loop().time()
    memory = await service.load_memory("u1")
    assert [f.subject for f in memory.facts] == ["tool_affinity:old"]
    (read_at,) = store.kept_read_at
    assert read_at - started < service.load_timeout * service_module.ANSWER_BY
    assert (service.stats().load_stale, service.stats().load_timeouts) == (1, 0)


async def test_a_late_load_answers_from_facts_its_peek_read_after_the_hedge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing was at hand at the hedge (the identity's facts are not kept, and its peek
    had not returned); the peek read them before the load gave up: the load answers from
    them rather than empty."""
    store = GatedStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=0.2)
    hedged: list[LoadedMemory | None] = []
    stale_answer = service._stale_answer

    async def hedge_then_peek(
        identity_id: str, peeked: list[Fact] | None = None
    ) -> LoadedMemory | None:
        answer = await stale_answer(identity_id, peeked)
        if not hedged:  # the hedge's answer: then the peek returns
            store.gate.set()
        hedged.append(answer)
        return answer

    monkeypatch.setattr(service, "_stale_answer", hedge_then_peek)
    try:
        await _old_consolidated_new_stored(service)
        store.gate.clear()  # the peek waits until the hedge has found nothing at hand
        store.consolidation_gate.clear()  # and then the consolidation
        memory = await service.load_memory("u1")
        assert [f.subject for f in memory.facts] == ["tool_affinity:old"]
        assert hedged[0] is None  # nothing was at hand at the hedge
        assert (service.stats().load_stale, service.stats().load_timeouts) == (1, 0)
    finally:
        store.gate.set()
        store.consolidation_gate.set()
        await service.close()


async def test_a_late_load_stops_waiting_before_its_timeout_to_answer_within_it(
    timed: tuple[MemoryService, TimedKeepingStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It gives up on its consolidation at ANSWER_BY of the timeout, so that the answer
    reaches the caller before the timeout even when the loop is busy."""
    service, _ = timed
    monkeypatch.setattr(service_module, "HEDGE_AT", 0.25)
    monkeypatch.setattr(service_module, "ANSWER_BY", 0.5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    memory = await service.load_memory("u1")
    assert loop.time() - started < service.load_timeout
    assert [f.subject for f in memory.facts] == ["tool_affinity:old"]
    assert service.stats().load_stale == 1


async def test_a_load_whose_consolidation_ends_after_the_hedge_answers_with_it(
    timed: tuple[MemoryService, TimedKeepingStore],
) -> None:
    """The consolidation ends after the fallback was started but within the timeout: the
    load answers with the consolidation's facts, and counts nothing stale."""
    service, store = timed
    store.release_on_kept_read = True
    memory = await service.load_memory("u1")
    assert [f.subject for f in memory.facts] == ["tool_affinity:new", "tool_affinity:old"]
    assert store.kept_read_at  # the fallback was started
    assert (service.stats().load_stale, service.stats().load_timeouts) == (0, 0)


@pytest.fixture
async def counted() -> AsyncIterator[tuple[MemoryService, TimedKeepingStore, list[str]]]:
    """Like ``timed``, with a token counter that records what it counts: every prompt
    section made counts its lines."""
    counted: list[str] = []

    def count(text: str) -> int:
        counted.append(text)
        return len(text) // 4 + 1

    store = TimedKeepingStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=0.1, token_counter=count)
    await _old_consolidated_new_stored(service)
    store.gate.clear()
    yield service, store, counted
    store.gate.set()
    await service.close()


async def test_a_consolidation_no_load_waits_for_any_more_makes_no_answer(
    counted: tuple[MemoryService, TimedKeepingStore, list[str]],
) -> None:
    """The load answered from the facts at hand after its timeout: the consolidation
    still finishes and stores its facts, but makes no prompt section nobody would read
    (on a loop too busy to finish consolidations in time, that work would only delay
    the next loads)."""
    service, store, counts = counted
    memory = await service.load_memory("u1")
    assert [f.subject for f in memory.facts] == ["tool_affinity:old"]
    assert counts  # the stale answer's prompt section
    counts.clear()
    store.gate.set()
    await service.drain()
    assert counts == []
    assert [f.subject for f in await service.facts("u1")] == [
        "tool_affinity:new",
        "tool_affinity:old",
    ]


async def test_a_load_that_joins_a_late_consolidation_gets_its_answer(
    counted: tuple[MemoryService, TimedKeepingStore, list[str]],
) -> None:
    """The first load gave up on the consolidation; a second one that waits for the same
    consolidation still gets its answer, with the newest facts."""
    service, store, _ = counted
    first = await service.load_memory("u1")
    assert [f.subject for f in first.facts] == ["tool_affinity:old"]
    second = asyncio.get_running_loop().create_task(service.load_memory("u1"))
    await _until(lambda: len(service._answering) == 1)  # it waits for the consolidation
    store.gate.set()
    memory = await second
    assert [f.subject for f in memory.facts] == ["tool_affinity:new", "tool_affinity:old"]
    assert "Uses new successfully" in memory.prompt_section
    assert service.stats().load_stale == 1


async def test_no_full_collection_starts_while_a_load_is_past_a_third_of_its_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full collection stalls the loop for tens of milliseconds: one that is due waits
    while a load in flight could be made late by it, and runs once none is."""
    clock = held_collector_clock(monkeypatch)
    held_collector_heap(monkeypatch, noted=(500, 500))  # it grew since the last one
    collected = recorded_collections(monkeypatch)
    store = GatedStore()
    # A timeout a busy machine cannot outrun between the first load's start and the check
    # that it has just started (a third of it: 0.4 s).
    service = MemoryService(store, clock=FakeClock(), load_timeout=1.2)
    # Work without a deadline keeps the collector held throughout (as under steady load).
    with turns.collector_scope():
        try:
            store.gate.clear()  # the first load waits in its peek, its scope open
            first = asyncio.get_running_loop().create_task(service.load_memory("u1"))
            await _until(lambda: store.gate._waiters)
            assert service._may_collect()  # it has just started
            await _until(lambda: not service._may_collect())  # past 0.4 s
            clock[0] += turns.FULL_EVERY
            second = asyncio.get_running_loop().create_task(service.load_memory("u2"))
            await _until(lambda: len(store.gate._waiters) == 2)  # its scope opened
            assert 2 not in collected
            store.gate.set()
            await asyncio.gather(first, second)
            assert service._may_collect()
            await service.load_memory("u3")  # no load past a third: the due one runs
            assert collected.count(2) == 1
        finally:
            store.gate.set()
            await service.close()


async def test_a_test_on_both_loops_runs_on_the_loop_its_name_says(
    request: pytest.FixtureRequest,
) -> None:
    """The ``both_loops`` tests do run on uvloop too (see tests/conftest.py)."""
    name = request.node.name
    assert name.endswith(("[uvloop]", "[asyncio]"))
    assert name.endswith("[uvloop]") == isinstance(asyncio.get_running_loop(), uvloop.Loop)


async def test_close_reports_the_lines_held_back_that_no_later_line_reported(
    gated: tuple[MemoryService, GatedStore], caplog: pytest.LogCaptureFixture
) -> None:
    """A burst of failures, then quiet: the count of the lines held back rode only on the
    next line of the cause, which never came, so the log undercounted the burst."""
    service, store = gated
    store.failing = True
    with caplog.at_level(logging.WARNING, "coda_memory"):
        for _ in range(5):
            await service.load_memory("u1")
        assert service.stats().load_errors == 5
        assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1
        store.failing = False
        await service.close()
    held = [r for r in caplog.records if "were held back" in r.getMessage()]
    assert len(held) == 1
    assert held[0].levelno == logging.WARNING
    assert (
        held[0]
        .getMessage()
        .startswith(
            "coda-memory: 4 more line(s) of cause 'load failed: ConnectionError' were held back"
        )
    )


async def test_a_background_consolidation_that_fails_after_its_loads_gave_up_is_logged(
    gated: tuple[MemoryService, GatedStore], caplog: pytest.LogCaptureFixture
) -> None:
    """The loads waiting for a consolidation report its failure; one that fails after
    they gave up has nobody else to report it."""
    service, store = gated
    await _old_consolidated_new_stored(service)
    store.consolidation_gate.clear()
    with caplog.at_level(logging.WARNING, "coda_memory"):
        await service.load_memory("u1")  # gives up on the held consolidation
        (task,) = service._loading.values()
        caplog.clear()
        store.failing = True
        store.consolidation_gate.set()
        await asyncio.wait([task])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"coda-memory: background consolidation of {identity_label('u1')} failed "
        "(ConnectionError: database unavailable)"
    ]


async def test_a_drain_that_times_out_lets_the_loads_in_flight_finish() -> None:
    """drain() gave up by cancelling what it waited for: the consolidations of the loads
    in flight, which then failed (LoadCancelled) on a service that stayed open."""
    store = GatedStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=5.0)
    try:
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain()
        store.consolidation_gate.clear()
        loading = asyncio.create_task(service.load_memory("alice"))
        await _until(lambda: service._background)  # its consolidation waits at the gate
        with pytest.raises(TimeoutError):
            await service.drain(timeout=0.01)
        store.consolidation_gate.set()
        loaded = await loading

        assert [f.subject for f in loaded.facts] == ["tool_affinity:get_account"]
        assert service.stats().load_errors == 0
    finally:
        await service.close()


class AcknowledgingStore(InMemoryStore):
    """Stores a batch, then waits before answering: a COMMIT done on the server whose
    acknowledgement is still on its way back."""

    def __init__(self) -> None:
        super().__init__()
        self.committed = asyncio.Event()
        self.acknowledge = asyncio.Event()

    async def append(
        self,
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        outcome = await super().append(records, batch_key=batch_key, first_attempt=first_attempt)
        self.committed.set()
        await self.acknowledge.wait()
        return outcome


async def test_a_batch_stored_as_close_stops_the_writer_counts_as_stored() -> None:
    """close() cancelled the append in flight and counted its batch as dropped, although
    its COMMIT had reached the server: stats() disagreed with the table."""
    store = AcknowledgingStore()
    service = MemoryService(store, clock=FakeClock())
    for n in range(10):
        service.emit_observation("alice", tool_ok("get_account", session=f"s{n}"))
    await store.committed.wait()
    writer = service._writer
    assert writer is not None
    closing = asyncio.create_task(service.close(timeout=0.01))
    await _until(writer.cancelling)  # close() stops the writer: then the answer comes
    store.acknowledge.set()
    await closing

    stats = service.stats()
    assert (stats.stored, stats.dropped, stats.pending) == (10, 0, 0)
    assert len(await store.observations("alice")) == 10


class _CappingStore(InMemoryStore):
    """The in-memory store, with a cap applied "on the server" in the first peek (which
    then waits for ``release``), and a second peek that finds nothing to consolidate."""

    def __init__(self) -> None:
        super().__init__()
        self.cap: Any = None
        self.capped, self.release = asyncio.Event(), asyncio.Event()
        self.peeks = 0

    def cap_facts(self, cap: Any) -> None:
        self.cap = cap

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        if self.cap is None:  # (the seeding service's)
            return await super().peek(identity_id)
        self.peeks += 1
        if self.peeks == 1:
            self.cap.applied(identity_id, 7)
            self.capped.set()
            await self.release.wait()
            return await super().peek(identity_id)
        return [], False


async def test_a_cap_the_store_applied_is_counted_once_whatever_runs_meanwhile() -> None:
    """The mark that the store capped an identity during a call's peek was the service's,
    per identity: another call for the identity meanwhile cleared it, and the first call's
    consolidation, which finishes that cap, counted it a second time."""
    clock = FakeClock()
    store = _CappingStore()
    seeding = MemoryService(store, clock=clock, max_facts=None)
    for n in range(5):
        seeding.emit_observation("u1", tool_ok(f"t{n}"))
    await seeding.drain()
    await seeding.consolidate("u1")
    service = MemoryService(store, clock=clock, max_facts=3)
    try:
        first = asyncio.create_task(service.consolidate("u1"))
        await store.capped.wait()
        assert await service.consolidate("u1") == []  # meanwhile: nothing to do
        store.release.set()
        assert len(await first) == 3
        stats = service.stats()
        assert (stats.facts_capped, stats.facts_evicted) == (1, 7 + 2)
    finally:
        await service.close()
        await seeding.close()


async def test_close_counts_an_observation_rejected_in_a_batch_it_cuts_short_once() -> None:
    """The batch's append waits (the gate) when close() stops the writer: its valid
    observations are dropped, the one rejected when the batch was validated stays
    rejected only (it was counted as dropped too, and pending went below zero)."""
    store = GatedStore()
    service = MemoryService(store, clock=FakeClock())
    store.gate.clear()
    for n in range(5):
        service.emit_observation("u1", tool_ok("get_account", f"s{n}"))
    service.emit_observation("", tool_ok("get_account"))  # no identity: rejected
    await _until(lambda: store.append_calls == 1)  # validated, its append waits
    await service.close(timeout=0.05)
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.rejected, stats.dropped) == (6, 0, 1, 5)
    assert stats.pending == 0


class ReprRaises:
    """A host's identity object (not a string) whose repr() raises."""

    def __repr__(self) -> str:
        raise ValueError("no repr")


class StrReprRaises(str):
    """A str subclass whose repr() raises."""

    def __repr__(self) -> str:
        raise ValueError("no repr")


@pytest.mark.parametrize("log_identities", [False, True])
async def test_an_identity_whose_repr_raises_is_rejected_and_the_writer_goes_on(
    log_identities: bool,
) -> None:
    """Labelling it for the log line raised in the writer, which stopped: the valid
    observations around it were never stored, drain() never returned, and the next
    emit_observation raised to its caller."""
    service = MemoryService.from_url("memory://", clock=FakeClock(), log_identities=log_identities)
    try:
        service.emit_observation("ok", tool_ok("get_account", "s1"))
        service.emit_observation(ReprRaises(), tool_ok("get_account"))  # type: ignore[arg-type]
        service.emit_observation(StrReprRaises("ok2"), tool_ok("get_account", "s2"))
        service.emit_observation("ok", tool_ok("get_account", "s3"))
        await service.drain(timeout=5)
        service.emit_observation(ReprRaises(), None)  # type: ignore[arg-type]
        await service.drain(timeout=5)
        stats = service.stats()
        assert (stats.emitted, stats.stored, stats.rejected, stats.pending) == (5, 3, 2, 0)
    finally:
        await service.close()


class TruthRaises:
    """A host's identity object (not a string) whose truth value raises, as an array's
    of more than one element does."""

    def __bool__(self) -> bool:
        raise ValueError("the truth value is ambiguous")


class StrLenRaises(str):
    """A str subclass whose len() raises."""

    def __len__(self) -> int:
        raise ValueError("no len")


@pytest.mark.parametrize(
    "identity", [TruthRaises(), StrLenRaises("ok")], ids=["object", "str-subclass"]
)
async def test_an_identity_whose_truth_value_raises_is_rejected_alone(identity: Any) -> None:
    """Its rejection's log line, which replaces the identity in the reason, raised in
    the writer: the valid observations validated with it in the batch were dropped."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    try:
        service.emit_observation("ok", tool_ok("get_account", "s1"))
        service.emit_observation(identity, tool_ok("get_account"))
        service.emit_observation("ok", tool_ok("get_account", "s2"))
        await service.drain(timeout=5)
        stats = service.stats()
        assert (stats.emitted, stats.stored, stats.rejected, stats.dropped) == (3, 2, 1, 0)
        assert stats.pending == 0
    finally:
        await service.close()


async def test_an_identity_whose_truth_value_raises_is_counted_once_when_refused_as_queued(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Metadata too large to queue is rejected as it comes; the rejection's log line
    raised for such an identity, and the emit was counted as rejected twice (pending
    went below zero)."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    try:
        big = NewObservation(
            type=ObservationType.TOOL_SUCCESS,
            content="c",
            metadata={"toolName": "t", "rows": list(range(20_000))},
        )
        service.emit_observation(TruthRaises(), big)  # type: ignore[arg-type]
        await service.drain(timeout=5)
        stats = service.stats()
        assert (stats.emitted, stats.rejected, stats.pending) == (1, 1, 0)
        assert "metadata is larger than 16 KiB" in caplog.text
    finally:
        await service.close()


class EqualityRaises:
    """A host's identity object (not a string) whose == raises, as comparing an array
    does once its answer is asked for."""

    def __eq__(self, other: object) -> bool:
        raise ValueError("the truth value is ambiguous")

    __hash__ = object.__hash__


async def test_forget_with_an_identity_whose_equality_raises_queued_loses_nothing() -> None:
    """Filtering the queue compared each queued identity with the one forgotten: such an
    object raised out of forget(), and the observation it had just taken off the queue
    was lost, uncounted (pending for ever)."""
    store = GatedStore()
    service = MemoryService(store, clock=FakeClock())
    try:
        store.gate.clear()  # the queue holds what is emitted
        service.emit_observation("u0", tool_ok("get_account", "first"))
        await _until(lambda: store.append_calls == 1)
        service.emit_observation("u1", tool_ok("get_account"))
        service.emit_observation(EqualityRaises(), tool_ok("get_account"))  # type: ignore[arg-type]
        service.emit_observation("u2", tool_ok("get_account"))
        assert service._forget_queued("u1") == 1
        store.gate.set()
        await service.drain(timeout=5)
        stats = service.stats()
        assert (stats.emitted, stats.stored, stats.rejected, stats.dropped) == (4, 2, 1, 1)
        assert stats.pending == 0
    finally:
        store.gate.set()
        await service.close()


async def test_an_observation_queued_while_forget_filters_the_queue_is_kept() -> None:
    """Another thread may append to the queue while forget() takes the identity's
    observations out of it: such an observation was lost (the queue was replaced by a
    filtered copy), or forget() raised "deque mutated during iteration"."""
    store = GatedStore()
    service = MemoryService(store, clock=FakeClock())
    store.gate.clear()  # the queue holds what is emitted
    service.emit_observation("u0", tool_ok("get_account", "first"))
    await _until(lambda: store.append_calls == 1)
    for identity in ("u1", "u2", "u1"):
        service.emit_observation(identity, tool_ok("get_account"))
    late = service._queue[-1]  # an item like it, for u2, comes in meanwhile

    class AppendedMeanwhile(deque[Any]):
        """Appends one more item once its first item was looked at (by an iteration or
        a pop), as another thread's emit_observation would."""

        appended = False

        def _meanwhile(self) -> None:
            if not self.appended:
                self.appended = True
                self.append(("u2", *late[1:]))
                service._emitted += 1  # that emit's own count

        def __iter__(self) -> Any:
            for n, item in enumerate(super().__iter__()):
                yield item
                if n == 0:
                    self._meanwhile()

        def popleft(self) -> Any:
            self._meanwhile()
            return super().popleft()

    service._queue = AppendedMeanwhile(service._queue)
    try:
        assert service._forget_queued("u1") == 2
        assert [item[0] for item in service._queue] == ["u2", "u2"]
        store.gate.set()
        await service.drain(timeout=5)
        stats = service.stats()
        assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (5, 3, 2, 0)
    finally:
        store.gate.set()
        await service.close()


async def test_a_writer_that_meets_a_bug_counts_the_batch_it_held_and_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An unexpected error stopped the writer with its batch in flight: drain() never
    returned, and nothing emitted afterwards was stored."""
    service = MemoryService.from_url("memory://", clock=FakeClock())
    validate = service._validate
    failures = [RuntimeError("a bug")]

    async def once_broken(items: list[Any]) -> tuple[list[Any], list[ObservationRecord]]:
        if failures:
            raise failures.pop()
        return await validate(items)

    service._validate = once_broken  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.WARNING, "coda_memory"):
            for n in range(3):
                service.emit_observation("u1", tool_ok("get_account", f"s{n}"))
            await service.drain(timeout=5)
            service.emit_observation("u1", tool_ok("get_account", "s9"))
            await service.drain(timeout=5)
        stats = service.stats()
        assert (stats.emitted, stats.stored, stats.dropped, stats.pending) == (4, 1, 3, 0)
        assert "the writer met an unexpected RuntimeError" in caplog.text
    finally:
        await service.close()


async def test_a_writer_that_meets_a_bug_with_batches_validated_ahead_counts_each_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batches validated ahead are in flight too: counted again as ahead, they made
    the drop twice their size and pending go below zero."""
    store = BusyStore()
    async with _writing(store) as service:
        validated = _counting_validations(service)
        emitted = 10 * (2 + MAX_AHEAD + 1) + 3
        for n in range(emitted):
            service.emit_observation("u1", tool_ok("get_account", f"s{n}"))
        await _until(lambda: len(validated) == 2 + MAX_AHEAD)  # 2 appends, 4 ahead

        def broken(records: list[ObservationRecord]) -> tuple[str, ...]:
            raise RuntimeError("a bug")  # on the appends' next retry

        monkeypatch.setattr(service, "_identities", broken)
        await _until(lambda: service.stats().dropped > 0)
        monkeypatch.undo()
        store.busy = False
        await service.drain(timeout=5)
        stats = service.stats()
        held = 10 * (2 + MAX_AHEAD)  # in the two appends and validated ahead
        assert (stats.stored, stats.dropped, stats.pending) == (emitted - held, held, 0)


class HeldOutPeekStore(InMemoryStore):
    """An in-memory store whose peek a held table keeps out while ``held``, as the
    Postgres store's: the facts alone, nothing said to wait, and "peek" in HELD_OUT."""

    held = False

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        noted = HELD_OUT.get()
        if not self.held:
            return await super().peek(identity_id)
        if noted is not None:
            noted.append("peek")
        return await InMemoryStore.facts(self, identity_id), False


@pytest.mark.parametrize("expired", [False, True])
async def test_consolidate_raises_store_busy_only_when_the_held_out_peek_answered(
    expired: bool,
) -> None:
    """A peek held out answers from the facts alone: consolidate() then consolidated
    nothing, and says so (StoreBusy). One whose facts expired by now goes on to
    consolidate (that deletes them): it raised StoreBusy all the same."""
    clock = FakeClock()
    store = HeldOutPeekStore()
    service = MemoryService(store, clock=clock)
    try:
        service.emit_observation("u1", tool_ok("get_account", at=clock()))
        await service.drain()
        assert len(await service.consolidate("u1")) == 1
        store.held = True
        if expired:
            clock.advance(days=3_650)
            assert await service.consolidate("u1") == []
            assert await InMemoryStore.facts(store, "u1") == []  # deleted: consolidated
        else:
            with pytest.raises(StoreBusy, match="nothing was consolidated"):
                await service.consolidate("u1")
    finally:
        await service.close()


class GatedFailingStore(InMemoryStore):
    """An in-memory store whose consolidation, while ``gate`` is set, says it began
    (``entered``) and fails once the gate opens; its peek goes through."""

    gate: asyncio.Event | None = None
    entered: asyncio.Event | None = None

    @asynccontextmanager
    async def consolidation(self, identity_id: str) -> AsyncIterator[InMemoryConsolidationUnit]:
        if self.gate is not None and self.entered is not None:
            self.entered.set()
            await self.gate.wait()
            raise ConnectionError("database unavailable")
        async with super().consolidation(identity_id) as unit:
            yield unit

    def ungate(self) -> None:
        """No call waits at a gate any more."""
        self.gate = None


@asynccontextmanager
async def forget_window_service(
    store: GatedFailingStore, *identities: str, load_timeout: float = 5.0
) -> AsyncIterator[MemoryService]:
    """A service over ``store`` with one fact (``tool_affinity:old``) consolidated for each
    of ``identities``; on leaving, the store's gates are taken away and the service
    closed."""
    service = MemoryService(store, clock=FakeClock(), load_timeout=load_timeout)
    try:
        for who in identities:
            service.emit_observation(who, tool_ok("old"))
            await service.drain()
            await service.consolidate(who)
        yield service
    finally:
        store.ungate()
        await service.close()


async def test_no_answer_from_the_facts_at_hand_outlives_a_forget_of_the_identity() -> None:
    """A load whose consolidation failed after its peek made its answer from the peek's
    facts over turns of the loop; a forget waiting for that consolidation erased the
    identity and returned meanwhile, and the load then answered with the forgotten
    facts."""
    store = GatedFailingStore()
    async with forget_window_service(store, "u1") as service:
        store.gate, store.entered = asyncio.Event(), asyncio.Event()
        service.emit_observation("u1", tool_ok("new"))
        await service.drain()
        ended: list[str] = []
        load = asyncio.create_task(service.load_memory("u1"))
        load.add_done_callback(lambda _: ended.append("load"))
        await store.entered.wait()
        forget = asyncio.create_task(service.forget("u1"))
        forget.add_done_callback(lambda _: ended.append("forget"))
        for _ in range(20):  # turns of the loop: forget then waits for the consolidation
            await asyncio.sleep(0)
        assert not forget.done()
        store.gate.set()
        memory, forgotten = await load, await forget
        assert forgotten.facts == 1
        # Answered after the forget returned, it must hold nothing of the identity.
        assert ended == ["load", "forget"] or memory.facts == []
        assert await service.facts("u1") == []


async def test_a_forget_of_one_identity_leaves_another_s_answer_from_the_facts_at_hand() -> None:
    """Loads of other identities in flight as one is forgotten keep their answers from
    the facts at hand (a forget during a bulk erasure emptied every identity's)."""
    store = GatedFailingStore()
    async with forget_window_service(store, "u1", "u2") as service:
        store.gate, store.entered = asyncio.Event(), asyncio.Event()
        service.emit_observation("u2", tool_ok("new"))
        await service.drain()
        load = asyncio.create_task(service.load_memory("u2"))
        await store.entered.wait()
        assert (await service.forget("u1")).facts == 1
        store.gate.set()
        assert [f.subject for f in (await load).facts] == ["tool_affinity:old"]


class GatedForgetStore(GatedFailingStore):
    """A gated failing store whose forget, while ``forget_gate`` is set, says it began
    (``forget_entered``) and erases once the gate opens."""

    forget_gate: asyncio.Event | None = None
    forget_entered: asyncio.Event | None = None

    async def forget(self, identity_id: str) -> Forgotten:
        if self.forget_gate is not None and self.forget_entered is not None:
            self.forget_entered.set()
            await self.forget_gate.wait()
        return await super().forget(identity_id)

    def ungate(self) -> None:
        super().ungate()
        self.forget_gate = None


async def forget_in_flight(
    store: GatedForgetStore, service: MemoryService, identity_id: str
) -> tuple[asyncio.Task[Forgotten], asyncio.Event]:
    """A forget of ``identity_id`` that has begun erasing in ``store``, and the gate that
    holds it there until set (``store.forget_gate``)."""
    store.forget_gate, store.forget_entered = asyncio.Event(), asyncio.Event()
    forget = asyncio.create_task(service.forget(identity_id))
    await store.forget_entered.wait()
    return forget, store.forget_gate


async def test_a_load_that_began_during_a_forget_gives_no_answer_from_the_facts_at_hand() -> None:
    """A load that began while the forget was erasing read the facts before the erasure
    (its peek), and answered with them after the forget had returned."""
    store = GatedForgetStore()
    async with forget_window_service(store, "u1") as service:
        service.emit_observation("u1", tool_ok("new"))
        await service.drain()
        forget, erase = await forget_in_flight(store, service, "u1")
        store.gate, store.entered = asyncio.Event(), asyncio.Event()
        load = asyncio.create_task(service.load_memory("u1"))
        await store.entered.wait()  # (its peek read the facts)
        erase.set()
        assert (await forget).facts == 1
        store.gate.set()
        assert (await load).facts == []


class GatedPeekStore(GatedForgetStore):
    """A gated forget store whose peek, while ``peek_gate`` is set, reads the identity's
    facts, says so (``peeked``), and returns what it read once the gate opens."""

    peek_gate: asyncio.Event | None = None
    peeked: asyncio.Event | None = None

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        read = await super().peek(identity_id)
        if self.peek_gate is not None and self.peeked is not None:
            self.peeked.set()
            await self.peek_gate.wait()
        return read

    def ungate(self) -> None:
        super().ungate()
        self.peek_gate = None


async def load_that_peeked(
    store: GatedPeekStore, service: MemoryService, identity_id: str
) -> tuple[asyncio.Task[LoadedMemory], asyncio.Event]:
    """A load of ``identity_id`` whose peek has read the identity's facts in ``store``, and
    the gate that holds the peek there until set (``store.peek_gate``)."""
    store.peek_gate, store.peeked = asyncio.Event(), asyncio.Event()
    load = asyncio.create_task(service.load_memory(identity_id))
    await store.peeked.wait()
    return load, store.peek_gate


async def test_a_load_that_read_the_facts_before_a_forget_erased_them_answers_none() -> None:
    """A load that began while the forget was erasing read the facts before the erasure
    (its peek, with nothing new waiting: its own answer, not one from the facts at hand),
    and answered with them after the forget had returned."""
    store = GatedPeekStore()
    async with forget_window_service(store, "u1") as service:
        assert [f.subject for f in (await service.load_memory("u1")).facts] == ["tool_affinity:old"]
        forget, erase = await forget_in_flight(store, service, "u1")
        load, answer = await load_that_peeked(store, service, "u1")  # (not yet erased)
        erase.set()
        assert (await forget).facts == 1
        answer.set()
        assert (await load).facts == []
        stats = service.stats()
        assert (stats.load_stale, stats.load_timeouts, stats.load_errors) == (0, 0, 0)
        # The next load reads what the forget left: nothing.
        store.peek_gate = None
        assert (await service.load_memory("u1")).facts == []


async def test_a_load_in_flight_as_a_forget_of_another_identity_ends_keeps_its_answer() -> None:
    """The forget voids the answers of its identity's loads only."""
    store = GatedPeekStore()
    async with forget_window_service(store, "u1", "u2") as service:
        forget, erase = await forget_in_flight(store, service, "u1")
        load, answer = await load_that_peeked(store, service, "u2")
        erase.set()
        assert (await forget).facts == 1
        answer.set()
        assert [f.subject for f in (await load).facts] == ["tool_affinity:old"]


async def test_facts_of_a_big_identity_give_the_loop_turns_as_they_are_decayed() -> None:
    """facts() decayed and viewed every fact of the identity in one go: with 30,000 of
    them, the event loop of the host's requests stalled for hundreds of milliseconds."""
    service = MemoryService.from_url("memory://", clock=FakeClock(), max_facts=None)
    try:
        service.emit_observation("u1", tool_ok("t"))
        await service.drain()
        await service.consolidate("u1")
        state = service.store._identities["u1"]  # type: ignore[attr-defined]
        (fact,) = state.facts.values()
        state.facts.clear()
        for i in range(10 * turns.SLICE):
            subject = f"tool_affinity:t{i:05}"
            state.facts[subject] = fact.model_copy(update={"subject": subject})
        ticks = 0
        stop = False

        async def other_request() -> None:
            nonlocal ticks
            while not stop:
                ticks += 1
                await asyncio.sleep(0)

        other = asyncio.create_task(other_request())
        await asyncio.sleep(0)
        before = ticks
        facts = await service.facts("u1")
        during = ticks - before
        stop = True
        await other
        assert [f.subject for f in facts] == sorted(state.facts)
        # A turn of the loop at least every SLICE facts.
        assert during >= len(facts) // turns.SLICE
    finally:
        await service.close()


class FailingOnCueStore(InMemoryStore):
    """An in-memory store whose peek, while ``failure`` is set, waits for it and raises the
    error it is given."""

    failure: asyncio.Future[Exception] | None = None

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        if self.failure is not None:
            raise await self.failure
        return await super().peek(identity_id)


@pytest.mark.parametrize("error", [TimeoutError, ConnectionError])
async def test_a_store_error_landing_as_the_load_times_out_counts_as_an_error(
    error: type[Exception], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The consolidation's failure (the store's own TimeoutError among them: a lock
    timeout, a driver's command timeout) is the load's error. One that landed as the
    load's timer fired, before the load handled its timeout (a busy loop runs it in
    between), was taken for the load's timeout: counted in load_timeouts, and the
    error's log line was missing."""
    store = FailingOnCueStore()
    service = MemoryService(store, clock=FakeClock(), load_timeout=0.05)
    real_within = service_module._within
    waits = 0

    async def failing_as_the_timer_fires(task: Any, seconds: float) -> Any:
        nonlocal waits
        waits += 1
        try:
            return await real_within(task, seconds)
        except TimeoutError:
            if waits == 2 and store.failure is not None:  # the load's last wait
                store.failure.set_result(error("the store timed out"))
                await asyncio.wait([task])
            raise

    try:
        service.emit_observation("u1", tool_ok("t"))
        await service.drain()
        store.failure = asyncio.get_running_loop().create_future()
        monkeypatch.setattr(service_module, "_within", failing_as_the_timer_fires)
        with caplog.at_level(logging.WARNING, logger="coda_memory"):
            memory = await service.load_memory("u1")
        assert waits == 2
        assert memory.facts == []
        stats = service.stats()
        assert (stats.load_errors, stats.load_timeouts, stats.load_stale) == (1, 0, 0)
        assert f"failed ({error.__name__}" in caplog.text
    finally:
        store.failure = None
        await service.close()


async def test_a_load_begun_after_a_forget_joins_no_consolidation_that_read_before_it() -> None:
    """A load that began while the forget was erasing read the facts before the erasure;
    one that begins once the forget has returned consolidates anew, and neither it nor
    its answer from the facts at hand has the erased facts."""
    store = GatedPeekStore()
    async with forget_window_service(store, "u1") as service:
        forget, erase = await forget_in_flight(store, service, "u1")
        during, answer = await load_that_peeked(store, service, "u1")  # (not yet erased)
        erase.set()
        assert (await forget).facts == 1
        store.peeked = asyncio.Event()
        after = asyncio.create_task(service.load_memory("u1"))
        async with asyncio.timeout(5):  # (joined to the first, it would read nothing)
            await store.peeked.wait()  # its own read, after the erasure
        answer.set()
        assert (await during).facts == []
        assert (await after).facts == []
        stats = service.stats()
        assert (stats.load_stale, stats.load_timeouts, stats.load_errors) == (0, 0, 0)


class QueuedPeekStore(GatedForgetStore):
    """A gated forget store whose peeks each take the next of ``peek_gates`` (when any is
    left): the peek reads the identity's facts, says so, and returns them once its gate
    opens."""

    def __init__(self) -> None:
        super().__init__()
        self.peek_gates: list[tuple[asyncio.Event, asyncio.Event]] = []

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        read = await super().peek(identity_id)
        if self.peek_gates:
            peeked, gate = self.peek_gates.pop(0)
            peeked.set()
            await gate.wait()
        return read


async def test_a_consolidate_call_that_read_before_a_forget_leaves_no_facts_at_hand() -> None:
    """A consolidate() call (not a load's) read the facts before a forget erased them;
    a load that began after the forget stored them as the facts at hand, and a load whose
    consolidation ran late answered with the erased facts."""
    store = QueuedPeekStore()
    before = (asyncio.Event(), asyncio.Event())
    late = (asyncio.Event(), asyncio.Event())
    async with forget_window_service(store, "u1", load_timeout=0.5) as service:
        try:
            store.peek_gates.append(before)
            direct = asyncio.create_task(service.consolidate("u1"))
            await before[0].wait()  # it read the facts, not yet erased
            assert (await service.forget("u1")).facts == 1
            store.peek_gates.append(late)
            load = asyncio.create_task(service.load_memory("u1"))
            await late[0].wait()  # its own read, after the erasure; held past its timeout
            before[1].set()
            await direct
            assert (await load).facts == []
            late[1].set()
            stats = service.stats()
            assert (stats.load_stale, stats.load_timeouts) == (0, 1)
        finally:
            before[1].set()
            late[1].set()
