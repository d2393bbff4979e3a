"""What log lines say: no identity ids by default, no statements or parameters.

* Rate limiting per cause is :class:`~coda_memory.core.caps.LogThrottle`'s.
* :func:`identity_label` shows an identity id as a short keyed hash (12 hex digits of
  BLAKE2b under a secret key), unless the service was built with ``log_identities=True``:
  the same user has the same label in every line, and no e-mail address or name reaches
  the logs. Without the key, a list of candidate ids does not tell which one a label
  stands for. The key is drawn at random when the module is loaded (labels hold within
  the process), or given by the host with :func:`set_log_key` (the same key gives the
  same labels in every process).
* :func:`short_error` is an exception's class and the first line of its message, with the
  identity ids it names replaced by their labels: never a statement or its parameters
  (SQLAlchemy adds those to its messages' later lines), never a traceback.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable

#: Characters of a message's first line that a log line keeps.
MAX_MESSAGE_CHARS = 200


class _LabelKey:
    """The labels' key (one per process, as the logging configuration is)."""

    value: bytes = secrets.token_bytes(32)


def set_log_key(key: str | bytes | None) -> None:
    """Key the identity labels of log lines with ``key`` (a secret of any length), so
    that processes given the same key label a user alike (workers, restarts); None draws
    a random key again. Labels made before the call are not those made after it."""
    if key is None:
        _LabelKey.value = secrets.token_bytes(32)
        return
    if isinstance(key, str):
        key = key.encode("utf-8", "surrogatepass")
    if not isinstance(key, bytes):
        raise TypeError(f"the log key must be str or bytes, not {type(key).__name__}")
    if not key:
        raise ValueError("the log key is empty: it would be no secret")
    _LabelKey.value = hashlib.blake2b(key, digest_size=32).digest()


def _repr(value: object) -> str:
    """``repr(value)``, which never raises: a string's as a plain ``str``'s (a subclass's
    own may raise), another object's, else its class's name (a host's object whose
    ``__repr__`` raises must not stop the writer that logs it)."""
    if isinstance(value, str):
        return str.__repr__(value)
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__}>"


def identity_label(identity_id: object, *, show: bool = False) -> str:
    """How a log line names an identity: a short keyed hash, or (``show``) the id."""
    if show:
        return _repr(identity_id)[:80]
    raw = str.__str__(identity_id) if isinstance(identity_id, str) else _repr(identity_id)
    data = raw.encode("utf-8", "surrogatepass")
    return f"id:{hashlib.blake2b(data, digest_size=6, key=_LabelKey.value).hexdigest()}"


#: asyncpg's message for a value its codec refused quotes the value (the start of its
#: ``repr``) on the first line, and its reason may quote it again: ``invalid input for
#: query argument $3: 'the value' (invalid UUID 'the value': length must be …)``.
_ARGUMENT_VALUE = re.compile(r"(invalid input for query argument \$\d+: ).*( \()(.*)")
_QUOTED_IN_REASON = re.compile(r"'[^']*'")
#: The server's messages for a value it refused quote it: before ``is out of range``
#: (``value "…" is out of range for type integer``, ``"…" is out of range for type
#: double precision``), last after a colon (``invalid input syntax for type double
#: precision: "…"``, ``malformed array literal: "…"``), or as ``invalid value "…" for
#: "YYYY"`` and ``time zone "…" not recognized``. A value may hold a quote, so each
#: goes from its opening quote on (to the end of the line but for a known tail). The
#: names a message quotes (constraints, tables) come elsewhere, and stay.
_SERVER_VALUES = (
    (re.compile(r'"[^\n]*"( is out of range)'), r'"<value>"\1'),
    (re.compile(r'(invalid value )".*"( for "[^"\n]*")$'), r'\1"<value>"\2'),
    (re.compile(r'(time zone )".*"( not recognized)$'), r'\1"<value>"\2'),
    # (Without their tail: cut at a line break. And not one redacted already.)
    (re.compile(r'(: |invalid value |time zone )"(?!<value>").*'), r'\1"<value>"'),
)


def without_argument_values(text: str) -> str:
    """``text`` (a message's first line) without the value a driver's or the server's
    message quotes for a value it refused (replaced by ``<value>``): it may be a tenant's
    data."""
    found = _ARGUMENT_VALUE.search(text)
    if found is not None:
        reason = _QUOTED_IN_REASON.sub("'<value>'", found[3])
        text = f"{text[: found.start()]}{found[1]}<value>{found[2]}{reason}"
    for pattern, replacement in _SERVER_VALUES:
        text = pattern.sub(replacement, text)
    if text.count('"') % 2:
        # A quote left open: a value with a line break in it, cut at the line's end.
        text = text[: text.rindex('"')] + '"<value>"'
    return text


def short_error(
    error: BaseException, identities: tuple[str, ...] = (), *, show: bool = False
) -> str:
    """``Class: first line of the message``, capped; ``identities`` in it become labels,
    and a query argument's value quoted by the driver goes."""
    lines = str(error).strip().splitlines()
    message = without_argument_values(lines[0]) if lines else ""
    if not show:
        message = without_identities(message, identities)
    message = message[:MAX_MESSAGE_CHARS]
    name = type(error).__name__
    return f"{name}: {message}" if message else name


def without_identities(text: str, identities: Iterable[object]) -> str:
    """``text`` with each of ``identities`` in it, quoted or bare, replaced by its label;
    not where it is part of a longer word (identity ``cat`` leaves ``tool_catalog``
    alone). An identity that is not a ``str`` is left out, and a subclass's is read as
    a plain ``str``: a host's object whose truth value raises (an array's) made the
    writer's line for its rejection raise."""
    for identity in identities:
        if not isinstance(identity, str):
            continue
        identity = str.__str__(identity)
        if not identity:
            continue
        quoted = _repr(identity)
        # (Most texts name none: a rejection's reason, made for every one, before the
        # throttle drops its line. Its pattern, compiled for each identity, cost 36 us.)
        if identity not in text and quoted not in text:
            continue
        label = identity_label(identity)
        text = text.replace(quoted, label)
        text = re.sub(rf"(?<!\w){re.escape(identity)}(?!\w)", label, text)
    return text


#: A password given as a query parameter of a URL.
_QUERY_PASSWORD = re.compile(r"([?&](?:ssl)?password=)[^&#]*", re.IGNORECASE)


def masked_url(url: str) -> str:
    """``url`` with its password shown as ``***``: everything between the user's ``:``
    and the last ``@``, which a password may hold (unencoded ``/``, ``@`` or ``#`` too),
    and the value of a ``password`` or ``sslpassword`` query parameter."""
    scheme, separator, rest = url.partition("://")
    if not separator:
        return url
    userinfo, at, host = rest.rpartition("@")
    host = _QUERY_PASSWORD.sub(r"\1***", host)
    if not at:
        return f"{scheme}://{host}"
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{host}"
