"""Rows to models (``coda_memory.postgres.rows``): an observation's metadata read from the
JSON text the server sends, and its type."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from coda_memory.core.model import ObservationType
from coda_memory.core.sanitize import MAX_METADATA_INT
from coda_memory.postgres.rows import metadata_from_text, observation_from_row

#: The JSON values the library stores as metadata (see ``coda_memory.core.sanitize``).
stored_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-MAX_METADATA_INT, MAX_METADATA_INT)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8", exclude_characters="\x00")),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def spelled(value: Any) -> str:
    """The value as JSON, which tells 1 from 1.0 (equality does not)."""
    return json.dumps(value)


@settings(max_examples=300, deadline=None)
@given(value=stored_values)
def test_metadata_reads_as_the_standard_library_reads_it(value: Any) -> None:
    # Postgres sends jsonb as text with a space after each ':' and ',', as json.dumps does.
    text = json.dumps(value)
    assert spelled(metadata_from_text(text)) == spelled(json.loads(text))


def test_a_number_orjson_refuses_is_read_by_the_standard_library() -> None:
    assert metadata_from_text('{"x": 1e400}') == {"x": math.inf}


def test_every_observation_type_reads_back_from_its_stored_value() -> None:
    for kind in ObservationType:
        row = {
            "id": 1,
            "type": kind.value,
            "content": "",
            "metadata": '{"toolName": "run_query"}',
            "session_id": None,
            "created_at": datetime(2026, 1, 1, tzinfo=UTC),
        }
        observation = observation_from_row("u", row)
        assert observation.type is kind
        assert observation.metadata == {"toolName": "run_query"}
