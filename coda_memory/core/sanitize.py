"""Untrusted text handling and observation validation.

Everything an observation carries comes from tool results and user messages, so it
is treated as untrusted data. Two kinds of promise live here:

* :func:`clean_text` and :func:`quote_untrusted` make text safe to place inside one
  line of an LLM system prompt: no line breaks, no control characters, bounded length.
* :func:`sanitize_observation` validates an observation before it is stored. It
  either returns an :class:`ObservationRecord` or raises
  :class:`ObservationRejected` with a short, specific reason; it raises nothing else.

"Control characters" means Unicode categories Cc and Cf (which include bidi overrides
and zero-width characters) plus U+2028/U+2029; "lone surrogates" means code points
U+D800..U+DFFF, which cannot be encoded as UTF-8.

Observation policy:

* ``identity_id``: an opaque string, never altered ("A" and "a" are different users,
  SQL-looking text is just text). Rejected if empty, longer than 256 characters, or
  containing NUL or lone surrogates.
* ``session_id``: None, or a string of 1..200 characters without NUL or lone
  surrogates; otherwise rejected.
* ``created_at``: must be timezone-aware; converted to UTC.
* ``content``: control characters other than ``\\n`` and ``\\t`` and lone surrogates
  are removed, then the text is capped at 2,000 characters (truncated with "…",
  not rejected). Every text is read no further than
  :func:`~coda_memory.core.untrusted.read_window` of its cap
  (four times it, plus 64 characters): what lies past that is cut as if past the cap.
* ``metadata``: must be JSON: a dict with string keys whose values are str, int,
  float, bool, None, list or dict, recursively. Rejected for NaN or ±inf, integers
  outside ±(2**63 - 1), any other type (bytes, set, tuple, datetime, objects),
  nesting deeper than 8 containers, two keys equal after cleaning, or a compact UTF-8
  JSON serialisation over 16 KiB (measured after capping). Keys are cleaned like
  ``content``; string values have NUL and lone surrogates removed and are capped at
  1,000 characters. The Postgres store keeps metadata as ``jsonb``, which keeps a
  number's value, not its float form: ``-0.0`` comes back as ``0.0``, and a float with
  a whole value that JSON writes with an exponent (``1e20``) as an integer. A value
  or key of a ``str``, ``int`` or ``float`` subclass is kept as a plain one of its
  value (JSON gives back plain ones, and ``memory://`` keeps what it is given).
* Per type: ``tool_success``/``tool_failure`` need ``toolName`` matching
  :data:`~coda_memory.core.model.TOOL_NAME_PATTERN` (and, when the host gives a tool
  catalog, naming a tool in it); ``durationMs``, if present, is a finite number >= 0
  (a bool is not a number); ``error``, if present, is a string. ``entity_access``
  needs identifiers (:data:`~coda_memory.core.model.IDENTIFIER_PATTERN`) ``entityType``
  and ``entityId`` (an int ``entityId`` is stored as its decimal string);
  ``entityName``, if present, is a string, stored as
  :func:`~coda_memory.core.untrusted.data_text` makes it (one line of data, at most 200
  characters). ``query_pattern`` needs an identifier ``domain``; ``query``, if present,
  is a string. Optional keys that are present with the value None are rejected. These
  checks read each value under its cleaned key, as it is stored.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from coda_memory.core.model import NewObservation, ObservationType, is_identifier, is_tool_name
from coda_memory.core.untrusted import cap, capped, data_text, windowed

MAX_IDENTITY_CHARS = 256
MAX_SESSION_CHARS = 200
MAX_CONTENT_CHARS = 2_000
MAX_METADATA_STRING_CHARS = 1_000
MAX_METADATA_BYTES = 16 * 1024
MAX_METADATA_DEPTH = 8
MAX_METADATA_INT = 2**63 - 1
MAX_ENTITY_NAME_CHARS = 200

_CONTROL_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})
_PROMPT_STRUCTURE_PREFIX = "#>-* "
#: What may not end a quoted name: a backslash (read as escaping the closing quote), as
#: itself or as an escape (``\u005c``, ``\x5c``), nor the space before one.
_QUOTE_ESCAPE_SUFFIX = re.compile(r"(?:\\u005c|\\x5c|[\\ ])+$", re.IGNORECASE)


class ObservationRejected(ValueError):
    """An observation that cannot be stored; ``reason`` says why in a few words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ObservationRecord:
    """An observation that passed :func:`sanitize_observation`, ready to be stored."""

    identity_id: str
    type: ObservationType
    content: str
    metadata: dict[str, Any]
    session_id: str | None
    created_at: datetime


