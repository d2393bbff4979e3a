"""JSON documents of rows (``coda_memory.postgres.documents``): what the write statements
read back with their casts."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime

import pytest

from coda_memory.core.model import FactEventKind
from coda_memory.postgres.documents import NotJson, document, event_row, fact_row, rows_document
from tests.builders import NOW, event, fact

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


@pytest.mark.parametrize("refused_by_orjson", [False, True], ids=["orjson", "stdlib"])
def test_a_fact_s_and_an_event_s_rows_hold_their_columns_with_enums_as_values(
    refused_by_orjson: bool,
) -> None:
    # Both encoders write a StrEnum member as its value; an integer past 64 bits in
    # another row sends the document to the standard library's.
    later = datetime(2026, 3, 2, tzinfo=UTC)
    made = fact("entity_frequency:table:orders", confidence_at=later, ease_factor=2.5)
    extra = [(2**70,)] if refused_by_orjson else []
    assert json.loads(rows_document([fact_row(made), *extra]))[0] == [
        "entity_frequency:table:orders",
        "entity_frequency",
        "uses entity_frequency:table:orders",
        0.5,
        1,
        NOW.isoformat(),
        later.isoformat(),  # the anchor: confidence_at when set
        NOW.isoformat(),
        NOW.isoformat(),
        2.5,
    ]
    assert json.loads(rows_document([fact_row(fact()), *extra]))[0][6] == NOW.isoformat()
    happened = event(kind=FactEventKind.REINFORCED)
    assert json.loads(rows_document([event_row(happened), *extra]))[0] == [
        "tool_affinity:get_account",
        "tool_affinity",
        "reinforced",
        "s1",
        NOW.isoformat(),
        None,
        0.5,
        None,
        1,
        None,
        2.5,
        1.0,
        1,
        1,
    ]
