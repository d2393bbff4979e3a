"""Caps: facts kept per identity (by rank) and entities taken from one tool result."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import pytest

from coda_memory import entity_observations
from coda_memory.core import emitters
from coda_memory.core.caps import CAUSE_ATTRIBUTE, DEFAULT_MAX_ENTITIES_PER_RESULT, LogThrottle
from tests.conftest import ServiceFactory
from tests.helpers import FakeClock, tool_ok


async def test_the_fact_cap_keeps_the_best_ranked_facts_and_deletes_the_rest(
    make_service: ServiceFactory, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    service = await make_service(max_facts=3)
    # tool_k is used in k sessions: rank (confidence x count) grows with k.
    for k in range(1, 6):
        for session in range(k):
            service.emit_observation("u1", tool_ok(f"tool_{k}", session=f"s{session}"))
    await service.drain()
    with caplog.at_level(logging.WARNING, "coda_memory"):
        loaded = await service.load_memory("u1")
    kept = ["tool_affinity:tool_3", "tool_affinity:tool_4", "tool_affinity:tool_5"]
    assert [f.subject for f in loaded.facts] == kept
    assert "tool_1" not in loaded.prompt_section
    assert set(loaded.tool_affinities) == {"tool_3", "tool_4", "tool_5"}
    # Deleted from the store, not only hidden.
    assert sorted(f.subject for f in await service.store.facts("u1")) == kept
    stats = service.stats()
    assert (stats.facts_capped, stats.facts_evicted) == (1, 2)
    assert "facts per identity capped" in caplog.text
    # A capped fact comes back like an expired one: new, at 0.5, and it then ranks last.
    service.emit_observation("u1", tool_ok("tool_1", session="later"))
    await service.drain()
    facts = await service.consolidate("u1")
    assert [f.subject for f in facts] == kept
    assert service.stats().facts_evicted == 3


async def test_without_a_cap_every_fact_stays(make_service: ServiceFactory) -> None:
    service = await make_service(max_facts=None)
    for k in range(5):
        service.emit_observation("u1", tool_ok(f"tool_{k}"))
    await service.drain()
    assert len((await service.load_memory("u1")).facts) == 5
    assert service.stats().facts_capped == 0


def test_entities_are_taken_from_one_tool_result_up_to_the_cap_in_its_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    products = [{"id": f"p{i}", "title": f"Product {i}"} for i in range(30_000)]
    applied, dropped = emitters.ENTITY_CAP.applied, emitters.ENTITY_CAP.dropped
    emitters.ENTITY_CAP.throttle._last.clear()
    with caplog.at_level(logging.WARNING, "coda_memory"):
        observations = entity_observations("get_products_by_isrc", {"products": products})
    assert len(observations) == DEFAULT_MAX_ENTITIES_PER_RESULT
    assert [o.metadata["entityId"] for o in observations] == [
        f"p{i}" for i in range(DEFAULT_MAX_ENTITIES_PER_RESULT)
    ]
    assert emitters.ENTITY_CAP.applied == applied + 1
    # One a result: the rest of it is not read.
    assert emitters.ENTITY_CAP.dropped == dropped + 1
    assert "entities per tool result capped" in caplog.text
    assert "'get_products_by_isrc' gave more than 100, kept the first of them" in caplog.text
    few = entity_observations("get_products_by_isrc", {"products": products[:5]})
    assert len(few) == 5 and emitters.ENTITY_CAP.applied == applied + 1
    assert (
        len(entity_observations("get_products_by_isrc", {"products": products}, max_entities=None))
        == 30_000
    )


async def test_stats_count_the_entity_cap(make_service: ServiceFactory) -> None:
    service = await make_service()
    before = service.stats().entity_results_capped
    entity_observations("get_products_by_isrc", {"products": [{"id": i} for i in range(101)]})
    assert service.stats().entity_results_capped == before + 1


def throttle_on_a_fake_clock(
    logger: str = "coda_memory.test", interval: float = 1.0
) -> tuple[LogThrottle, list[float]]:
    """A throttle on ``logger`` whose clock reads ``now[0]`` (100.0 to start), and
    ``now``, which the test moves."""
    now = [100.0]
    return LogThrottle(logging.getLogger(logger), interval, clock=lambda: now[0]), now


def test_a_repeated_warning_is_logged_at_most_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    throttle, now = throttle_on_a_fake_clock()
    with caplog.at_level(logging.WARNING, "coda_memory.test"):
        for _ in range(50):
            throttle.warning("timeout", "load timed out")
            throttle.warning("other", "another cause")
            now[0] += 0.01
        now[0] += 1.0
        throttle.warning("timeout", "load timed out")
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count("another cause") == 1
    timeouts = [line for line in lines if line.startswith("load timed out")]
    assert len(timeouts) == 2
    assert "49 more like it" in timeouts[1]


def test_flush_reports_each_cause_held_back_once_at_its_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    throttle, now = throttle_on_a_fake_clock()
    with caplog.at_level(logging.DEBUG, "coda_memory.test"):
        for _ in range(3):
            throttle.warning("timeout", "load timed out")
            throttle.debug("quiet", "an extractor failed")
            now[0] += 0.1
        throttle.warning("alone", "said once")
        caplog.clear()
        throttle.flush()
        lines = [(r.levelno, r.getMessage()) for r in caplog.records]
        assert lines == [
            (
                logging.DEBUG,
                "coda-memory: 2 more line(s) of cause 'quiet' were held back in the last 0.3s",
            ),
            (
                logging.WARNING,
                "coda-memory: 2 more line(s) of cause 'timeout' were held back in the last 0.3s",
            ),
        ]
        # Reported once: nothing is held any more, and a later line carries no count.
        caplog.clear()
        throttle.flush()
        now[0] += 1.0
        throttle.warning("timeout", "load timed out")
        assert [r.getMessage() for r in caplog.records] == ["load timed out"]


def test_a_report_of_held_lines_counts_as_a_line_of_its_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The next line of the cause half a second after the report was written too: two
    lines of one cause in one second. Every line carries its cause for a handler."""
    throttle, now = throttle_on_a_fake_clock()
    with caplog.at_level(logging.WARNING, "coda_memory.test"):
        throttle.warning("timeout", "load timed out")
        throttle.warning("timeout", "load timed out")
        now[0] += 2.0
        throttle.flush()  # as the quiet timer does
        now[0] += 0.5
        throttle.warning("timeout", "load timed out")
        now[0] += 0.6
        throttle.warning("timeout", "load timed out")
    lines = [(r.getMessage()[:40], getattr(r, CAUSE_ATTRIBUTE)) for r in caplog.records]
    assert lines == [
        ("load timed out", "timeout"),
        ("coda-memory: 1 more line(s) of cause 'ti", "timeout"),
        ("load timed out (and 1 more like it in th", "timeout"),
    ]