def _is_surrogate(char: str) -> bool:
    return "\ud800" <= char <= "\udfff"


def _is_control(char: str) -> bool:
    return unicodedata.category(char) in _CONTROL_CATEGORIES


def _scrub(value: str, max_chars: int, drop: Callable[[str], bool]) -> str:
    """``value`` without the characters ``drop`` selects, capped at ``max_chars``.

    Reads no further than the cap is certain, nor past its
    :func:`~coda_memory.core.untrusted.read_window`, so a huge
    input costs little.
    """
    value, cut = windowed(value, max_chars)
    if value.isascii() and value.isprintable():
        # The common case: every ``drop`` here spares printable ASCII, so nothing goes.
        return capped(value, max_chars, cut)
    kept: list[str] = []
    for char in value:
        if drop(char):
            continue
        kept.append(char)
        if len(kept) > max_chars:
            break
    return capped("".join(kept), max_chars, cut)


def clean_text(value: str, max_chars: int) -> str:
    """One line of plain text: safe to place inside a single line of a system prompt.

    Removes control characters and lone surrogates, turns every line break, tab or
    other whitespace run into one space, strips both ends and caps the result at
    ``max_chars`` characters (cut text ends in "…"). The result never contains a
    line break. Reads no further than
    :func:`~coda_memory.core.untrusted.read_window`.
    """
    value, cut = windowed(value, max_chars)
    if value.isascii() and value.isprintable():
        # The common case, and a hot path of the prompt section: printable ASCII has no
        # control characters and no whitespace but the plain space.
        return capped(" ".join(value.split()), max_chars, cut)
    return _clean_text_slow(value, max_chars, cut)


def _clean_text_slow(value: str, max_chars: int, cut: bool) -> str:
    kept: list[str] = []
    pending_space = False
    for char in value:
        if char.isspace():
            pending_space = bool(kept)
            continue
        if _is_surrogate(char) or _is_control(char):
            continue
        if pending_space:
            kept.append(" ")
            pending_space = False
        kept.append(char)
        if len(kept) > max_chars:
            break
    return capped("".join(kept), max_chars, cut)


#: What could read as the end of a quoted name, each made a plain single quote: double
#: quotes and backticks; Unicode's initial and final quotation marks (categories Pi and
#: Pf: the curly quotes, guillemets and the supplemental punctuation's); the low and
#: double-prime quotation marks of other categories (U+201A, U+201E, U+2E42, U+301D to
#: U+301F); the Hebrew geresh and gershayim, the ditto mark and the primes (NFKC has
#: already made a double or triple prime of primes); and the quotation ornaments and
#: modifier letters drawn like one (U+275B to U+2760, U+1F676 to U+1F678, U+02BA, U+02EE).
_QUOTE_LIKE = str.maketrans(
    dict.fromkeys(
        '"`'
        "\u00ab\u00bb\u2018\u2019\u201b\u201c\u201d\u201f\u2039\u203a"
        "\u2e02\u2e03\u2e04\u2e05\u2e09\u2e0a\u2e0c\u2e0d\u2e1c\u2e1d\u2e20\u2e21"
        "\u201a\u201e\u2e42\u301d\u301e\u301f"
        "\u05f3\u05f4\u3003\u2032\u2035"
        "\u275b\u275c\u275d\u275e\u2760\U0001f676\U0001f677\U0001f678\u02ba\u02ee",
        "'",
    )
)


