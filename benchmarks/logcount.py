"""Counting the log lines the library writes during a measurement, by cause and second,
instead of printing them."""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

#: Log lines that say the connection pool ran out.
POOL_EXHAUSTED = re.compile(r"QueuePool limit|pool.*timed out|TimeoutError", re.I)


class LogCounter(logging.Handler):
    """Counts WARNING and worse records by cause (logger and message template) and by
    the second they were written in."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.by_second: Counter[tuple[str, str, int]] = Counter()
        self.pool_exhausted = 0

    def emit(self, record: logging.LogRecord) -> None:
        cause = (record.name, str(record.msg))
        self.by_second[(*cause, int(record.created))] += 1
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f" {record.exc_info[1]!r}"
        self.pool_exhausted += bool(POOL_EXHAUSTED.search(text))

    @property
    def lines(self) -> int:
        return sum(self.by_second.values())

    @property
    def max_per_second_per_cause(self) -> int:
        return max(self.by_second.values(), default=0)

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
