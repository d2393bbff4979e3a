"""Caps on what one identity or one tool result can make the library hold, and log lines
that a flood cannot multiply.

A cap that applies is counted and logged; every warning the library may repeat under
load (a cap, a timeout, a failing store) goes through a :class:`LogThrottle`, so it is
written at most once per second per cause, with the number of repeats it stands for.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from coda_memory.core.decay import DecayFormula
from coda_memory.core.model import MAX_INT32

#: Facts kept per identity (the best ranked by ``confidence * reinforcement_count``).
DEFAULT_MAX_FACTS = 500
#: The largest ``max_facts``: the store reads up to twice it, bound as a bigint (a larger
#: one, meant as "no cap", failed every peek; None is no cap).
MAX_FACTS = MAX_INT32
#: Entities taken from one tool result (in the order the result lists them).
DEFAULT_MAX_ENTITIES_PER_RESULT = 100


#: Every throttle, so that :func:`flush_held` can report what each one held back.
_THROTTLES: weakref.WeakSet[LogThrottle] = weakref.WeakSet()


def flush_held() -> None:
    """:meth:`LogThrottle.flush` every throttle (a service calls it when it closes)."""
    for throttle in list(_THROTTLES):
        throttle.flush()


#: The attribute of a throttled line's log record that names its cause (the lines of one
#: cause share it, whatever their text: a log handler can count them, or group them).
CAUSE_ATTRIBUTE = "coda_memory_cause"


def _cause(cause: str) -> dict[str, str]:
    return {CAUSE_ATTRIBUTE: cause}


class LogThrottle:
    """Warnings at most once per ``interval`` seconds per cause; the line after a quiet
    spell says how many were held back. When none comes, a timer of the event loop that
    held the first of them says it, once the cause has been quiet for ``interval`` after
    its window (a timer handle per cause with lines held, no task; off an event loop,
    nothing is scheduled), and so does :meth:`flush`, which a service calls when it
    closes.

    Lines come from any thread (an emit of another thread meets a full queue), so the
    counts and times of each cause change under a lock; the line itself is written
    after it is released (a log handler that logs through the throttle again must not
    wait for it)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        #: The level of each cause's held lines.
        self._levels: dict[str, int] = {}
        #: The timer that reports each cause's held lines when no later line does.
        self._timers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle]] = {}
        #: Held while the counts and times above are read and changed; reentrant, as
        #: a signal's handler that logs through the throttle runs in the thread that
        #: may hold it.
        self._lock = threading.RLock()
        _THROTTLES.add(self)

    def debug(self, cause: str, message: str, *args: Any) -> None:
        """Like :meth:`warning`, at debug level."""
        self._log(logging.DEBUG, cause, message, args, exc_info=False)

    def warning(self, cause: str, message: str, *args: Any) -> None:
        """Log ``message % args`` under ``cause`` unless one was logged within the interval."""
        self._log(logging.WARNING, cause, message, args, exc_info=False)

    def error(self, cause: str, message: str, *args: Any, exc_info: bool = True) -> None:
        """Like :meth:`warning`, at error level, with the exception being handled."""
        self._log(logging.ERROR, cause, message, args, exc_info=exc_info)

    def _log(
        self, level: int, cause: str, message: str, args: tuple[Any, ...], exc_info: bool
    ) -> None:
        # (acquire and release rather than a with block: half its cost, on every line.)
        self._lock.acquire()
        try:
            now = self.clock()
            last = self._last.get(cause)
            if last is not None and now - last < self.interval:
                self._held[cause] = self._held.get(cause, 0) + 1
                self._levels[cause] = max(level, self._levels.get(cause, level))
                self._schedule(cause, self._quiet_at(last) - now)
                return
            self._levels.pop(cause, None)
            held = self._held.pop(cause, 0)
            self._last[cause] = now
        finally:
            self._lock.release()
        suffix = (
            f" (and {held} more like it in the last {now - last:.1f}s)" if held and last else ""
        )
        self.logger.log(level, message + suffix, *args, exc_info=exc_info, extra=_cause(cause))

    def flush(self) -> None:
        """Log, for each cause, the lines held back since its last line, which no later
        line of the cause has reported (one line per cause; then none are held)."""
        with self._lock:
            now = self.clock()
            reports = [self._held_back(cause, now) for cause in sorted(self._held)]
            timers = [timer for _, timer in self._timers.values()]
            self._timers.clear()
        for timer in timers:
            timer.cancel()
        for report in reports:
            self._report(report)

    def _held_back(self, cause: str, now: float) -> tuple[str, int, int, float]:
        """``cause``'s held lines, taken (none are held after it): the cause, the level
        of its report, how many were held and over how many seconds. Called with the
        lock held."""
        held = self._held.pop(cause, 0)
        level = self._levels.pop(cause, logging.WARNING)
        since = now - self._last.get(cause, now)
        if held:
            # A line of the cause too: the next one waits an interval after it (a line
            # half a second after this report made two of one cause in a second).
            self._last[cause] = now
        return cause, level, held, since

    def _report(self, report: tuple[str, int, int, float]) -> None:
        """The line that says how many lines of a cause were held back (none held:
        nothing); ``report`` is :meth:`_held_back`'s."""
        cause, level, held, since = report
        if not held:
            return
        # The cause in the template, not an argument: a line per cause, each its own
        # template, as a log handler that groups lines by template counts causes.
        named = repr(cause).replace("%", "%%")
        self.logger.log(
            level,
            f"coda-memory: %d more line(s) of cause {named} were held back in the last %.1fs",
            held,
            since,
            extra=_cause(cause),
        )

    def _quiet_at(self, last: float) -> float:
        """When a cause whose last line was at ``last`` has been quiet for an interval
        after its window: its held lines are reported then."""
        return last + 2 * self.interval

    def _schedule(self, cause: str, delay: float) -> None:
        """Have the running event loop report ``cause``'s held lines after ``delay``
        seconds, unless a timer of a loop still open is set for it already. Called with
        the lock held."""
        set_for = self._timers.get(cause)
        if set_for is not None and not set_for[0].is_closed():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a thread without a loop: the next line, or close, reports
            self._timers.pop(cause, None)
            return
        timer = loop.call_later(max(0.0, delay), self._when_quiet, cause)
        self._timers[cause] = (loop, timer)

    def _when_quiet(self, cause: str) -> None:
        """The timer of ``cause``: its held lines are reported once the cause has had no
        line for ``interval``; a line logged since moved that on, so wait for it."""
        with self._lock:
            self._timers.pop(cause, None)
            if not self._held.get(cause):
                return
            now = self.clock()
            last = self._last.get(cause)
            if last is not None and now < self._quiet_at(last):
                self._schedule(cause, self._quiet_at(last) - now)
                return
            # (The report is the cause's line of this interval: _held_back notes it.)
            report = self._held_back(cause, now)
        self._report(report)


