"""The bounded, least-recently-used keeping of facts by version (pure logic)."""

from __future__ import annotations

import gc

import pytest

from coda_memory.postgres.known import Known, KnownFacts, written
from tests.builders import NOW, fact


async def _known(version: str, count: int) -> Known:
    return await Known.of(version, [fact(f"tool_affinity:t{n}") for n in range(count)])


async def test_facts_are_kept_by_version_and_come_back_as_they_went_in() -> None:
    known = KnownFacts(10)
    facts = [fact("tool_affinity:a", confidence_at=NOW), fact("entity_frequency:b:1")]
    known.put("alice", written("v1", await Known.of("v0", []), facts, []))
    entry = known.entry("alice")
    assert entry is not None and entry.version == "v1"
    # confidence_at comes back as stored: the anchor, also when it was None.
    assert await entry.facts() == [
        facts[0],
        facts[1].model_copy(update={"confidence_at": facts[1].anchor}),
    ]
    known.put("alice", await _known("v2", 3))
    assert len(known) == 3
    known.put("alice", None)
    assert known.entry("alice") is None and len(known) == 0


async def test_the_least_recently_used_identities_go_first() -> None:
    known = KnownFacts(5)
    known.put("a", await _known("v", 2))
    known.put("b", await _known("v", 2))
    assert known.entry("a") is not None  # a is now the most recently used
    known.put("c", await _known("v", 2))
    assert known.entry("b") is None
    assert known.entry("a") is not None and known.entry("c") is not None
    assert len(known) == 4
    # b's two facts made room for c's; an identity's facts replaced by its own are not
    # dropped.
    assert known.dropped == 2
    known.put("a", await _known("w", 2))
    assert known.dropped == 2 and len(known) == 4


async def test_an_identity_above_the_capacity_is_not_kept() -> None:
    known = KnownFacts(3)
    known.put("a", await _known("v", 2))
    known.put("b", await _known("v", 4))
    assert known.entry("b") is None
    assert known.entry("a") is not None


def test_a_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        KnownFacts(-1)


async def test_written_applies_deletes_and_upserts() -> None:
    stored = await Known.of("v1", [fact("tool_affinity:a"), fact("tool_affinity:b")])
    upsert = fact("tool_affinity:c", confidence=0.9)
    after = await written("v2", stored, [upsert], ["tool_affinity:a"]).facts()
    assert [f.subject for f in await stored.facts()] == ["tool_affinity:a", "tool_affinity:b"]
    assert sorted(f.subject for f in after) == ["tool_affinity:b", "tool_affinity:c"]
    (c,) = [f for f in after if f.subject == "tool_affinity:c"]
    assert c.confidence_at == NOW and c.confidence == 0.9


async def test_kept_facts_are_out_of_the_garbage_collectors_sight() -> None:
    # A full collection walks every tracked object: tens of thousands of kept facts
    # would pause the event loop. Kept as dicts of untracked values, they are not walked.
    facts = [fact(f"tool_affinity:t{n}", confidence_at=None) for n in range(50)]
    facts.append(fact("entity_frequency:account:1", ease_factor=2.5))
    known = written("v2", await Known.of("v1", facts[:10]), facts[10:], [])
    assert all(gc.is_tracked(f.__dict__) for f in facts)  # the models' dicts are
    assert not any(gc.is_tracked(kept) for kept in known.kept.values())
    # ... and they come back as equal models, confidence_at as stored.
    assert await known.facts() == [
        f.model_copy(update={"confidence_at": f.anchor}) if f.confidence_at is None else f
        for f in facts
    ]


@pytest.mark.parametrize("confidence_at", [None, NOW])
def test_a_row_is_kept_as_the_model_read_from_it_would_be(confidence_at: object) -> None:
    from coda_memory.postgres.known import _kept, kept_from_row
    from coda_memory.postgres.rows import fact_from_row

    row = {
        "subject": "entity_frequency:account:42",
        "category": "entity_frequency",
        "content": "Works with account 42",
        "confidence": 0.7,
        "reinforcement_count": 3,
        "last_reinforced_at": NOW,
        "created_at": NOW,
        "updated_at": NOW,
        "ease_factor": 2.5,
        "confidence_at": confidence_at,
    }
    assert kept_from_row("alice", row) == _kept(fact_from_row("alice", row))


async def test_identities_with_no_facts_count_against_the_capacity() -> None:
    """An identity whose facts all expired is kept with none: it counted nothing, so a
    stream of such identities grew the entries without bound (330 bytes each)."""
    known = KnownFacts(100)
    known.put("active", await _known("v", 10))
    for n in range(1_000):
        known.put(f"idle-{n}", await _known("v", 0))
    assert len(known._entries) <= 100
    # The active identity's facts went, the least recently used, to make room.
    assert known.entry("active") is None and len(known) == 0 and known.dropped == 10
