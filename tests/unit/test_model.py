"""Model helpers."""

from __future__ import annotations

from coda_memory.core.model import Fact, FactCategory, fact_subject, trusted
from tests.helpers import T0


def test_trusted_models_equal_validated_ones() -> None:
    values = dict(
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
    validated = Fact.model_validate(values)
    fast = trusted(Fact, **values)
    assert fast == validated
    assert fast.model_dump() == validated.model_dump()
    assert fast.model_copy(update={"confidence": 0.7}).confidence == 0.7


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
