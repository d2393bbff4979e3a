"""JSON documents of rows (``coda_memory.postgres.documents``): what the write statements
read back with their casts."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime

import pytest

from coda_memory.postgres.documents import NotJson, document, rows_document

AT = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


def test_a_plain_document_of_rows_is_orjsons_with_instants_in_iso_8601() -> None:
    rows = [("s", 0.30000000000000004, 3, None, AT)]
    assert json.loads(rows_document(rows)) == [["s", 0.30000000000000004, 3, None, AT.isoformat()]]


@pytest.mark.parametrize(
    ("odd", "spelled"),
    [((math.nan, 1.0), ["NaN", 1.0]), ((math.inf, -math.inf), ["Infinity", "-Infinity"])],
    ids=["nan", "infinities"],
)
@pytest.mark.parametrize("refused_by_orjson", [False, True], ids=["orjson", "stdlib"])
def test_non_finite_floats_are_spelled_as_float8_reads_them_whichever_encoder(
    odd: tuple[float, float], spelled: list[object], refused_by_orjson: bool
) -> None:
    # An integer past 64 bits sends the document to the standard library's encoder,
    # which must spell them too, not refuse the plan.
    extra = 2**70 if refused_by_orjson else 1
    text = rows_document([("s", *odd, None, extra)])
    assert json.loads(text) == [["s", *spelled, None, extra]]


def test_a_string_holding_null_is_no_non_finite_float() -> None:
    rows = [("null", None, 0.5)]
    assert json.loads(rows_document(rows)) == [["null", None, 0.5]]


def test_document_still_refuses_what_json_cannot_hold() -> None:
    with pytest.raises(NotJson):
        document([("s", math.nan)])
