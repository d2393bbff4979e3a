"""Counting the log lines the library writes during a measurement, by cause and second,
instead of printing them."""

from __future__ import annotations

import logging
import re
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from coda_memory.core.caps import CAUSE_ATTRIBUTE

#: Log lines that say the connection pool ran out.
POOL_EXHAUSTED = re.compile(r"QueuePool limit|pool.*timed out|TimeoutError", re.I)


class LogCounter(logging.Handler):
    """Counts WARNING and worse records by cause and by when they were written. The
    cause is the one the library's throttle names (``coda_memory_cause``: its lines of
    one cause differ in text, "… (and 13 more like it …)", and its held-back summary has
    a template of its own), else the logger and message template."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.by_second: Counter[tuple[str, str, int]] = Counter()
        #: When each cause's lines were written.
        self.times: defaultdict[tuple[str, str], list[float]] = defaultdict(list)
        self.pool_exhausted = 0

    def emit(self, record: logging.LogRecord) -> None:
        cause = (record.name, str(vars(record).get(CAUSE_ATTRIBUTE, record.msg)))
        self.by_second[(*cause, int(record.created))] += 1
        self.times[cause].append(record.created)
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f" {record.exc_info[1]!r}"
        self.pool_exhausted += bool(POOL_EXHAUSTED.search(text))

    @property
    def lines(self) -> int:
        return sum(self.by_second.values())

    @property
    def max_per_second_per_cause(self) -> int:
        """The most lines of one cause within any one second (a sliding window, not
        calendar seconds: two lines 0.2 s apart across a second's boundary count)."""
        most = 0
        for times in self.times.values():
            times.sort()
            first = 0
            for last, at in enumerate(times):
                # (The throttle keeps a second by the monotonic clock, records carry the
                # wall clock's time: a millisecond's slack for the two drifting apart.)
                while at - times[first] >= 0.999:
                    first += 1
                most = max(most, last - first + 1)
        return most

    def causes(self) -> dict[str, int]:
        totals: Counter[str] = Counter()
        for (name, message, _), count in self.by_second.items():
            totals[f"{name}: {message[:80]}"] += count
        return dict(totals.most_common(5))


@contextmanager
def counted_logs() -> Iterator[LogCounter]:
    """Route every log record to a :class:`LogCounter` while the block runs (the run's
    own console handler is set aside meanwhile)."""
    root = logging.getLogger()
    counter = LogCounter()
    saved = root.handlers[:]
    root.handlers = [counter]
    try:
        yield counter
    finally:
        root.handlers = saved
