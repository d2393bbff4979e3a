"""Caps on what one identity or one tool result can make the library hold, and log lines
that a flood cannot multiply.

A cap that applies is counted and logged; every warning the library may repeat under
load (a cap, a timeout, a failing store) goes through a :class:`LogThrottle`, so it is
written at most once per second per cause, with the number of repeats it stands for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

#: Facts kept per identity (the best ranked by ``confidence * reinforcement_count``).
DEFAULT_MAX_FACTS = 500
#: Entities taken from one tool result (in the order the result lists them).
DEFAULT_MAX_ENTITIES_PER_RESULT = 100


class LogThrottle:
    """Warnings at most once per ``interval`` seconds per cause; the line after a quiet
    spell says how many were held back."""

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

    def warning(self, cause: str, message: str, *args: Any) -> None:
        """Log ``message % args`` under ``cause`` unless one was logged within the interval."""
        self._log(logging.WARNING, cause, message, args, exc_info=False)

    def error(self, cause: str, message: str, *args: Any, exc_info: bool = True) -> None:
        """Like :meth:`warning`, at error level, with the exception being handled."""
        self._log(logging.ERROR, cause, message, args, exc_info=exc_info)

    def _log(
        self, level: int, cause: str, message: str, args: tuple[Any, ...], exc_info: bool
    ) -> None:
        now = self.clock()
        last = self._last.get(cause)
        if last is not None and now - last < self.interval:
            self._held[cause] = self._held.get(cause, 0) + 1
            return
        held = self._held.pop(cause, 0)
        self._last[cause] = now
        suffix = (
            f" (and {held} more like it in the last {now - last:.1f}s)" if held and last else ""
        )
        self.logger.log(level, message + suffix, *args, exc_info=exc_info)


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
