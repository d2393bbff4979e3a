"""Model helpers."""

from __future__ import annotations

from typing import Any

from coda_memory.core.model import Fact, FactCategory, fact_subject, trusted
from tests.helpers import T0

#: Every field of a fact, valid.
_VALUES: dict[str, Any] = dict(
    id="fact:tool_affinity:t",
    identity_id="u",
    category=FactCategory.TOOL_AFFINITY,
    subject="tool_affinity:t",
    content="Uses t successfully",
    confidence=0.5,
    reinforcement_count=1,
    last_reinforced_at=T0,
    created_at=T0,
    updated_at=T0,
    ease_factor=None,
    confidence_at=T0,
)


def test_trusted_models_equal_validated_ones() -> None:
    values = dict(_VALUES)
    validated = Fact.model_validate(values)
    fast = trusted(Fact, **values)
    assert fast == validated
    assert fast.model_dump() == validated.model_dump()
    assert fast.model_copy(update={"confidence": 0.7}).confidence == 0.7
    assert fast.model_fields_set == validated.model_fields_set == set(Fact.model_fields)


def test_trusted_models_share_one_fields_set_that_copies_do_not_change() -> None:
    values = dict(_VALUES)
    first, second = trusted(Fact, **values), trusted(Fact, **values)
    assert first.__pydantic_fields_set__ is second.__pydantic_fields_set__
    shared = set(first.model_fields_set)
    # Copies (with and without updates, shallow and deep) get sets of their own.
    for copy in (
        first.model_copy(update={"confidence": 0.7, "ease_factor": 2.5}),
        first.model_copy(deep=True),
        first.model_copy(),
    ):
        assert copy.__pydantic_fields_set__ is not first.__pydantic_fields_set__
        copy.__pydantic_fields_set__.add("not_a_field")
    assert second.model_fields_set == shared


def test_subjects_use_the_category_value() -> None:
    assert fact_subject(FactCategory.ENTITY_FREQUENCY, "account", "42") == (
        "entity_frequency:account:42"
    )


def test_gc_paused_restores_the_collector_state() -> None:
    import gc

    from coda_memory.core.model import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a host that disabled it keeps it disabled
    finally:
        gc.enable()
