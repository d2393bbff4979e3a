"""What every store promises through the port (``coda_memory.ports``), tested on the store
itself rather than through MemoryService. The same tests run against each store in
``tests/contract/conftest.py``."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

import pytest

from coda_memory.core.logs import identity_label
from coda_memory.core.model import Fact, FactEventKind, ObservationType
from coda_memory.ports import Forgotten
from tests.builders import NOW, consolidate, contents, event, fact, plan, record
from tests.contract.conftest import InspectableStore

OLD = NOW - timedelta(days=30)
RETENTION = timedelta(days=7)


def by_subject(facts: list[Fact]) -> list[Fact]:
    return sorted(facts, key=lambda f: f.subject)


async def state_of(store: InspectableStore, identity_id: str) -> tuple[object, ...]:
    """Everything the store keeps of one identity."""
    return (
        by_subject(await store.facts(identity_id)),
        await store.history(identity_id),
        contents(await store.observations(identity_id)),
        await store.checkpoint(identity_id),
    )


# Appending


async def test_append_stores_and_counts_the_batch(store: InspectableStore) -> None:
    outcome = await store.append(
        [
            record("first", metadata={"toolName": "get_account", "durationMs": 12}),
            record("second", session_id=None, type=ObservationType.QUERY_PATTERN),
            record("bob's", identity_id="bob"),
        ]
    )

    assert (outcome.stored, outcome.refused) == (3, [])
    stored = await store.observations("alice")
    assert contents(stored) == ["first", "second"]
    assert stored[0].metadata == {"toolName": "get_account", "durationMs": 12}
    assert stored[0].created_at == NOW
    assert (stored[1].session_id, stored[1].type) == (None, ObservationType.QUERY_PATTERN)
    assert contents(await store.observations("bob")) == ["bob's"]


async def test_append_refuses_a_record_without_an_identity(store: InspectableStore) -> None:
    # A record that passed no sanitize_observation (a store used directly). On Postgres a
    # connection whose tenant was reset reads as the empty identity, and saw such rows.
    outcome = await store.append([record("kept"), record("nobody's", identity_id="")])

    assert (outcome.stored, outcome.refused) == (1, [(1, "identity_id is empty")])
    assert contents(await store.observations("alice")) == ["kept"]
    assert await store.observations("") == []


async def test_append_of_nothing_stores_nothing(store: InspectableStore) -> None:
    outcome = await store.append([])

    assert (outcome.stored, outcome.refused) == (0, [])
    assert await store.observations("alice") == []


# The unit of work


async def test_a_run_loads_every_new_observation_once(store: InspectableStore) -> None:
    await store.append([record("one"), record("two"), record("other", identity_id="bob")])

    assert sorted(contents((await consolidate(store)).observations)) == ["one", "two"]
    assert (await consolidate(store)).observations == []
    assert contents((await consolidate(store, "bob")).observations) == ["other"]


async def test_an_append_after_load_is_left_for_the_next_run(store: InspectableStore) -> None:
    await store.append([record("before")])
    async with store.consolidation("alice") as unit:
        loaded = await unit.load()
        await store.append([record("during")])
        await unit.write(plan(consumed=len(loaded.observations)))
        await unit.commit()

    assert contents(loaded.observations) == ["before"]
    assert contents((await consolidate(store)).observations) == ["during"]


async def test_write_needs_load_first(store: InspectableStore) -> None:
    async with store.consolidation("alice") as unit:
        with pytest.raises(RuntimeError, match="load"):
            await unit.write(plan())


async def test_write_refuses_a_plan_for_another_identity(store: InspectableStore) -> None:
    async with store.consolidation("alice") as unit:
        await unit.load()
        # Named by their labels: a host that logs the error logs no identity.
        bob = re.escape(identity_label("bob"))
        with pytest.raises(ValueError, match=bob):
            await unit.write(plan("bob"))
        with pytest.raises(ValueError, match=bob):
            await unit.write(plan(upserts=[fact(identity_id="bob")]))
        with pytest.raises(ValueError, match=bob):
            await unit.write(plan(events=[event(identity_id="bob")]))
        await unit.commit()

    assert await state_of(store, "bob") == ([], [], [], None)
    assert await store.facts("alice") == []


async def test_a_unit_is_done_after_commit(store: InspectableStore) -> None:
    async with store.consolidation("alice") as unit:
        await unit.load()
        await unit.write(plan())
        await unit.commit()
        with pytest.raises(RuntimeError, match="committed"):
            await unit.load()


async def test_leaving_without_commit_changes_nothing(store: InspectableStore) -> None:
    await store.append([record("consumed")])
    await consolidate(store, upserts=[fact("tool_affinity:kept")])
    await store.append([record("pending", created_at=OLD)])
    before = await state_of(store, "alice")

    async with store.consolidation("alice") as unit:
        loaded = await unit.load()
        await unit.write(
            plan(
                consumed=1,
                upserts=[fact("tool_affinity:new")],
                deletes=["tool_affinity:kept"],
                events=[event("tool_affinity:new")],
                prune_before=NOW,
            )
        )
    with pytest.raises(KeyError):
        async with store.consolidation("alice") as unit:
            await unit.load()
            await unit.write(plan(consumed=1, upserts=[fact("tool_affinity:new")]))
            raise KeyError("the caller failed before commit")

    assert await state_of(store, "alice") == before
    assert contents(loaded.observations) == ["pending"]
    assert contents((await consolidate(store)).observations) == ["pending"]


# Facts and history


async def test_upserts_overwrite_and_deletes_remove(store: InspectableStore) -> None:
    await consolidate(store, upserts=[fact("tool_affinity:a"), fact("tool_affinity:b")])
    reinforced = fact("tool_affinity:a", confidence=0.6, count=2, at=NOW + timedelta(days=1))
    async with store.consolidation("alice") as unit:
        loaded = await unit.load()
        assert {f.subject for f in loaded.facts} == {"tool_affinity:a", "tool_affinity:b"}
        await unit.write(plan(upserts=[reinforced], deletes=["tool_affinity:b"]))
        await unit.commit()

    stored = await store.facts("alice")

    assert [f.subject for f in stored] == ["tool_affinity:a"]
    assert stored[0].anchor == reinforced.anchor
    assert (stored[0].confidence, stored[0].reinforcement_count) == (0.6, 2)


async def test_facts_read_back_as_written(store: InspectableStore) -> None:
    anchored = fact("tool_affinity:a", confidence_at=NOW + timedelta(days=1), ease_factor=2.5)
    plain = fact("entity_frequency:account:42", confidence=0.75, count=3)
    await consolidate(store, upserts=[anchored, plain])

    stored = {f.subject: f for f in await store.facts("alice")}

    assert stored["tool_affinity:a"] == anchored
    # A store may fill the anchor in; the instant it means is the same.
    plain_back = stored["entity_frequency:account:42"]
    assert plain_back.model_copy(update={"confidence_at": None}) == plain
    assert plain_back.anchor == plain.anchor


async def test_history_keeps_events_in_order(store: InspectableStore) -> None:
    events = [
        event("tool_affinity:a", kind=FactEventKind.CREATED),
        event("tool_affinity:b", kind=FactEventKind.CREATED, session_id=None),
        event("tool_affinity:a", kind=FactEventKind.EXTENDED, at=NOW + timedelta(minutes=5)),
        event("tool_affinity:b", kind=FactEventKind.EXPIRED, session_id=None),
    ]
    async with store.consolidation("alice") as unit:
        await unit.load()
        await unit.write(plan(events=events))
        await unit.commit()

    assert await store.history("alice") == events
    assert await store.history("alice", "tool_affinity:a") == [events[0], events[2]]
    assert await store.history("alice", "tool_affinity:zzz") == []
    assert await store.history("bob") == []


async def test_load_returns_reinforcing_events_of_the_new_sessions_only(
    store: InspectableStore,
) -> None:
    earlier = [
        event("tool_affinity:a", session_id="s1", kind=FactEventKind.CREATED),
        event("tool_affinity:a", session_id="s2", kind=FactEventKind.REINFORCED),
        event("tool_affinity:b", session_id="s1", kind=FactEventKind.EXPIRED),
        event("tool_affinity:c", session_id="s1", kind=FactEventKind.EXTENDED),
        event("tool_affinity:d", session_id="s3", kind=FactEventKind.CREATED),
        event("tool_affinity:a", session_id="s1", kind=FactEventKind.CREATED, identity_id="bob"),
    ]
    for identity in ("alice", "bob"):
        async with store.consolidation(identity) as unit:
            await unit.load()
            mine = [e for e in earlier if e.identity_id == identity]
            await unit.write(plan(identity, events=mine))
            await unit.commit()
    await store.append([record(session_id="s1"), record(session_id="s3"), record(session_id=None)])

    async with store.consolidation("alice") as unit:
        loaded = await unit.load()

    assert loaded.session_events == [earlier[0], earlier[3], earlier[4]]


# Retention


async def test_retention_prunes_consumed_observations_past_it_and_nothing_else(
    store: InspectableStore,
) -> None:
    await store.append(
        [
            record("old consumed", created_at=OLD),
            record("recent consumed"),
            record("bob's old", identity_id="bob", created_at=OLD),
        ]
    )
    async with store.consolidation("alice") as unit:
        loaded = await unit.load()
        await store.append([record("old appended after load", created_at=OLD)])
        await unit.write(
            plan(
                consumed=len(loaded.observations),
                upserts=[fact()],
                events=[event()],
                prune_before=NOW - RETENTION,
            )
        )
        await unit.commit()

    assert sorted(contents(loaded.observations)) == ["old consumed", "recent consumed"]
    remaining = contents(await store.observations("alice"))
    assert sorted(remaining) == ["old appended after load", "recent consumed"]
    assert contents(await store.observations("bob")) == ["bob's old"]
    assert [f.subject for f in await store.facts("alice")] == [fact().subject]
    assert await store.history("alice") == [event()]
    # The survivor is consumed by the next run, once, and then pruned.
    nxt = await consolidate(store, retention=RETENTION)
    assert contents(nxt.observations) == ["old appended after load"]
    assert contents(await store.observations("alice")) == ["recent consumed"]


async def test_a_run_without_retention_prunes_nothing(store: InspectableStore) -> None:
    await store.append([record("old", created_at=OLD), record("recent")])

    await consolidate(store)  # prune_before is the epoch

    assert sorted(contents(await store.observations("alice"))) == ["old", "recent"]


# Forget


async def _populate(store: InspectableStore, identity: str) -> None:
    await store.append([record(identity, identity_id=identity)])
    async with store.consolidation(identity) as unit:
        await unit.load()
        await unit.write(
            plan(
                identity,
                upserts=[fact(identity_id=identity)],
                events=[event(identity_id=identity)],
                consumed=1,
            )
        )
        await unit.commit()
    # One more observation, not consolidated yet.
    await store.append([record(f"{identity} later", identity_id=identity)])


async def test_forget_removes_one_identity_only(store: InspectableStore) -> None:
    await _populate(store, "alice")
    await _populate(store, "bob")
    bob_before = await state_of(store, "bob")
    erased = Forgotten(
        observations=len(await store.observations("alice")),
        facts=len(await store.facts("alice")),
        fact_events=len(await store.history("alice")),
    )

    forgotten = await store.forget("alice")

    # It says what it erased.
    assert forgotten == erased
    assert forgotten.observations and forgotten.facts and forgotten.fact_events
    assert await state_of(store, "alice") == ([], [], [], None)
    assert await store.peek("alice") == ([], False)
    assert await state_of(store, "bob") == bob_before
    facts, history, observations, checkpoint = bob_before
    assert facts and history and observations and checkpoint is not None


async def test_an_identity_starts_afresh_after_forget(store: InspectableStore) -> None:
    await _populate(store, "alice")
    await store.forget("alice")
    await store.append([record("after forget")])

    loaded = await consolidate(store)

    assert contents(loaded.observations) == ["after forget"]
    assert loaded.facts == []
    assert loaded.session_events == []


async def test_a_batch_retried_with_its_key_after_a_forget_is_not_stored_again(
    store: InspectableStore,
) -> None:
    """A batch stored before its identity's erasure and retried with its key after it
    (its reply was lost) stores nothing again: the erased observations do not come back,
    and the other identities' are not stored twice. (Redis erased the identity's record
    of its batch keys with it.)"""
    batch = [record("before forget"), record("bob's", identity_id="bob")]
    key = str(uuid.uuid4())
    first = await store.append(batch, batch_key=key)
    await store.forget("alice")

    again = await store.append(batch, batch_key=key)

    assert again == first
    assert await store.observations("alice") == []
    assert contents(await store.observations("bob")) == ["bob's"]
    # A batch of the identity under another key is stored: the identity came back.
    await store.append([record("after forget")], batch_key=str(uuid.uuid4()))
    assert contents(await store.observations("alice")) == ["after forget"]


async def test_forgetting_an_unknown_identity_changes_nothing(store: InspectableStore) -> None:
    await _populate(store, "alice")
    before = await state_of(store, "alice")

    assert await store.forget("nobody") == Forgotten()

    assert await state_of(store, "alice") == before
    assert await state_of(store, "nobody") == ([], [], [], None)


# Peek


async def test_peek_of_an_unknown_identity_is_empty(store: InspectableStore) -> None:
    assert await store.peek("alice") == ([], False)


async def test_peek_tells_when_observations_wait(store: InspectableStore) -> None:
    await store.append([record("bob's", identity_id="bob")])
    assert (await store.peek("alice"))[1] is False
    assert (await store.peek("bob"))[1] is True

    await consolidate(store, "bob", upserts=[fact(identity_id="bob")])
    assert (await store.peek("bob"))[1] is False

    await store.append([record("bob's next", identity_id="bob")])
    assert (await store.peek("bob"))[1] is True


async def test_peek_equals_consolidation_when_nothing_is_new(store: InspectableStore) -> None:
    await store.append([record("one")])
    await consolidate(
        store, upserts=[fact("tool_affinity:a"), fact("domain_preference:x", confidence=0.7)]
    )
    await _populate(store, "bob")

    facts, pending = await store.peek("alice")

    assert pending is False
    async with store.consolidation("alice") as unit:
        loaded = await unit.load()
    assert loaded.observations == []
    assert by_subject(facts) == by_subject(loaded.facts) == by_subject(await store.facts("alice"))
    assert [f.subject for f in by_subject(facts)] == ["domain_preference:x", "tool_affinity:a"]


# Identities


# (The empty identity is refused: see test_append_refuses_a_record_without_an_identity.)
TRICKY_IDENTITIES = ["a'; DROP TABLE x; --", "%", "_", "A", "a", "a%", "a\\"]


async def test_identity_ids_are_compared_exactly(store: InspectableStore) -> None:
    for identity in TRICKY_IDENTITIES:
        await store.append([record(f"obs of {identity!r}", identity_id=identity)])
        await consolidate(store, identity, upserts=[fact(identity_id=identity)])

    for identity in TRICKY_IDENTITIES:
        assert contents(await store.observations(identity)) == [f"obs of {identity!r}"]
        assert [f.identity_id for f in await store.facts(identity)] == [identity]

    await store.forget("%")

    assert await store.facts("%") == []
    for identity in TRICKY_IDENTITIES:
        if identity != "%":
            assert [f.identity_id for f in await store.facts(identity)] == [identity]
