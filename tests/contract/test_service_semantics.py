"""The memory semantics, through MemoryService, against every store."""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest

from coda_memory import (
    AdaptiveDecay,
    DecayStrategy,
    ExponentialDecay,
    Fact,
    FactCategory,
    FactEventKind,
    Forgotten,
    NewObservation,
    ObservationType,
    PowerLawDecay,
)
from tests.conftest import ServiceFactory
from tests.helpers import T0, FakeClock, domain, entity, tool_failed, tool_ok


def by_subject(facts: list[Fact]) -> dict[str, Fact]:
    return {f.subject: f for f in facts}


async def test_a_new_fact_starts_at_half_and_reinforcement_adds_a_tenth(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    service = await make_service()
    service.emit_observation("u1", tool_ok("get_account", session="s1"))
    await service.drain()
    facts = by_subject(await service.consolidate("u1"))
    fact = facts["tool_affinity:get_account"]
    assert (fact.confidence, fact.reinforcement_count) == (0.5, 1)
    assert fact.id == "fact:tool_affinity:get_account"
    assert fact.category is FactCategory.TOOL_AFFINITY
    assert fact.created_at == fact.last_reinforced_at == T0

    clock.advance(days=2)
    service.emit_observation("u1", tool_ok("get_account", session="s2"))
    await service.drain()
    fact = by_subject(await service.consolidate("u1"))["tool_affinity:get_account"]
    assert fact.confidence == pytest.approx(0.5 * 0.95**2 + 0.1)
    assert fact.reinforcement_count == 2
    assert fact.last_reinforced_at == clock.now


async def test_every_kind_of_observation_lands_on_its_subject(
    make_service: ServiceFactory,
) -> None:
    service = await make_service()
    for obs in (
        tool_ok("get_account"),
        tool_failed("run_query"),
        entity("account", "42", "Acme"),
        domain("royalty"),
    ):
        service.emit_observation("u1", obs)
    await service.drain()
    facts = by_subject(await service.consolidate("u1"))
    assert set(facts) == {
        "tool_affinity:get_account",
        "tool_avoidance:run_query",
        "entity_frequency:account:42",
        "domain_preference:royalty",
    }
    assert facts["entity_frequency:account:42"].content == 'Works with account "Acme" (id "42")'


async def test_a_session_reinforces_a_fact_once_even_across_runs(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    service = await make_service()
    for _ in range(3):
        service.emit_observation("u1", tool_ok("t", session="s1"))
    await service.drain()
    assert by_subject(await service.consolidate("u1"))["tool_affinity:t"].reinforcement_count == 1

    # The same conversation goes on: the server consolidates on every request.
    for minutes in (10, 20):
        clock.advance(minutes=10)
        service.emit_observation("u1", tool_ok("t", session="s1"))
        await service.drain()
        fact = by_subject(await service.consolidate("u1"))["tool_affinity:t"]
        assert fact.reinforcement_count == 1
        # The session's reinforcement time is its latest observation for the fact.
        assert fact.last_reinforced_at == T0 + timedelta(minutes=minutes)
        assert fact.confidence == pytest.approx(0.5)

    history = await service.history("u1", "tool_affinity:t")
    assert [e.kind for e in history] == [
        FactEventKind.CREATED,
        FactEventKind.EXTENDED,
        FactEventKind.EXTENDED,
    ]


async def test_observations_without_a_session_count_as_one_session_per_run(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    service = await make_service()
    service.emit_observation("u1", domain("royalty", session=None))
    service.emit_observation("u1", domain("royalty", session=None))
    await service.drain()
    assert (
        by_subject(await service.consolidate("u1"))["domain_preference:royalty"].reinforcement_count
        == 1
    )
    clock.advance(hours=1)
    service.emit_observation("u1", domain("royalty", session=None))
    await service.drain()
    fact = by_subject(await service.consolidate("u1"))["domain_preference:royalty"]
    assert fact.reinforcement_count == 2


async def test_sessions_apply_in_time_order_and_never_before_the_last_reinforcement(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    service = await make_service()
    clock.advance(days=10)
    # Emitted out of order: s_late first, then s_early (a skewed app server).
    service.emit_observation("u1", tool_ok("t", session="late", at=T0 + timedelta(days=5)))
    service.emit_observation("u1", tool_ok("t", session="early", at=T0 + timedelta(days=1)))
    await service.drain()
    await service.consolidate("u1")
    history = await service.history("u1", "tool_affinity:t")
    assert [(e.session_id, e.at) for e in history] == [
        ("early", T0 + timedelta(days=1)),
        ("late", T0 + timedelta(days=5)),
    ]
    # A session stamped before the fact's last reinforcement counts at that reinforcement.
    service.emit_observation("u1", tool_ok("t", session="skewed", at=T0 + timedelta(days=3)))
    await service.drain()
    fact = by_subject(await service.consolidate("u1"))["tool_affinity:t"]
    assert fact.reinforcement_count == 3
    assert fact.last_reinforced_at == T0 + timedelta(days=5)
    expected = ((0.5 * 0.95**4 + 0.1) + 0.1) * 0.95**5
    assert fact.confidence == pytest.approx(expected)


async def test_a_late_observation_does_not_bring_back_an_older_name(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    service = await make_service()
    clock.advance(days=2)
    service.emit_observation("u1", entity("account", "7", "Old Name", "s1", T0))
    service.emit_observation("u1", entity("account", "7", "New Name", "s2", clock.now))
    await service.drain()
    await service.consolidate("u1")
    # Arrives after the rename, dated before it: it reinforces, and the newer name stays.
    service.emit_observation("u1", entity("account", "7", "Old Name", "s3", T0 + timedelta(days=1)))
    await service.drain()
    fact = by_subject(await service.consolidate("u1"))["entity_frequency:account:7"]
    assert fact.reinforcement_count == 3
    assert fact.content == 'Works with account "New Name" (id "7")'
    # A later observation dated after the rename does rename it.
    service.emit_observation("u1", entity("account", "7", "Newest", "s4", clock.now))
    await service.drain()
    fact = by_subject(await service.consolidate("u1"))["entity_frequency:account:7"]
    assert fact.content == 'Works with account "Newest" (id "7")'


@pytest.mark.parametrize("decay_name", ["exponential", "adaptive", "power-law"])
async def test_consolidating_daily_or_once_at_day_20_gives_the_same_facts(
    make_service: ServiceFactory, clock: FakeClock, decay_name: str
) -> None:
    decay: DecayStrategy = {
        "exponential": ExponentialDecay,
        "adaptive": AdaptiveDecay,
        "power-law": PowerLawDecay,
    }[decay_name]()
    service = await make_service(decay=decay)
    Build = Callable[[str, datetime], NewObservation]
    schedule: list[tuple[int, int, str, Build]] = [
        # (day, hour, session, observation builder)
        (0, 9, "a", lambda s, at: tool_ok("get_account", s, at)),
        (0, 10, "a", lambda s, at: tool_failed("get_account", s, at)),
        (1, 9, "b", lambda s, at: entity("account", "42", "Acme", s, at)),
        (3, 9, "c", lambda s, at: tool_ok("get_account", s, at)),
        (3, 23, "c", lambda s, at: tool_ok("get_account", s, at)),
        (4, 1, "c", lambda s, at: domain("royalty", s, at)),
        (9, 9, "d", lambda s, at: tool_failed("get_account", s, at)),
        (9, 12, "d", lambda s, at: entity("account", "42", "Acme", s, at)),
        (15, 9, "e", lambda s, at: tool_ok("get_account", s, at)),
    ]
    for day in range(21):
        clock.now = T0 + timedelta(days=day)
        for hour in range(24):
            instant = T0 + timedelta(days=day, hours=hour)
            for d, h, session, build in schedule:
                if (d, h) == (day, hour):
                    for identity in ("daily", "once"):
                        service.emit_observation(identity, build(session, instant))
            if hour in (9, 17):
                clock.now = instant + timedelta(minutes=30)
                await service.drain()
                await service.consolidate("daily")
    clock.now = T0 + timedelta(days=20, hours=23)
    await service.drain()
    daily = await service.consolidate("daily")
    once = await service.consolidate("once")
    assert len(daily) == len(once) == 4
    for a, b in zip(daily, once, strict=True):
        assert a.subject == b.subject
        assert a.confidence == pytest.approx(b.confidence, rel=1e-12)
        assert a.reinforcement_count == b.reinforcement_count
        assert a.last_reinforced_at == b.last_reinforced_at
        assert a.ease_factor == pytest.approx(b.ease_factor) if a.ease_factor else True


async def test_returned_facts_are_views_at_now(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    service = await make_service()
    service.emit_observation("u1", tool_ok("t"))
    await service.drain()
    await service.consolidate("u1")
    clock.advance(days=7)
    for facts in (await service.facts("u1"), await service.consolidate("u1")):
        (fact,) = facts
        assert fact.confidence_at == clock.now
        assert fact.confidence == pytest.approx(0.5 * 0.95**7)
        assert service.decay.decayed(fact, clock.now) == pytest.approx(fact.confidence)
    # Consolidating with nothing new does not rewrite the stored confidence.
    (stored,) = await service.store.facts("u1")
    assert stored.confidence == 0.5
    assert stored.anchor == T0


async def test_an_expired_fact_is_deleted_and_never_returned(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    service = await make_service()
    service.emit_observation("u1", tool_ok("t"))
    service.emit_observation("u1", tool_ok("keep"))
    await service.drain()
    await service.consolidate("u1")
    clock.advance(days=31)
    assert {f.subject for f in await service.facts("u1")} == {
        "tool_affinity:t",
        "tool_affinity:keep",
    }
    clock.advance(days=1)
    assert await service.facts("u1") == []  # expired, even before consolidation
    service.emit_observation("u1", tool_ok("keep", session="s2"))
    await service.drain()
    facts = await service.consolidate("u1")
    assert [f.subject for f in facts] == ["tool_affinity:keep"]
    assert [f.subject for f in await service.store.facts("u1")] == ["tool_affinity:keep"]
    expired = [e for e in await service.history("u1") if e.kind is FactEventKind.EXPIRED]
    assert sorted(e.subject for e in expired) == ["tool_affinity:keep", "tool_affinity:t"]
    # The expiry is dated when the confidence crossed the threshold, ~31.4 days in.
    crossing = T0 + timedelta(days=math.log(0.1 / 0.5) / math.log(0.95))
    assert all(abs((e.at - crossing).total_seconds()) < 1 for e in expired)


async def test_a_clock_set_back_by_weeks_expires_and_deletes_nothing(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    """Days before a fact's anchor decay nothing (as the analytics views count them): a
    process whose clock was set back (a reset before NTP syncs) decayed every fact by the
    distance, and its consolidations deleted those that distance expired."""
    service = await make_service()
    service.emit_observation("u1", tool_ok("t"))
    service.emit_observation("u1", tool_ok("kept", session="s1"))
    await service.drain()
    await service.consolidate("u1")
    clock.advance(days=-60)
    service.emit_observation("u1", tool_ok("kept", session="s2"))
    await service.drain()
    facts = by_subject(await service.consolidate("u1"))
    assert facts["tool_affinity:t"].confidence == 0.5  # held, not decayed by 60 days
    assert facts["tool_affinity:kept"].confidence == pytest.approx(0.6)
    assert facts["tool_affinity:kept"].reinforcement_count == 2
    assert [e.kind for e in await service.history("u1")].count(FactEventKind.EXPIRED) == 0
    # Back on time, a fact it did not reinforce decays from its anchor as if the clock
    # had never moved. (One it reinforced is anchored at its now: that costs the fact the
    # clock's error once, as documented.)
    clock.advance(days=61)
    facts = by_subject(await service.consolidate("u1"))
    assert facts["tool_affinity:t"].confidence == pytest.approx(0.5 * 0.95)


async def test_an_expired_fact_restarts_from_scratch_even_without_a_consolidation(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    service = await make_service()
    for session in ("s1", "s2", "s3"):
        service.emit_observation("u1", tool_ok("t", session=session))
    await service.drain()
    await service.consolidate("u1")
    clock.advance(days=60)
    service.emit_observation("u1", tool_ok("t", session="s4"))
    await service.drain()
    (fact,) = await service.consolidate("u1")
    assert (fact.confidence, fact.reinforcement_count) == (0.5, 1)
    assert fact.created_at == clock.now
    kinds = [e.kind for e in await service.history("u1", "tool_affinity:t")]
    assert kinds == [
        FactEventKind.CREATED,
        FactEventKind.REINFORCED,
        FactEventKind.REINFORCED,
        FactEventKind.EXPIRED,
        FactEventKind.CREATED,
    ]


@pytest.mark.parametrize(
    ("decay", "late", "deleted"),
    # The fact (count 5 at day 4) expires at about day 44, or 120 (ease 2.9).
    [(ExponentialDecay(), 30, 50), (AdaptiveDecay(), 118, 130)],
    ids=["exp", "adaptive"],
)
async def test_a_late_observation_resumes_a_fact_deleted_after_its_date(
    make_service: ServiceFactory, clock: FakeClock, decay: DecayStrategy, late: int, deleted: int
) -> None:
    """Two identities, the same observations; one is also consolidated once its fact has
    expired, which deletes it. An observation of a new session dated from when the fact
    was alive arrives a day later. The deleted fact restarted at 0.5 with count 1,
    where the stored one was reinforced: how often consolidation ran changed the result."""
    service = await make_service(decay=decay)
    for day in range(5):
        for who in ("frequent", "rare"):
            at = T0 + timedelta(days=day)
            service.emit_observation(who, tool_ok("t", session=f"d{day}", at=at))
        clock.now = T0 + timedelta(days=day, hours=1)
        await service.drain()
        for who in ("frequent", "rare"):
            await service.consolidate(who)
    clock.now = T0 + timedelta(days=deleted)
    assert await service.consolidate("frequent") == []  # expired, and deleted
    assert await service.store.facts("frequent") == []
    clock.now = T0 + timedelta(days=deleted + 1)
    for who in ("frequent", "rare"):
        service.emit_observation(who, tool_ok("t", session="late", at=T0 + timedelta(days=late)))
    await service.drain()
    (resumed,) = await service.consolidate("frequent")
    (kept,) = await service.consolidate("rare")
    assert resumed.reinforcement_count == kept.reinforcement_count == 6
    assert resumed.confidence == pytest.approx(kept.confidence, abs=1e-12)
    assert resumed.last_reinforced_at == kept.last_reinforced_at == T0 + timedelta(days=late)
    assert resumed.ease_factor == kept.ease_factor
    # The history says what happened: the expiry, then the late reinforcement of that
    # life, as for the fact no consolidation deleted.
    history = await service.history("frequent", "tool_affinity:t")
    assert [(e.kind, e.count_after) for e in history[-2:]] == [
        (FactEventKind.EXPIRED, None),
        (FactEventKind.REINFORCED, 6),
    ]
    # A late observation dated after the expiry starts the fact anew, as before.
    clock.now = T0 + timedelta(days=400)
    assert await service.consolidate("frequent") == []
    service.emit_observation("frequent", tool_ok("t", session="later", at=T0 + timedelta(days=300)))
    await service.drain()
    assert await service.consolidate("frequent") == []  # created at day 300, expired since
    history = await service.history("frequent", "tool_affinity:t")
    assert [e.kind for e in history[-3:]] == [
        FactEventKind.EXPIRED,
        FactEventKind.CREATED,
        FactEventKind.EXPIRED,
    ]


async def test_a_sessions_later_calls_requalify_its_reinforcement_of_a_deleted_fact(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    """Session s1 reinforced the tool's avoidance with one failure; the fact expired and a
    consolidation deleted it; then s1's later success arrived (the session's quality for
    the avoidance is now 1/2), then a failure of session s2 dated from when the fact was
    alive, which resumes its last life. The requalification was skipped for a deleted
    fact, so the resumed life kept the ease of quality 1 (2.7, not 2.55): consolidating
    once gave another fact."""
    service = await make_service(decay=AdaptiveDecay())
    first = [
        tool_failed("t", session="s0", at=T0),
        tool_failed("t", session="s1", at=T0 + timedelta(hours=1)),
    ]
    late = [
        tool_ok("t", session="s1", at=T0 + timedelta(hours=1, minutes=1)),
        tool_failed("t", session="s2", at=T0 + timedelta(days=60)),
    ]
    for obs in first:
        for who in ("frequent", "once"):
            service.emit_observation(who, obs)
    clock.now = T0 + timedelta(hours=2)
    await service.drain()
    await service.consolidate("frequent")
    clock.now = T0 + timedelta(days=100)  # the avoidance expired at about day 91
    assert await service.consolidate("frequent") == []
    for obs in late:
        for who in ("frequent", "once"):
            service.emit_observation(who, obs)
        await service.drain()
        await service.consolidate("frequent")
    frequent = by_subject(await service.consolidate("frequent"))["tool_avoidance:t"]
    once = by_subject(await service.consolidate("once"))["tool_avoidance:t"]
    # s1: 2.5 + 0.1 - (1 - 1/2) * 0.3 = 2.45; s2: 2.45 + 0.1 = 2.55
    assert frequent.ease_factor == once.ease_factor == pytest.approx(2.55)
    assert frequent.reinforcement_count == once.reinforcement_count == 3
    assert frequent.confidence == pytest.approx(once.confidence, abs=1e-12)
    assert frequent.last_reinforced_at == once.last_reinforced_at == late[1].created_at


async def test_adaptive_quality_is_the_share_of_successes_or_failures(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    service = await make_service(decay=AdaptiveDecay())
    service.emit_observation("u1", tool_ok("t", session="s1"))
    service.emit_observation("u1", tool_failed("t", session="s1"))
    await service.drain()
    facts = by_subject(await service.consolidate("u1"))
    assert facts["tool_affinity:t"].ease_factor == 2.5  # a new fact starts at the default
    clock.advance(days=1)
    for obs in (tool_ok("t", "s2"), tool_ok("t", "s2"), tool_failed("t", "s2"), domain("x", "s2")):
        service.emit_observation("u1", obs)
    await service.drain()
    facts = by_subject(await service.consolidate("u1"))
    # affinity: quality 2/3 -> 2.5 + 0.1 - (1/3) * 0.3 = 2.5; avoidance: 1/3 -> 2.4
    assert facts["tool_affinity:t"].ease_factor == pytest.approx(2.5)
    assert facts["tool_avoidance:t"].ease_factor == pytest.approx(2.4)
    assert facts["domain_preference:x"].ease_factor == 2.5
    events = await service.history("u1", "tool_avoidance:t")
    assert events[-1].quality == pytest.approx(1 / 3)
    assert (events[-1].hits, events[-1].trials) == (1, 3)


async def test_identity_ids_are_opaque(make_service: ServiceFactory) -> None:
    service = await make_service()
    identities = ["a'; DROP TABLE x; --", "%", "A", "a", "_"]
    for i, identity in enumerate(identities):
        service.emit_observation(identity, tool_ok(f"tool{i}"))
    await service.drain()
    for i, identity in enumerate(identities):
        assert [f.subject for f in await service.consolidate(identity)] == [
            f"tool_affinity:tool{i}"
        ]


@pytest.mark.parametrize("identity", [uuid.UUID(int=7), 42, ["u1"], b"u1"], ids=repr)
async def test_load_memory_with_an_identity_that_is_no_string_is_empty_and_raises_nothing(
    make_service: ServiceFactory, identity: object, caplog: pytest.LogCaptureFixture
) -> None:
    service = await make_service()
    service.emit_observation("u1", tool_ok("get_account"))
    await service.drain()
    loaded = await service.load_memory(identity)  # type: ignore[arg-type]
    assert not loaded.facts and loaded.prompt_section == ""
    assert service.stats().load_errors == 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"coda-memory: load_memory got an identity of type {type(identity).__name__}, "
        "not str; returning empty"
    ]
    assert (await service.load_memory("u1")).facts  # the service still works


async def test_history_records_confidence_before_and_after(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    service = await make_service()
    service.emit_observation("u1", domain("royalty", session="s1"))
    await service.drain()
    await service.consolidate("u1")
    clock.advance(days=3)
    service.emit_observation("u1", domain("royalty", session="s2"))
    await service.drain()
    await service.consolidate("u1")
    created, reinforced = await service.history("u1")
    assert created.kind is FactEventKind.CREATED
    assert (created.confidence_before, created.confidence_after) == (None, 0.5)
    assert reinforced.kind is FactEventKind.REINFORCED
    assert reinforced.session_id == "s2"
    assert reinforced.confidence_before == pytest.approx(0.5 * 0.95**3)
    assert reinforced.confidence_after == pytest.approx(0.5 * 0.95**3 + 0.1)
    assert (reinforced.count_before, reinforced.count_after) == (1, 2)


async def test_forget_erases_one_identity_only(make_service: ServiceFactory) -> None:
    service = await make_service()
    for identity in ("u1", "u2"):
        service.emit_observation(identity, tool_ok("t"))
    await service.drain()
    await service.consolidate("u1")
    await service.consolidate("u2")
    service.emit_observation("u1", tool_ok("later", session="s9"))
    # The stored observation and the queued one (stored meanwhile or dropped), the fact
    # and its event.
    assert await service.forget("u1") == Forgotten(observations=2, facts=1, fact_events=1)
    assert await service.forget("u1") == Forgotten()
    assert await service.facts("u1") == []
    assert await service.history("u1") == []
    assert await service.consolidate("u1") == []
    assert [f.subject for f in await service.facts("u2")] == ["tool_affinity:t"]
    assert len(await service.history("u2")) == 1


async def test_bad_input_is_rejected_or_sanitised_and_good_input_survives(
    make_service: ServiceFactory,
) -> None:
    service = await make_service()
    bad_metadata: list[dict[str, object]] = [
        {"toolName": "t", "durationMs": float("nan")},
        {"toolName": "t", "blob": b"bytes"},
        {"toolName": "t", "when": {1, 2}},
        {"toolName": "bad tool name with spaces"},
        {"toolName": "t", "big": ["x" * 900] * 40},
    ]
    service.emit_observation("u1", tool_ok("before"))
    for meta in bad_metadata:
        service.emit_observation(
            "u1",
            NewObservation.model_construct(
                type=ObservationType.TOOL_SUCCESS,
                content="x",
                metadata=meta,
                session_id="s1",
                created_at=None,
            ),
        )
    service.emit_observation("", tool_ok("t"))  # an empty identity id
    service.emit_observation("u1", tool_ok("nul\x00"))
    # Sanitised, not rejected: NUL bytes, lone surrogates and megabytes of content.
    service.emit_observation(
        "u1",
        NewObservation(
            type=ObservationType.ENTITY_ACCESS,
            content="nul \x00 surrogate \ud800 " + "x" * 3_000_000,
            metadata={"entityType": "account", "entityId": "7", "entityName": "A\x00\ud801cme"},
            session_id="s1",
        ),
    )
    service.emit_observation("u1", tool_ok("after"))
    await service.drain()
    stats = service.stats()
    assert (stats.emitted, stats.stored, stats.rejected, stats.dropped, stats.pending) == (
        10,
        3,
        7,
        0,
        0,
    )
    facts = by_subject(await service.consolidate("u1"))
    assert set(facts) == {
        "tool_affinity:before",
        "tool_affinity:after",
        "entity_frequency:account:7",
    }
    assert facts["entity_frequency:account:7"].content == 'Works with account "Acme" (id "7")'


async def test_a_clock_set_back_does_not_make_a_late_observation_restart_a_deleted_fact(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    """A fact expired and a consolidation deleted it at day 50; a clock set back to day
    20 consolidated the identity again, and the instant of its last consolidation went
    back with it. An observation dated day 30, from when the fact was alive, then arrived
    late: taken as dated after the last consolidation (no fact deleted before it), it
    restarted the fact at 0.5 with count 1 instead of resuming its last life."""
    service = await make_service()
    for day in range(5):  # count 5 at day 4: expires at about day 44
        service.emit_observation("u1", tool_ok("t", session=f"d{day}", at=T0 + timedelta(days=day)))
    clock.now = T0 + timedelta(days=4, hours=1)
    await service.drain()
    await service.consolidate("u1")
    clock.now = T0 + timedelta(days=50)
    assert await service.consolidate("u1") == []  # expired, and deleted
    clock.now = T0 + timedelta(days=20)  # set back, before it syncs again
    service.emit_observation("u1", domain("royalty", session="behind"))
    await service.drain()
    await service.consolidate("u1")
    clock.now = T0 + timedelta(days=51)
    late = tool_ok("t", session="late", at=T0 + timedelta(days=30))
    service.emit_observation("u1", late)
    await service.drain()
    resumed = by_subject(await service.consolidate("u1"))["tool_affinity:t"]
    assert resumed.reinforcement_count == 6
    assert resumed.last_reinforced_at == late.created_at


async def test_a_clock_within_the_retention_of_year_1_still_consolidates(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    """The prune bound, now less the retention, is the first date then (it left the range
    of dates, and every consolidation failed); a later run prunes nothing it keeps. (On
    Redis, the commit's bound of the sessions' records, now less the session horizon,
    left it too.)"""
    clock.now = datetime.min.replace(tzinfo=T0.tzinfo) + timedelta(days=2)
    service = await make_service()
    service.emit_observation("u1", tool_ok("get_account", session="s1"))
    await service.drain()
    assert [f.subject for f in await service.consolidate("u1")] == ["tool_affinity:get_account"]
    clock.advance(hours=1)
    service.emit_observation("u1", tool_ok("get_account", session="s2"))
    await service.drain()
    memory = await service.load_memory("u1")
    assert [(f.subject, f.reinforcement_count) for f in memory.facts] == [
        ("tool_affinity:get_account", 2)
    ]
    assert service.stats().load_errors == 0


class _NaNForOneTool(ExponentialDecay):
    """A host's decay that gives NaN for one tool's facts (a division by zero of its own)."""

    def decayed(self, fact: Fact, now: datetime) -> float:
        if fact.subject == "tool_affinity:broken":
            return math.nan
        return super().decayed(fact, now)


async def test_a_fact_whose_decay_is_nan_expires_and_the_others_are_stored(
    make_service: ServiceFactory, clock: FakeClock
) -> None:
    """Reads left the fact out (NaN is not at or above the expiry threshold) but
    consolidation kept it (nor is NaN below it): it never expired, and every load ran a
    consolidation. Expired, its event held a NaN confidence, which JSON refuses: on Redis
    every consolidation of the identity failed, its other facts never stored."""
    service = await make_service(decay=_NaNForOneTool())
    service.emit_observation("u1", tool_ok("broken", session="s1"))
    service.emit_observation("u1", tool_ok("fine", session="s1"))
    clock.now = T0 + timedelta(minutes=1)
    await service.drain()
    loaded = await service.load_memory("u1")
    assert [f.subject for f in loaded.facts] == ["tool_affinity:fine"]
    assert {f.subject for f in await service.facts("u1")} == {"tool_affinity:fine"}
    events = await service.history("u1", "tool_affinity:broken")
    assert [e.kind.value for e in events] == ["created", "expired"]
    assert events[-1].confidence_before is None
    assert service.stats().load_errors == 0