#: One of :data:`_QUOTE_LIKE` escaped as JSON or C (``\u0022``, ``\x22``): a model may
#: read the escape as the quote itself. Not a URL's ``%22``: a ``%`` before two hex
#: digits is common in names ("100%Absolute Hits", "5.6%ABV"; ``%AB`` is a guillemet).
_ESCAPE = re.compile(r"\\u([0-9a-f]{4})|\\x([0-9a-f]{2})", re.IGNORECASE)


def _unescaped_quote(match: re.Match[str]) -> str:
    """A ``'`` for an escaped quote-like character; any other escape as it is."""
    code = int(next(group for group in match.groups() if group is not None), 16)
    return "'" if code in _QUOTE_LIKE else match.group()


def _without_escaped_quotes(text: str) -> str:
    """``text`` with each escaped quote-like character (see :data:`_ESCAPE`) a ``'``."""
    if "\\" not in text:
        return text
    return _ESCAPE.sub(_unescaped_quote, text)


def quote_untrusted(value: str, max_chars: int = 80) -> str:
    """``value`` as a double-quoted, single-line name that cannot start prompt structure.

    The text is made data by :func:`~coda_memory.core.untrusted.data_text` (no URL,
    link, tag, role marker or invisible character); double quotes, backticks and every
    character that could read as a closing quote (:data:`_QUOTE_LIKE`) become single
    quotes, also when written as an escape (``\\u0022``, ``\\x22``); leading
    ``#``, ``>``, ``-`` and ``*`` characters are removed, as are trailing backslashes:
    before the closing quote, one reads as escaping it, and the text after the name (the
    entity's id) as outside the quotes. The text between the quotes has at most
    ``max_chars`` characters.
    """
    text = _without_escaped_quotes(data_text(value, 4 * max_chars))
    text = text.translate(_QUOTE_LIKE).lstrip(_PROMPT_STRUCTURE_PREFIX)
    return f'"{_QUOTE_ESCAPE_SUFFIX.sub("", cap(text, max_chars))}"'


def _content_drop(char: str) -> bool:
    return _is_surrogate(char) or (char not in "\n\t" and _is_control(char))


def _value_drop(char: str) -> bool:
    return char == "\x00" or _is_surrogate(char)


def without_nul_or_surrogates(value: str) -> str:
    """``value`` without NUL and lone surrogates (see :func:`has_nul_or_surrogate`)."""
    return _scrub(value, len(value), _value_drop)


def has_nul_or_surrogate(value: str) -> bool:
    """Whether ``value`` holds NUL or a lone surrogate, which no stored text holds (and
    which Postgres and UTF-8 refuse)."""
    if value.isascii():
        return "\x00" in value
    return any(_value_drop(char) for char in value)


def check_identity(identity_id: object) -> str:
    """``identity_id`` as it is stored: a non-empty str of at most
    :data:`MAX_IDENTITY_CHARS` characters without NUL or a lone surrogate, as a plain str
    (a str subclass, such as a str enum, by its value); else ObservationRejected."""
    if not isinstance(identity_id, str):
        raise ObservationRejected("identity_id is not a string")
    if not identity_id:
        raise ObservationRejected("identity_id is empty")
    if len(identity_id) > MAX_IDENTITY_CHARS:
        raise ObservationRejected(f"identity_id is longer than {MAX_IDENTITY_CHARS} characters")
    if has_nul_or_surrogate(identity_id):
        raise ObservationRejected("identity_id contains NUL or a lone surrogate")
    # Its value: str() of a str enum member is "Class.MEMBER", which the store would not
    # find again under the value that load_memory passes.
    return str.__str__(identity_id)


def _check_session(session_id: object) -> str | None:
    if session_id is None:
        return None
    if not isinstance(session_id, str):
        raise ObservationRejected("session_id is not a string")
    if not session_id:
        raise ObservationRejected("session_id is empty")
    if len(session_id) > MAX_SESSION_CHARS:
        raise ObservationRejected(f"session_id is longer than {MAX_SESSION_CHARS} characters")
    if has_nul_or_surrogate(session_id):
        raise ObservationRejected("session_id contains NUL or a lone surrogate")
    return str.__str__(session_id)  # its value (see check_identity)


#: The observation types by value; a member hashes and compares as its value, so it finds
#: itself (what ``ObservationType(value)`` looks up first, at a fifth of its cost).
_TYPES = {member.value: member for member in ObservationType}


