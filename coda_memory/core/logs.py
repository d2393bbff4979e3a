"""What log lines say: no identity ids by default, no statements or parameters.

* Rate limiting per cause is :class:`~coda_memory.core.caps.LogThrottle`'s.
* :func:`identity_label` shows an identity id as a stable short hash (8 hex digits of
  BLAKE2b), unless the service was built with ``log_identities=True``: the same user has
  the same label in every line, and no e-mail address or name reaches the logs.
* :func:`short_error` is an exception's class and the first line of its message, with the
  identity ids it names replaced by their labels: never a statement or its parameters
  (SQLAlchemy adds those to its messages' later lines), never a traceback.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

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
        message = without_identities(message, identities)
    message = message[:MAX_MESSAGE_CHARS]
    name = type(error).__name__
    return f"{name}: {message}" if message else name


def without_identities(text: str, identities: Iterable[object]) -> str:
    """``text`` with each of ``identities`` in it, quoted or bare, replaced by its label;
    not where it is part of a longer word (identity ``cat`` leaves ``tool_catalog``
    alone)."""
    for identity in identities:
        if identity and isinstance(identity, str):
            label = identity_label(identity)
            text = text.replace(repr(identity), label)
            text = re.sub(rf"(?<!\w){re.escape(identity)}(?!\w)", label, text)
    return text
