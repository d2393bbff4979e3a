"""The original server's JSON: observations and facts in camelCase, times in epoch ms.

Writing follows ``JSON.stringify``: compact separators, non-ASCII text as is, and (in
facts) an integral number without a fractional part, so a record coda-memory writes is
the record the original TypeScript server would have written, plus extra fields it
ignores (an observation's metadata keeps Python's number forms, ``84.0``, ``1e-07``,
which JSON readers read as the same numbers):

* observations: ``id`` (a decimal string), ``identityId``, ``type``, ``content``,
  ``metadata``, ``createdAt``, and ``sessionId`` when there is one;
* facts: ``id``, ``identityId``, ``category``, ``subject``, ``content``, ``confidence``,
  ``reinforcementCount``, ``lastReinforcedAt``, ``createdAt``, ``updatedAt``,
  ``easeFactor`` when there is one, and ``confidenceAt``: the instant ``confidence``
  refers to. The original server wrote the decayed confidence back at every
  consolidation, together with ``updatedAt``; so a fact without ``confidenceAt`` has its
  confidence anchored at ``updatedAt``.

Reading validates at this boundary: a record that does not parse, has an unknown type or
category, or an impossible value raises :class:`BadRecord` with a short reason.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from coda_memory.core.model import (
    MAX_REINFORCEMENT_COUNT,
    Fact,
    FactCategory,
    FactEvent,
    FactEventKind,
    NewObservation,
    Observation,
    ObservationType,
    trusted,
)
from coda_memory.core.sanitize import (
    MAX_SESSION_CHARS,
    ObservationRecord,
    ObservationRejected,
    has_nul_or_surrogate,
    sanitize_observation,
    without_nul_or_surrogates,
)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Epoch ms beyond which a time is impossible here (datetime's range ends at year 9999).
_MAX_MS = 253_402_300_799_999
#: 0001-01-01T00:00:00Z: the writer takes any time after it, so a read must too (not
#: that instant, ``datetime.min``, which Postgres would keep as -infinity).
_MIN_MS = -62_135_596_800_000
#: The largest reinforcement count: Postgres stores it as an integer.
MAX_COUNT = MAX_REINFORCEMENT_COUNT
#: The longest subject a fact may have: more than any coda-memory makes (a category, a
#: tool name of up to 128 characters, or an entity's type and id of up to 200 each), and
#: far less than what Postgres indexes with the identity (2,704 bytes).
MAX_SUBJECT_CHARS = 500


class BadRecord(ValueError):
    """A stored record coda-memory cannot use; the message says why."""


def dumps(value: Any) -> str:
    """Compact JSON as ``JSON.stringify`` writes it (NaN and infinities refused)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def to_ms(at: datetime) -> int | float:
    """Epoch milliseconds; a whole number unless ``at`` has a sub-millisecond part.

    A fraction is a double, which holds the microsecond from 1692 through 2247, beyond
    only roughly (its step is 8 µs in year 1, 31 µs in year 9999): the nearest double
    to an instant a few microseconds inside datetime's range is the range's edge, which
    a read refuses (``datetime.min`` is the instant Postgres keeps as -infinity). Such
    an instant is written as the nearest double inside the range instead, and so reads
    back a few microseconds off rather than not at all."""
    delta = at - _EPOCH
    micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    whole, rest = divmod(micros, 1000)
    if rest == 0:
        return whole
    value = micros / 1000
    if not _MIN_MS < value < _MAX_MS + 1:
        value = math.nextafter(value, 0.0)
    return value


#: A checkpoint field as the stores write it: epoch ms in decimal. Anything else is
#: refused, by the store's scripts (``load.lua``, ``peek.lua``) and by the import alike:
#: read as no checkpoint, every observation consumed before would count again.
CHECKPOINT_TEXT = re.compile(r"-?[0-9]+\.?[0-9]*")


