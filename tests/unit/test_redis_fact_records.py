"""A fact record of the Redis layout whose subject is not of its category is a bad record:
it was imported, and then ranked, shown and netted as a fact of the other category. A
time at the very first instant of datetime, or past its last, is one too."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from coda_memory.core.model import FactCategory
from coda_memory.redis.codec import BadRecord, dumps, fact_from_json, from_ms, to_ms


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
        (-62_135_596_800_000.0, None),
        (-62_135_596_799_999.99, datetime(1, 1, 1, 0, 0, 0, 8, tzinfo=UTC)),
        # A fraction of the last millisecond (it was refused as past the range).
        (253_402_300_799_999.5, datetime(9999, 12, 31, 23, 59, 59, 999500, tzinfo=UTC)),
        (253_402_300_800_000.0, None),
    ],
)
def test_times_at_the_edges_of_datetime(ms: float, read: datetime | None) -> None:
    if read is None:
        with pytest.raises(BadRecord, match="lastReinforcedAt is out of range"):
            from_ms(ms, "lastReinforcedAt")
    else:
        assert from_ms(ms, "lastReinforcedAt") == read


FIRST, LAST = datetime.min.replace(tzinfo=UTC), datetime.max.replace(tzinfo=UTC)


@pytest.mark.parametrize(
    "at",
    [
        *(FIRST + timedelta(microseconds=n) for n in (1, 2, 3, 4, 5, 9, 999, 1001)),
        *(LAST - timedelta(microseconds=n) for n in (1, 2, 15, 16, 17, 32, 999, 1001)),
    ],
)
def test_a_time_next_to_an_edge_of_datetime_is_read_back(at: datetime) -> None:
    """The nearest double to ``datetime.min`` + 1 µs is ``datetime.min``'s epoch ms, and to
    ``datetime.max`` - 1 µs one past the range: written so, the record was refused when
    read (an observation lost, a fact gone). It is written as the nearest double inside
    the range, and reads back as near as a double that far from 1970 holds it."""
    read = from_ms(json.loads(dumps(to_ms(at))), "createdAt")
    assert FIRST < read < LAST
    assert abs(read - at) <= timedelta(microseconds=31)


@pytest.mark.parametrize(
    "at",
    [
        datetime(1830, 6, 1, 0, 0, 0, 11, tzinfo=UTC),
        datetime(2110, 6, 1, 0, 0, 0, 11, tzinfo=UTC),
        datetime(1692, 1, 1, 0, 0, 0, 1, tzinfo=UTC),
        datetime(2247, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ],
)
def test_a_fraction_of_a_millisecond_reads_back_to_the_microsecond(at: datetime) -> None:
    """From 1692 through 2247 a double in epoch ms holds the microsecond; the read
    rounded the product by 1000 first, and took some instants of 1830 and 2110 for the
    microsecond before."""
    assert from_ms(json.loads(dumps(to_ms(at))), "createdAt") == at
