"""JSON documents of rows: how the writer's statement takes a batch of observations.

``observations_insert.sql`` takes its rows as one JSON array of arrays (one array per
row, its values in a fixed order) and reads them with ``jsonb_array_elements``, rather
than as one Postgres array per column. The driver checks every element of an array
parameter in Python, a few abstract-base-class checks each; one JSON text is made by
one call of orjson's encoder (compiled; a tenth of the standard library's C encoder's
time on a batch of observations, and it writes an aware datetime as ISO 8601 itself),
and the server parses it about as fast as the arrays. The consolidation's write takes
its facts and events so too (:func:`rows_document`): the arguments of a plan of 600 rows
(the backlog that a held table leaves) took 6.5 ms to build and encode as arrays, in one
go, and 1 ms as documents; a typical plan's write took 3.2 ms instead of 3.6. The copy
of an identity from Redis (``redis_import_rest.sql``) takes its facts and events as the
same rows (:func:`fact_row`, :func:`event_row`).

Values travel as JSON does: strings, numbers (a float as its shortest repr, read back
exactly by ``::float8``), true, false and null; an instant as its ISO 8601 text with
its offset (:func:`instant`), read back exactly by ``::timestamptz``.

orjson writes NaN and the infinities as ``null`` (jsonb has no such numbers):
:func:`document` refuses them itself, so that a row holding one is refused rather than
stored with a null in its place. What orjson refuses (an integer beyond 64 bits, which
jsonb holds as a numeric; a lone surrogate) goes to the standard library's encoder, as
before orjson.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import orjson

from coda_memory.core.model import Fact, FactEvent


class NotJson(ValueError):
    """A value that JSON cannot hold: not a JSON type, NaN or an infinity."""


def _iso(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON")


#: The standard library's encoder, for what orjson refuses: NaN and infinities refused,
#: aware datetimes written as orjson writes them.
_FALLBACK = json.JSONEncoder(
    allow_nan=False, separators=(",", ":"), ensure_ascii=False, default=_iso
)


def instant(at: datetime) -> str | datetime:
    """``at`` as the document holds it: an aware datetime as it is (the encoder writes
    ISO 8601 with its offset), a naive one as ISO 8601 of local time, as the driver
    takes it."""
    if type(at) is datetime and at.tzinfo is not None:
        return at
    if at.tzinfo is None:
        at = at.astimezone(UTC)
    return at.isoformat()


def _has_non_finite(value: object) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(_has_non_finite(item) for item in value)
    return False


def document(rows: Sequence[Any]) -> str:
    """The JSON document of ``rows``, each a sequence of JSON values; raises
    :class:`NotJson` for a value that JSON cannot hold."""
    try:
        text = orjson.dumps(rows)
    except orjson.JSONEncodeError:
        try:
            return _FALLBACK.encode(rows)
        except (TypeError, ValueError, RecursionError) as error:
            raise NotJson(str(error)) from None
    # A NaN or an infinity became null: look for one only where a null was written.
    if b"null" in text and _has_non_finite(rows):
        raise NotJson("NaN and infinities are not JSON")
    return text.decode()


#: How a non-finite float is spelled where a document must carry it: a JSON string that
#: ``::float8`` reads back as the same value.
_SPELLED = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _spelled(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else _SPELLED[value]
    return value


def rows_document(rows: Sequence[tuple[Any, ...]]) -> str:
    """The JSON document of ``rows`` (tuples of strings, numbers, instants and None) for
    a statement that reads each float with ``::float8``: as :func:`document`, but NaN and
    the infinities are written as the strings ``::float8`` reads back as them (computed
    values are stored as they are, as an array parameter stored them). orjson writes them
    as ``null``: they are looked for only when the document holds more nulls than the
    rows hold None (counted in C; walking every value took longer than the encoding)."""
    try:
        text = orjson.dumps(rows)
    except orjson.JSONEncodeError:
        return document(_all_spelled(rows))  # the standard library's encoder, spelled too
    if text.count(b"null") > sum(row.count(None) for row in rows) and _has_non_finite(rows):
        return document(_all_spelled(rows))
    return text.decode()


def _all_spelled(rows: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [tuple(_spelled(value) for value in row) for row in rows]


def fact_row(f: Fact) -> tuple[Any, ...]:
    """A fact as a row of a ``facts`` document (``consolidation_write.sql``,
    ``redis_import_rest.sql``): its columns in the order the statements read them. Read
    from the model's dict, the category as its member (both encoders write a ``StrEnum``
    as its value): a plan of 600 observations has as many rows, and the attribute and
    enum lookups were most of their cost."""
    d = f.__dict__
    return (
        d["subject"],
        d["category"],
        d["content"],
        d["confidence"],
        d["reinforcement_count"],
        instant(d["last_reinforced_at"]),
        instant(f.anchor),
        instant(d["created_at"]),
        instant(d["updated_at"]),
        d["ease_factor"],
    )


def event_row(e: FactEvent) -> tuple[Any, ...]:
    """An event as a row of an ``events`` document (``consolidation_write.sql``,
    ``redis_import_rest.sql``): its columns in the order the statements read them (read
    as :func:`fact_row` reads a fact's)."""
    d = e.__dict__
    return (
        d["subject"],
        d["category"],
        d["kind"],
        d["session_id"],
        instant(d["at"]),
        d["confidence_before"],
        d["confidence_after"],
        d["count_before"],
        d["count_after"],
        d["ease_before"],
        d["ease_after"],
        d["quality"],
        d["hits"],
        d["trials"],
    )