def checkpoint_ms(raw: bytes | str) -> float:
    """The epoch ms of a checkpoint field, checked as the scripts check it
    (:data:`CHECKPOINT_TEXT`, and within the range of dates); :class:`BadRecord` saying
    why, without the value (something else may have written anything there)."""
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        raise BadRecord("the checkpoint is not text") from None
    if not CHECKPOINT_TEXT.fullmatch(text):
        raise BadRecord("the checkpoint is not epoch ms in decimal")
    value = float(text)
    from_ms(value, "the checkpoint")
    return value


def from_ms(value: object, field: str) -> datetime:
    """The UTC datetime of an epoch-ms number; :class:`BadRecord` for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRecord(f"{field} is not a number")
    if isinstance(value, int):  # the common case, exact
        if not _MIN_MS < value <= _MAX_MS:
            raise BadRecord(f"{field} is out of range")
        return _EPOCH + timedelta(milliseconds=value)
    # A fraction of the last whole millisecond is in range too.
    if not math.isfinite(value) or not _MIN_MS < value < _MAX_MS + 1:
        raise BadRecord(f"{field} is out of range")
    # The fraction apart (exact), so that the microseconds are the double's nearest:
    # ``round(value * 1000)`` rounded the product first, and read some instants written
    # in 1830 or 2110 a microsecond off.
    whole = math.floor(value)
    return _EPOCH + timedelta(microseconds=whole * 1000 + round((value - whole) * 1000))


def _number(value: float) -> int | float:
    """``value`` as ``JSON.stringify`` would print it: 1.0 as 1."""
    return int(value) if value.is_integer() and abs(value) < 2**53 else value


def _object(raw: str | bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRecord(f"not JSON ({type(exc).__name__})") from exc
    if not isinstance(value, dict):
        raise BadRecord("not a JSON object")
    return value


def _identity(value: dict[str, Any], identity_id: str) -> None:
    owner = value.get("identityId")
    if owner is not None and owner != identity_id:
        raise BadRecord("identityId does not match its key")


# -- observations -----------------------------------------------------------------------


def observation_body(record: ObservationRecord) -> str:
    """An observation's JSON without its ``id``: ``"identityId":…}``, everything after the
    opening brace. The append script puts ``{"id":"<sequence>",`` in front of it."""
    value: dict[str, Any] = {
        "identityId": record.identity_id,
        "type": record.type.value,
        "content": record.content,
        "metadata": record.metadata,
        "createdAt": to_ms(record.created_at),
    }
    if record.session_id is not None:
        value["sessionId"] = record.session_id
    return dumps(value)[1:]


def _observation_id(raw: object) -> int:
    """An integer id: ours are decimal strings; the original server's are turned into a
    stable 63-bit number (used for display only, never as a cursor)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    text = str(raw)
    if text.isdigit() and len(text) < 19:
        return int(text)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest()) >> 1


#: A stored name that a reason may quote: a short identifier, not text a record carried.
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,40}")


def _shown(value: object) -> str:
    """``value`` for a reason (logged, and listed by import-redis): quoted when it is a
    short name (``'tool_maybe'``), else only its kind and size, since a corrupt record's
    field may hold anything, personal data or a megabyte of it."""
    if isinstance(value, str):
        return repr(value) if _NAME.fullmatch(value) else f"(a string of {len(value):,} characters)"
    return f"(of type {type(value).__name__})"


def observation_from_json(identity_id: str, raw: str | bytes) -> Observation:
    """An observation from its stored JSON, checked for shape: known type, text content,
    object metadata, a valid ``createdAt``, a string ``sessionId`` if any. Whether the
    metadata can become a fact is consolidation's business (unusable metadata is skipped
    there), and :func:`sanitized` cleans the text for another store."""
    value = _object(raw)
    _identity(value, identity_id)
    if "id" not in value:
        raise BadRecord("observation has no id")
    try:
        kind = ObservationType(str(value.get("type")))
    except ValueError as exc:
        raise BadRecord(f"unknown observation type {_shown(value.get('type'))}") from exc
    content, metadata = value.get("content"), value.get("metadata", {})
    session_id = value.get("sessionId")
    if not isinstance(content, str):
        raise BadRecord("content is not a string")
    if not isinstance(metadata, dict):
        raise BadRecord("metadata is not an object")
    if session_id is not None and not isinstance(session_id, str):
        raise BadRecord("sessionId is not a string")
    if session_id is not None and has_nul_or_surrogate(session_id):
        # A consolidation writes the session id back (its events, its record), and a
        # lone surrogate cannot be encoded: every commit of the identity failed.
        raise BadRecord("sessionId holds a NUL character or a lone surrogate")
    return trusted(
        Observation,
        id=_observation_id(value["id"]),
        identity_id=identity_id,
        type=kind,
        content=content,
        metadata=metadata,
        session_id=session_id,
        created_at=from_ms(value.get("createdAt"), "createdAt"),
    )