def _check_type(value: object) -> ObservationType:
    if isinstance(value, str):
        member = _TYPES.get(value)
        if member is not None:
            return member
    raise ObservationRejected("type is not a known observation type")


#: The first and last instants a datetime holds: Postgres (through asyncpg) stores them
#: as -infinity and infinity, and gives back naive datetimes.
_DATETIME_EDGES = (datetime.min.replace(tzinfo=UTC), datetime.max.replace(tzinfo=UTC))


def _check_created_at(value: object) -> datetime:
    if type(value) is datetime and value.tzinfo is UTC:
        utc = value  # the common case: the service's clock, already in UTC
    elif not isinstance(value, datetime):
        raise ObservationRejected("created_at is not a datetime")
    elif value.tzinfo is None or value.utcoffset() is None:
        raise ObservationRejected("created_at is not timezone-aware")
    else:
        try:
            utc = value.astimezone(UTC)
        except OverflowError:
            raise ObservationRejected("created_at is out of range") from None
    if utc in _DATETIME_EDGES:
        raise ObservationRejected("created_at is the first or last instant of datetime")
    return utc


def _plain(text: str) -> str:
    """``text`` as a plain ``str`` (a subclass's by its value, read without its own
    methods): the stores that keep JSON give back plain strings, and ``memory://``,
    which keeps what it is given, must too (as numbers are kept by their value)."""
    return text if type(text) is str else str.__str__(text)


def _type_name(value: object) -> str:
    return clean_text(type(value).__name__, 40)


#: A metadata key that an error message (and so a log line) may show: a field name. Other
#: keys may be data (an e-mail address keying a dict) and show as ``<key>``.
_SHOWN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