class CapCounter:
    """How often a cap applied and how many items it dropped, with a throttled log line."""

    def __init__(self, throttle: LogThrottle, cause: str) -> None:
        self.throttle = throttle
        self.cause = cause
        #: Times the cap applied, and items it dropped in all.
        self.applied = 0
        self.dropped = 0

    def hit(self, dropped: int, detail: str) -> None:
        """Record that the cap applied and dropped ``dropped`` items."""
        self.applied += 1
        self.dropped += dropped
        self.throttle.warning(self.cause, "coda-memory: %s: %s", self.cause, detail)


def kept_on_server(keep: int) -> int:
    """The facts a cap of ``keep`` applied on the server leaves (:class:`FactCap`):
    ``keep`` and a margin for the rank's float rounding."""
    return keep + max(10, keep // 10)


@dataclass(frozen=True, slots=True)
class FactCap:
    """The cap on facts per identity, for a store that can apply it where the facts are.

    A consolidation applies the cap to the facts it reads, exactly (the plan keeps the
    ``keep`` best ranked). An identity far over it (facts stored before the cap, an
    import, a lowered ``max_facts``) would make its first load read, decode and rank all
    of them in the application: 30,000 facts hold the event loop and a connection for
    most of a second. A store given a ``FactCap`` reads an identity's facts only when
    they are at most :attr:`read_limit`; beyond that, it deletes on the server the live
    facts that rank beyond :attr:`kept_on_server` at ``clock()`` (the same rank, computed
    by ``formula``), then reads the rest, whose consolidation applies the cap exactly.
    The margin between ``kept_on_server`` and ``keep`` holds any fact whose rank a float
    rounding could move by a few places. A fact expired at ``clock()`` is not ranked:
    the store deletes it too, with the event the consolidation would record for it. The
    facts that observations waiting for the consolidation may change
    (:func:`~coda_memory.core.sessions.subjects_reached`) are left to it: neither
    ranked, expired nor deleted. The others keep their stored state, so one ranked
    beyond the cap among them stays beyond it.
    """

    #: The facts kept per identity (``MemoryService.max_facts``).
    keep: int
    formula: DecayFormula
    clock: Callable[[], datetime]
    #: Called with the identity and how many facts the store deleted.
    applied: Callable[[str, int], None]

    @property
    def read_limit(self) -> int:
        """The most facts of an identity read into the application before the cap."""
        return 2 * self.keep

    @property
    def kept_on_server(self) -> int:
        """The facts left by a cap applied on the server: ``keep`` and a margin."""
        return kept_on_server(self.keep)