#: The optional metadata a stored observation may hold in a form a live server refuses
#: (the original server wrote what its tools gave): no fact depends on them.
_OPTIONAL_METADATA = re.compile(r"metadata\.(durationMs|error|entityName|query)\b")
#: The metadata that facts and the analytics rollup read: all an observation keeps when
#: the rest makes its metadata one a live server refuses (too large, too deep).
_READ_METADATA = frozenset(
    {"toolName", "durationMs", "entityType", "entityId", "entityName", "domain"}
)


def sanitized(observation: Observation) -> ObservationRecord:
    """The observation validated and cleaned as if it were emitted now (for a copy into
    another store); :class:`BadRecord` with the reason when it would be rejected. An
    optional value a live server would refuse (:data:`_OPTIONAL_METADATA`: a negative
    ``durationMs``, an ``error`` that is not a string, a null ``entityName`` or
    ``query``) is dropped instead, as it makes no fact: the Redis store consolidates the
    observation, so the copy must hold it too. So are the keys no fact or rollup reads
    (:data:`_READ_METADATA` stays) when they make the metadata too large or too deep."""
    metadata = observation.metadata
    while True:
        emitted = NewObservation.model_construct(
            type=observation.type,
            content=observation.content,
            metadata=metadata,
            session_id=observation.session_id,
            created_at=observation.created_at,
        )
        try:
            return sanitize_observation(observation.identity_id, emitted, observation.created_at)
        except ObservationRejected as exc:
            optional = _OPTIONAL_METADATA.match(exc.reason)
            if optional is not None and optional[1] in metadata:
                metadata = {k: v for k, v in metadata.items() if k != optional[1]}
                continue
            read = {k: v for k, v in metadata.items() if k in _READ_METADATA}
            if not exc.reason.startswith("metadata") or read == metadata:
                raise BadRecord(exc.reason) from exc
            metadata = read


# -- facts ------------------------------------------------------------------------------


def fact_json(fact: Fact, stored_id: str | None = None) -> str:
    """A fact in the original shape (plus ``confidenceAt``), under ``stored_id`` if the
    hash already holds it under another id."""
    value: dict[str, Any] = {
        "id": stored_id or fact.id,
        "identityId": fact.identity_id,
        "category": fact.category.value,
        "subject": fact.subject,
        "content": fact.content,
        "confidence": _number(fact.confidence),
        "reinforcementCount": fact.reinforcement_count,
        "lastReinforcedAt": to_ms(fact.last_reinforced_at),
        "createdAt": to_ms(fact.created_at),
        "updatedAt": to_ms(fact.updated_at),
    }
    if fact.ease_factor is not None:
        value["easeFactor"] = _number(fact.ease_factor)
    value["confidenceAt"] = to_ms(fact.anchor)
    return dumps(value)


