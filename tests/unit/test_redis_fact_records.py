"""A fact record of the Redis layout whose subject is not of its category is a bad record:
it was imported, and then ranked, shown and netted as a fact of the other category."""

from __future__ import annotations

import json

import pytest

from coda_memory.core.model import FactCategory
from coda_memory.redis.codec import BadRecord, fact_from_json


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