def test_each_cause_flushed_is_a_template_of_its_own(caplog: pytest.LogCaptureFixture) -> None:
    """Handlers that count lines per cause group them by template (the benchmark's do):
    the flush's lines of two causes must not look like two lines of one."""
    throttle, _ = throttle_on_a_fake_clock()
    with caplog.at_level(logging.WARNING, "coda_memory.test"):
        for cause in ("timeout", "100% full", "timeout", "100% full"):
            throttle.warning(cause, "a line")
        caplog.clear()
        throttle.flush()
    templates = [str(r.msg) for r in caplog.records]
    assert len(set(templates)) == 2
    assert [r.getMessage() for r in caplog.records] == [
        "coda-memory: 1 more line(s) of cause '100% full' were held back in the last 0.0s",
        "coda-memory: 1 more line(s) of cause 'timeout' were held back in the last 0.0s",
    ]


class _HeldBack(logging.Handler):
    """The lines of a logger, and an event set by the first that reports held lines."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []
        self.reported = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))
        if "were held back" in record.getMessage():
            self.reported.set()


@pytest.fixture
def held_back() -> Iterator[_HeldBack]:
    logger = logging.getLogger("coda_memory.test.timer")
    handler = _HeldBack()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)


async def test_lines_held_back_are_reported_once_the_cause_is_quiet(held_back: _HeldBack) -> None:
    """No later line of the cause and no close: the event loop reports the count, once the
    cause has been quiet for an interval after its window, at the level of its lines."""
    interval = 0.05
    throttle = LogThrottle(logging.getLogger("coda_memory.test.timer"), interval)
    started = time.monotonic()
    for _ in range(3):
        throttle.warning("timeout", "load timed out")
    throttle.error("timeout", "load failed", exc_info=False)
    await asyncio.wait_for(held_back.reported.wait(), 10)
    assert time.monotonic() - started >= 2 * interval
    assert held_back.lines[0] == (logging.WARNING, "load timed out")
    level, line = held_back.lines[1]
    assert (level, line[: line.index(" in the last")]) == (
        logging.ERROR,
        "coda-memory: 3 more line(s) of cause 'timeout' were held back",
    )
    assert len(held_back.lines) == 2
    # Reported: a close reports nothing more.
    throttle.flush()
    assert len(held_back.lines) == 2


async def test_a_count_a_later_line_carried_is_not_reported_again(held_back: _HeldBack) -> None:
    throttle, now = throttle_on_a_fake_clock("coda_memory.test.timer", 0.05)
    throttle.warning("timeout", "load timed out")
    now[0] += 0.01
    throttle.warning("timeout", "load timed out")  # held: a timer is set
    now[0] += 0.05
    throttle.warning("timeout", "load timed out")  # carries the count of 1
    now[0] += 0.01
    throttle.warning("timeout", "load timed out")  # held
    now[0] += 1.0  # then quiet
    await asyncio.wait_for(held_back.reported.wait(), 10)
    assert [line for _, line in held_back.lines] == [
        "load timed out",
        "load timed out (and 1 more like it in the last 0.1s)",
        "coda-memory: 1 more line(s) of cause 'timeout' were held back in the last 1.0s",
    ]


def test_a_timer_of_a_closed_loop_does_not_keep_the_next_loop_from_reporting(
    held_back: _HeldBack,
) -> None:
    """Throttles outlive event loops (they are per module): lines held on a loop that
    closed before its timer fired are reported by the next loop that holds one."""
    throttle, now = throttle_on_a_fake_clock("coda_memory.test.timer", 0.05)

    async def held_then_closed() -> None:
        throttle.warning("timeout", "load timed out")
        now[0] += 0.01
        throttle.warning("timeout", "load timed out")  # its timer dies with the loop

    async def held_then_reported() -> None:
        now[0] += 0.01
        throttle.warning("timeout", "load timed out")
        now[0] += 1.0
        await asyncio.wait_for(held_back.reported.wait(), 10)

    asyncio.run(held_then_closed())
    asyncio.run(held_then_reported())
    assert held_back.lines[-1] == (
        logging.WARNING,
        "coda-memory: 2 more line(s) of cause 'timeout' were held back in the last 1.0s",
    )


def test_off_an_event_loop_nothing_is_scheduled_and_close_reports(held_back: _HeldBack) -> None:
    throttle, now = throttle_on_a_fake_clock("coda_memory.test.timer", 0.05)
    throttle.warning("timeout", "load timed out")
    throttle.warning("timeout", "load timed out")
    now[0] += 5.0
    throttle.flush()
    assert [line for _, line in held_back.lines] == [
        "load timed out",
        "coda-memory: 1 more line(s) of cause 'timeout' were held back in the last 5.0s",
    ]