def _probability(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRecord(f"{field} is not a finite number")
    if not 0.0 <= value <= 1.0:
        raise BadRecord(f"{field} {value!r} is outside 0..1")
    return float(value)


def _text(value: dict[str, Any], field: str) -> str:
    """A name (an id, a subject, a session id): one a store could not hold, or that
    would name another record once cleaned, is a bad record."""
    text = value.get(field)
    if not isinstance(text, str) or not text:
        raise BadRecord(f"{field} is not a non-empty string")
    if has_nul_or_surrogate(text):  # Postgres text and UTF-8 cannot hold them
        raise BadRecord(f"{field} holds a NUL character or a lone surrogate")
    return text


def _content(value: dict[str, Any]) -> str:
    """A fact's text, without what a store cannot hold: a NUL, or a lone surrogate (the
    half of an emoji that a JavaScript ``slice`` cut)."""
    text = value.get("content")
    return without_nul_or_surrogates(text) if isinstance(text, str) else ""


def _subject(value: dict[str, Any]) -> str:
    subject = _text(value, "subject")
    if len(subject) > MAX_SUBJECT_CHARS:
        raise BadRecord(f"subject is longer than {MAX_SUBJECT_CHARS} characters")
    return subject


def fact_from_json(identity_id: str, raw: str | bytes) -> Fact:
    """A fact from its stored JSON; ``confidenceAt`` defaults to ``updatedAt``."""
    value = _object(raw)
    _identity(value, identity_id)
    try:
        category = FactCategory(str(value.get("category")))
    except ValueError as exc:
        raise BadRecord(f"unknown fact category {_shown(value.get('category'))}") from exc
    count = value.get("reinforcementCount")
    if isinstance(count, float) and count.is_integer():
        count = int(count)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_COUNT:
        raise BadRecord(f"reinforcementCount is not an integer from 1 to {MAX_COUNT}")
    ease = value.get("easeFactor")
    if ease is not None and (
        isinstance(ease, bool)
        or not isinstance(ease, int | float)
        or not math.isfinite(ease)
        or ease <= 0
    ):
        raise BadRecord("easeFactor is not a positive number")
    subject = _subject(value)
    if not subject.startswith(f"{category.value}:"):
        # Every fact's subject is its category and key ("tool_affinity:get_account"):
        # one of another category would be ranked, shown and netted as that one.
        raise BadRecord(f"subject does not begin with its category {category.value!r}")
    updated_at = from_ms(value.get("updatedAt"), "updatedAt")
    anchor = value.get("confidenceAt")
    return trusted(
        Fact,
        id=_text(value, "id"),
        identity_id=identity_id,
        category=category,
        subject=subject,
        content=_content(value),
        confidence=_probability(value.get("confidence"), "confidence"),
        reinforcement_count=count,
        last_reinforced_at=from_ms(value.get("lastReinforcedAt"), "lastReinforcedAt"),
        created_at=from_ms(value.get("createdAt"), "createdAt"),
        updated_at=updated_at,
        ease_factor=None if ease is None else float(ease),
        confidence_at=updated_at if anchor is None else from_ms(anchor, "confidenceAt"),
    )


#: Which of two facts about one subject every reader keeps (see :func:`one_per_subject`).
SUBJECT_RULE = (
    "the one of later confidenceAt (else updatedAt) is kept, then of higher confidence,"
    " then of smaller id, then of smaller stored JSON"
)


def one_per_subject(facts: Sequence[tuple[Fact, bytes | str]]) -> tuple[list[Fact], list[Fact]]:
    """The facts of ``facts`` (each with its stored JSON) with one per subject, in their
    order, and those left out.

    The original server's layout could hold two facts about one subject in an identity's
    hash (under two fields); every store keeps one per subject. Which one is one rule for
    every reader (the Redis store's reads, its consolidation, the import), so that none
    reads a fact another left out: the later anchor (``confidenceAt``, else
    ``updatedAt``: the stored confidences are as of their anchors, so a fact untouched for
    a year would outrank one reinforced yesterday by its older, higher confidence), then
    the higher ``confidence``, then the smaller ``id`` (the hash's field: the layout keys
    a fact by its id), then the smaller stored JSON, so that even two facts alike in all
    of these are told apart the same way by every reader."""
    best: dict[str, tuple[Fact, bytes]] = {}
    for fact, raw in facts:
        stored = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
        held = best.get(fact.subject)
        if held is None or _outranks((fact, stored), held):
            best[fact.subject] = (fact, stored)
    kept = [fact for fact, _ in facts if best[fact.subject][0] is fact]
    return kept, [fact for fact, _ in facts if best[fact.subject][0] is not fact]


def _outranks(fact: tuple[Fact, bytes], other: tuple[Fact, bytes]) -> bool:
    """Whether ``fact`` is kept rather than ``other``, about the same subject."""
    (one, one_raw), (two, two_raw) = fact, other
    ranked, other_ranked = (one.anchor, one.confidence), (two.anchor, two.confidence)
    if ranked != other_ranked:
        return ranked > other_ranked
    return (one.id, one_raw) < (two.id, two_raw)


# -- fact events (coda-memory's own keys) -----------------------------------------------


def event_value(event: FactEvent) -> dict[str, Any]:
    """A fact event as a camelCase JSON object (``at`` in epoch ms)."""
    return {
        "identityId": event.identity_id,
        "subject": event.subject,
        "category": event.category.value,
        "kind": event.kind.value,
        "sessionId": event.session_id,
        "at": to_ms(event.at),
        "confidenceBefore": event.confidence_before,
        "confidenceAfter": event.confidence_after,
        "countBefore": event.count_before,
        "countAfter": event.count_after,
        "easeBefore": event.ease_before,
        "easeAfter": event.ease_after,
        "quality": event.quality,
        "hits": event.hits,
        "trials": event.trials,
    }


def _checked(value: dict[str, Any], name: str, kind: str, low: float, high: float) -> None:
    """``value[name]`` is None or a number of ``kind`` (``int``: a whole one) within
    ``[low, high]``; :class:`BadRecord` naming the field otherwise (not its value)."""
    number = value.get(name)
    if number is None:
        return
    if isinstance(number, bool) or not isinstance(number, int | float):
        raise BadRecord(f"{name} is not a number")
    if kind == "int" and not isinstance(number, int):
        raise BadRecord(f"{name} is not a whole number")
    if not (math.isfinite(number) and low <= number <= high):
        raise BadRecord(f"{name} is out of range")


def checked_event_from_value(identity_id: str, value: object) -> FactEvent:
    """A fact event read from keys that anything may have written (a copy into another
    store): each field is of the type and within the range the stores keep, or
    :class:`BadRecord` names the field. :func:`event_from_value` trusts the record."""
    if not isinstance(value, dict):
        raise BadRecord("not a JSON object")
    subject = _subject(value)
    session = None if value.get("sessionId") is None else _text(value, "sessionId")
    if session is not None and len(session) > MAX_SESSION_CHARS:
        raise BadRecord(f"sessionId is longer than {MAX_SESSION_CHARS} characters")
    for name in ("confidenceBefore", "confidenceAfter", "quality"):
        _checked(value, name, "float", 0.0, 1.0)
    for name in ("easeBefore", "easeAfter"):
        _checked(value, name, "float", math.ulp(0.0), math.inf)
    for name in ("countBefore", "countAfter", "hits", "trials"):
        _checked(value, name, "int", 0, MAX_COUNT)
    for name in ("hits", "trials"):
        if value.get(name) is None:
            raise BadRecord(f"{name} is missing")
    try:
        category, kind = FactCategory(value["category"]), FactEventKind(value["kind"])
    except (KeyError, ValueError, TypeError):
        raise BadRecord("category or kind is missing or unknown") from None
    if not subject.startswith(f"{category.value}:"):
        raise BadRecord("subject is not of its category")
    try:
        return event_from_value(identity_id, {**value, "category": category, "kind": kind})
    except KeyError as exc:
        raise BadRecord(f"{exc.args[0]} is missing") from None


def event_from_value(identity_id: str, value: dict[str, Any]) -> FactEvent:
    """A fact event coda-memory wrote (trusted: only coda-memory writes these keys)."""
    return trusted(
        FactEvent,
        identity_id=identity_id,
        subject=value["subject"],
        category=FactCategory(value["category"]),
        kind=FactEventKind(value["kind"]),
        session_id=value["sessionId"],
        at=from_ms(value["at"], "at"),
        confidence_before=value["confidenceBefore"],
        confidence_after=value["confidenceAfter"],
        count_before=value["countBefore"],
        count_after=value["countAfter"],
        ease_before=value["easeBefore"],
        ease_after=value["easeAfter"],
        quality=value["quality"],
        hits=value["hits"],
        trials=value["trials"],
    )