def _child_path(parent: str, key: str | int) -> str:
    """The path of a dict's value (``key`` a cleaned key) or a list's item (an index)."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key if _SHOWN_KEY.fullmatch(key) else '<key>'}"


#: JSON bytes of one character of a string at most (``\u001f``), and of a number, bool or
#: None at most (a float's repr, an int within ±(2**63 - 1)).
_MAX_CHAR_BYTES = 6
_MAX_SCALAR_BYTES = 32


class _MetadataCleaner:
    """One walk over a metadata tree: validates types and returns a cleaned copy.

    A value's path (``metadata.x[1]``) is rendered only for an error message. The walk
    also adds up a bound on the tree's JSON size, so that the exact size (a serialisation)
    is measured only for a tree that may be over the limit.
    """

    def __init__(self) -> None:
        # Every node costs at least one byte of JSON, so counting nodes bounds the
        # work on a huge tree before the exact size check.
        self.nodes = 0
        self.max_bytes = 2
        #: Whether a key was cleaned other than as it is (it may have changed).
        self.renamed = False

    def clean(self, value: object, parent: str, key: str | int, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > MAX_METADATA_BYTES:
            raise ObservationRejected("metadata is larger than 16 KiB")
        if isinstance(value, str):
            self.max_bytes += _MAX_CHAR_BYTES * len(value) + 3  # quotes and a comma
            return _plain(_scrub(value, MAX_METADATA_STRING_CHARS, _value_drop))
        self.max_bytes += _MAX_SCALAR_BYTES
        if value is None or isinstance(value, bool):
            return value
        # A number is checked and stored as its value: a subclass's own abs(), int() or
        # float() may tell of another.
        if isinstance(value, int):
            value = int.__int__(value)
            if abs(value) > MAX_METADATA_INT:
                raise ObservationRejected(f"{_child_path(parent, key)} is an integer out of range")
            return value
        if isinstance(value, float):
            value = float.__float__(value)
            if math.isnan(value):
                raise ObservationRejected(f"{_child_path(parent, key)} is NaN")
            if math.isinf(value):
                raise ObservationRejected(f"{_child_path(parent, key)} is infinite")
            return value
        path = _child_path(parent, key)
        if isinstance(value, list | dict) and depth >= MAX_METADATA_DEPTH:
            raise ObservationRejected(f"metadata is nested deeper than {MAX_METADATA_DEPTH}")
        if isinstance(value, list):
            return [self.clean(item, path, i, depth + 1) for i, item in enumerate(value)]
        if isinstance(value, dict):
            return self.clean_dict(value, path, depth + 1)
        raise ObservationRejected(f"{path} is {_type_name(value)}, not a JSON value")

    def clean_dict(self, value: dict[Any, Any], path: str, depth: int) -> dict[str, Any]:
        cleaned: dict[str, Any] = {}
        for key, item in dict.items(value):
            if not isinstance(key, str):
                raise ObservationRejected(f"{path} has a key of type {_type_name(key)}")
            if key.isascii() and key.isprintable() and len(key) <= MAX_CONTENT_CHARS:
                clean_key = key if type(key) is str else _plain(key)  # (as _scrub finds it)
            else:
                clean_key = _plain(_scrub(key, MAX_CONTENT_CHARS, _content_drop))
                self.renamed = True
            if clean_key in cleaned:
                raise ObservationRejected(
                    f"{_child_path(path, clean_key)} appears twice after cleaning"
                )
            if (
                type(item) is str
                and item.isascii()
                and item.isprintable()
                and len(item) <= MAX_METADATA_STRING_CHARS
            ):
                # The common value, as clean() would take it, without the call.
                self.nodes += 1
                if self.nodes > MAX_METADATA_BYTES:  # (400,000 keys: 0.5 s of the writer)
                    raise ObservationRejected("metadata is larger than 16 KiB")
                self.max_bytes += _MAX_CHAR_BYTES * (len(clean_key) + len(item)) + 6
                cleaned[clean_key] = item
                continue
            self.max_bytes += _MAX_CHAR_BYTES * len(clean_key) + 3  # quotes and a colon
            cleaned[clean_key] = self.clean(item, path, clean_key, depth)
        return cleaned


def _clean_metadata(metadata: dict[Any, Any]) -> tuple[dict[str, Any], dict[Any, Any]]:
    """The metadata cleaned, and its values as given under their cleaned keys, which the
    checks of a type read: a key that cleaning changed (a zero-width character in
    ``durationMs``) was stored under the name the checks looked for, unchecked; and a
    dict subclass is read by its items, as it is stored, not by its own ``get``."""
    cleaner = _MetadataCleaner()
    cleaned = cleaner.clean_dict(metadata, "metadata", 1)
    if cleaner.max_bytes > MAX_METADATA_BYTES:
        size = len(json.dumps(cleaned, separators=(",", ":"), ensure_ascii=False).encode())
        if size > MAX_METADATA_BYTES:
            raise ObservationRejected("metadata is larger than 16 KiB")
    if not cleaner.renamed and type(metadata) is dict:
        return cleaned, metadata
    # (The keys are strings and none repeats after cleaning: the walk checked it.)
    return cleaned, dict(zip(cleaned, dict.values(metadata), strict=True))


def _require_identifier(raw: dict[Any, Any], key: str) -> str:
    value = raw.get(key)
    if value is None:
        raise ObservationRejected(f"metadata.{key} is missing")
    if not is_identifier(value):
        raise ObservationRejected(f"metadata.{key} does not match the identifier pattern")
    return str(value)


def _optional_string(raw: dict[Any, Any], key: str) -> None:
    if key in raw and not isinstance(raw[key], str):
        raise ObservationRejected(f"metadata.{key} is not a string")


def _check_tool(
    raw: dict[Any, Any], cleaned: dict[str, Any], tool_catalog: Collection[str] | None
) -> None:
    name = raw.get("toolName")
    if name is None:
        raise ObservationRejected("metadata.toolName is missing")
    if not is_tool_name(name):
        raise ObservationRejected("metadata.toolName does not match the identifier pattern")
    if tool_catalog is not None and name not in tool_catalog:
        raise ObservationRejected("metadata.toolName is not in the tool catalog")
    if "durationMs" in raw:
        duration = cleaned["durationMs"]  # (a number as its value: see _MetadataCleaner)
        if isinstance(duration, bool) or not isinstance(duration, int | float):
            raise ObservationRejected("metadata.durationMs is not a number")
        if isinstance(duration, float) and math.isnan(duration):
            raise ObservationRejected("metadata.durationMs is NaN")
        if duration < 0:
            raise ObservationRejected("metadata.durationMs is negative")
        if isinstance(duration, float) and math.isinf(duration):
            raise ObservationRejected("metadata.durationMs is infinite")
    _optional_string(raw, "error")


def _check_entity(raw: dict[Any, Any], cleaned: dict[str, Any]) -> None:
    _require_identifier(raw, "entityType")
    entity_id = raw.get("entityId")
    if isinstance(entity_id, int) and not isinstance(entity_id, bool):
        # By its value (the metadata walk's, range-checked, so the conversion is cheap):
        # an int subclass's own str() may say anything ("a count" was rejected).
        entity_id = cleaned["entityId"] = str(cleaned["entityId"])
    if entity_id is None:
        raise ObservationRejected("metadata.entityId is missing")
    if not is_identifier(entity_id):
        raise ObservationRejected("metadata.entityId does not match the identifier pattern")
    # (A string id is kept as the metadata walk made it: plain, and whole, as an
    # identifier has nothing that the walk removes and is shorter than its cap.)
    _optional_string(raw, "entityName")
    if "entityName" in cleaned:
        cleaned["entityName"] = data_text(cleaned["entityName"], MAX_ENTITY_NAME_CHARS)


def _check_query(raw: dict[Any, Any]) -> None:
    _require_identifier(raw, "domain")
    _optional_string(raw, "query")


def _unexpected(error: Exception) -> ObservationRejected:
    """The rejection of an observation one of whose values raised as it was read (a host's
    object: a str subclass whose ``len()`` raises, a property), named by the error's class
    alone: its message may quote what the value held."""
    return ObservationRejected(f"unexpected {type(error).__name__}")


def sanitize_observation(
    identity_id: str,
    obs: NewObservation,
    created_at: datetime,
    tool_catalog: Collection[str] | None = None,
) -> ObservationRecord:
    """Validate and clean one observation following the module's policy.

    With ``tool_catalog``, a tool observation naming any other tool is rejected.
    Returns the storable form, or raises :class:`ObservationRejected` with a specific
    reason; no other exception escapes, whatever the input.
    """
    try:
        fields = (
            getattr(obs, "type", None),
            getattr(obs, "content", None),
            getattr(obs, "metadata", None),
            getattr(obs, "session_id", None),
        )
    except Exception as error:  # an observation of the host's own, whose property raised
        raise _unexpected(error) from None
    return sanitize_fields(identity_id, *fields, created_at, tool_catalog)


def sanitize_fields(
    identity_id: str,
    obs_type: object,
    content: object,
    metadata: object,
    session_id: object,
    created_at: datetime,
    tool_catalog: Collection[str] | None = None,
) -> ObservationRecord:
    """:func:`sanitize_observation` of an observation given by its fields (the type as
    an :class:`ObservationType` or its value): the writer's queue keeps them so."""
    try:
        identity = check_identity(identity_id)
        kind = _check_type(obs_type)
        if not isinstance(content, str):
            raise ObservationRejected("content is not a string")
        session = _check_session(session_id)
        at = _check_created_at(created_at)
        raw = metadata
        if not isinstance(raw, dict):
            raise ObservationRejected(f"metadata is {_type_name(raw)}, not a dict")
        cleaned, raw = _clean_metadata(raw)
        if kind in (ObservationType.TOOL_SUCCESS, ObservationType.TOOL_FAILURE):
            _check_tool(raw, cleaned, tool_catalog)
        elif kind is ObservationType.ENTITY_ACCESS:
            _check_entity(raw, cleaned)
        else:
            _check_query(raw)
        return ObservationRecord(
            identity_id=identity,
            type=kind,
            content=_plain(_scrub(content, MAX_CONTENT_CHARS, _content_drop)),
            metadata=cleaned,
            session_id=session,
            created_at=at,
        )
    except ObservationRejected:
        raise
    except Exception as error:  # a value's own method (a str subclass's len())
        raise _unexpected(error) from None
