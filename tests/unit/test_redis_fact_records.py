"""A fact record of the Redis layout whose subject is not of its category is a bad record:
it was imported, and then ranked, shown and netted as a fact of the other category. A
time at the very first instant of datetime, or past its last, is one too."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from coda_memory.core.model import FactCategory
from coda_memory.redis.codec import BadRecord, fact_from_json, from_ms


def _record(category: str, subject: str) -> str:
    return json.dumps(
        {
            "id": f"fact:{subject}",
            "identityId": "u1",
            "category": category,
            "subject": subject,
            "content": "Uses get_account successfully",
            "confidence": 0.5,
            "reinforcementCount": 1,
            "lastReinforcedAt": 1_700_000_000_000,
            "createdAt": 1_700_000_000_000,
            "updatedAt": 1_700_000_000_000,
        }
    )


def test_a_fact_of_its_category_is_read() -> None:
    fact = fact_from_json("u1", _record("tool_affinity", "tool_affinity:get_account"))
    assert (fact.category, fact.subject) == (
        FactCategory.TOOL_AFFINITY,
        "tool_affinity:get_account",
    )


@pytest.mark.parametrize(
    ("category", "subject"),
    [
        ("failure_pattern", "tool_affinity:get_account"),
        ("tool_affinity", "tool_affinityget_account"),
        ("tool_affinity", "get_account"),
    ],
)
def test_a_subject_of_another_category_is_a_bad_record(category: str, subject: str) -> None:
    with pytest.raises(BadRecord, match=f"subject does not begin with its category '{category}'"):
        fact_from_json("u1", _record(category, subject))


@pytest.mark.parametrize(
    ("category", "reason"),
    [
        # A short name is quoted: it tells the operator what the record holds.
        ("tool_maybe", "unknown fact category 'tool_maybe'"),
        # Anything else is not: a corrupt field may hold personal data, or a megabyte.
        ("SSN 123-45-6789 bob@example.org", "unknown fact category (a string of 31 characters)"),
        ("x" * 1_000_000, "unknown fact category (a string of 1,000,000 characters)"),
        (7, "unknown fact category (of type int)"),
    ],
)
def test_an_unknown_category_is_quoted_only_when_it_is_a_short_name(
    category: object, reason: str
) -> None:
    record = json.loads(_record("tool_affinity", "tool_affinity:get_account"))
    record["category"] = category
    with pytest.raises(BadRecord) as raised:
        fact_from_json("u1", json.dumps(record))
    assert str(raised.value) == reason


@pytest.mark.parametrize(
    ("ms", "read"),
    [
        (-62_135_596_800_000, None),  # datetime.min: Postgres would keep it as -infinity
        (-62_135_596_799_999, datetime(1, 1, 1, 0, 0, 0, 1000, tzinfo=UTC)),
        (253_402_300_799_999, datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)),
        (253_402_300_800_000, None),  # past datetime's range
    ],
)
def test_times_at_the_edges_of_datetime(ms: int, read: datetime | None) -> None:
    if read is None:
        with pytest.raises(BadRecord, match="lastReinforcedAt is out of range"):
            from_ms(ms, "lastReinforcedAt")
    else:
        assert from_ms(ms, "lastReinforcedAt") == read
