"""Log lines a host can afford: rate-limited per cause, and no identity ids by default.

* :class:`RateLimitedLog` writes at most one line per second for each cause (a storage
  failure, a rejected observation, a failed load, …); the next line of that cause says
  how many were suppressed meanwhile. One outage gives a handful of lines, not one per
  observation or request.
* :func:`identity_label` shows an identity id as a stable short hash (8 hex digits of
  BLAKE2b), unless the service was built with ``log_identities=True``: the same user has
  the same label in every line, and no e-mail address or name reaches the logs.
* :func:`short_error` is an exception's class and the first line of its message, with the
  identity ids it names replaced by their labels: never a statement or its parameters
  (SQLAlchemy adds those to its messages' later lines), never a traceback.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable

#: Characters of a message's first line that a log line keeps.
MAX_MESSAGE_CHARS = 200


def identity_label(identity_id: object, *, show: bool = False) -> str:
    """How a log line names an identity: a stable short hash, or (``show``) the id."""
    if show:
        return repr(identity_id)[:80]
    raw = identity_id if isinstance(identity_id, str) else repr(identity_id)
    digest = hashlib.blake2b(raw.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    return f"id:{digest}"


def short_error(
    error: BaseException, identities: tuple[str, ...] = (), *, show: bool = False
) -> str:
    """``Class: first line of the message``, capped; ``identities`` in it become labels."""
    lines = str(error).strip().splitlines()
    message = lines[0] if lines else ""
    if not show:
        for identity in identities:
            if identity:
                message = message.replace(repr(identity), identity_label(identity))
                message = message.replace(identity, identity_label(identity))
    message = message[:MAX_MESSAGE_CHARS]
    name = type(error).__name__
    return f"{name}: {message}" if message else name


class RateLimitedLog:
    """At most one line per ``interval`` seconds per cause, then a count of the rest."""

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        #: cause -> (time of its last line, lines suppressed since)
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, cause: str, message: str, *args: object) -> bool:
        """Log ``message % args`` unless ``cause`` logged within the interval; True when
        it was written."""
        now = self._clock()
        last, suppressed = self._last.get(cause, (float("-inf"), 0))
        if now - last < self._interval:
            self._last[cause] = (last, suppressed + 1)
            return False
        self._last[cause] = (now, 0)
        if suppressed:
            message += " (%d similar line(s) suppressed)"
            args = (*args, suppressed)
        self._logger.warning(message, *args)
        return True
