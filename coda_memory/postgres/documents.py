"""JSON documents of rows: how the writer's statement takes a batch of observations.

``observations_insert.sql`` takes its rows as one JSON array of arrays (one array per
row, its values in a fixed order) and reads them with ``jsonb_array_elements``, rather
than as one Postgres array per column. The driver checks every element of an array
parameter in Python, a few abstract-base-class checks each; one JSON text is made by
the standard library's C encoder in one call, and the server parses it about as fast as
the arrays. For a batch of 5,000 observations, this halved the Python of the insert
per row. (The consolidation's write takes arrays still: there it made no measurable
difference, its arrays being a few dozen elements long.)

Values travel as JSON does: strings, numbers (a float as its shortest repr, read back
exactly by ``::float8``), true, false and null; an instant as its ISO 8601 text with
its offset (:func:`instant`), read back exactly by ``::timestamptz``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

#: One encoder for every document (``json.dumps`` with options builds one per call). NaN
#: and infinities are refused: jsonb has no such numbers.
ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"), ensure_ascii=False)


def instant(at: datetime) -> str:
    """``at`` as ISO 8601 with its offset; a naive ``at`` is local time, as the driver
    takes it."""
    if at.tzinfo is None:
        at = at.astimezone(UTC)
    return at.isoformat()


def document(rows: Sequence[Sequence[Any]]) -> str:
    """The JSON document of ``rows``, each a sequence of JSON values."""
    return ENCODER.encode(rows)
