"""The facts a store keeps between requests (coda_memory.postgres.known): always those
stored for the version it keeps them with, read again whenever the version moves."""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text

from coda_memory import MemoryService
from coda_memory.core import turns
from coda_memory.core.model import Fact, ObservationType
from coda_memory.postgres import PostgresStore, unit
from tests.helpers import tool_ok
from tests.postgres.helpers import NOW, engine, fetch, locked, record


def _by_subject(facts: list[Fact]) -> list[Fact]:
    return sorted(facts, key=lambda f: f.subject)


async def _kept(store: PostgresStore, identity_id: str) -> list[Fact] | None:
    entry = store._known.entry(identity_id)
    return None if entry is None else _by_subject(await entry.facts())


async def test_kept_facts_equal_the_stored_ones_after_every_consolidation(pg_url: str) -> None:
    """Creations, reinforcements, extensions, expiries and cap evictions: after each
    consolidation the facts kept are exactly those a read returns."""
    store = PostgresStore.from_url(pg_url)
    now = [NOW]
    service = MemoryService(store, clock=lambda: now[0], max_facts=12)
    rng = random.Random(7)
    try:
        for run in range(25):
            # Days pass, sometimes enough for facts to expire.
            now[0] += timedelta(days=rng.choice([0, 0.01, 1, 3, 60]))
            batch = []
            for n in range(rng.randint(1, 12)):
                kind = rng.choice(list(ObservationType))
                batch.append(
                    record(
                        f"run {run} #{n}",
                        type=kind,
                        metadata={
                            "toolName": f"tool_{rng.randint(0, 6)}",
                            "entityType": "account",
                            "entityId": str(rng.randint(0, 6)),
                            "domain": f"domain_{rng.randint(0, 3)}",
                        },
                        session_id=f"s{rng.randint(0, run + 1)}",
                        created_at=now[0] - timedelta(seconds=rng.randint(0, 600)),
                    )
                )
            await store.append(batch)
            await service.consolidate("alice")
            kept = await _kept(store, "alice")
            assert kept is not None
            assert kept == _by_subject(await store.facts("alice"))
        assert service.stats().facts_evicted > 0  # the cap applied along the way
    finally:
        await service.close()


async def _checkpoint_version(url: str) -> str:
    rows = await fetch(
        url,
        "SELECT concat(snapshot, '/', xmin) FROM coda_memory.checkpoints "
        "WHERE identity_id = 'alice'",
    )
    return str(rows[0][0])


async def _consolidated(url: str, **options: Any) -> PostgresStore:
    store = PostgresStore.from_url(url, **options)
    await store.append([record("called get_account")])
    service = MemoryService(store, clock=lambda: NOW)
    await service.consolidate("alice")
    return store


async def test_a_peek_reads_the_facts_only_when_the_checkpoint_row_moved(pg_url: str) -> None:
    store = await _consolidated(pg_url)
    try:
        facts, pending = await store.peek("alice")
        assert [f.confidence for f in facts] == [0.5] and not pending
        # A hand-made change of the facts that leaves the checkpoint row alone is not seen:
        # the kept facts go with the row's version (the documented contract) ...
        await fetch(pg_url, "UPDATE coda_memory.facts SET confidence = 0.25")
        facts, _ = await store.peek("alice")
        assert [f.confidence for f in facts] == [0.5]
        # ... and a new version of the row makes the next peek read them.
        before = await _checkpoint_version(pg_url)
        await fetch(pg_url, "UPDATE coda_memory.checkpoints SET snapshot = snapshot")
        assert await _checkpoint_version(pg_url) != before
        facts, _ = await store.peek("alice")
        assert [f.confidence for f in facts] == [0.25]
    finally:
        await store.close()


async def test_a_consolidation_by_another_process_is_seen(pg_url: str) -> None:
    first = await _consolidated(pg_url)
    second = PostgresStore.from_url(pg_url)
    later: datetime = NOW + timedelta(hours=1)
    try:
        await second.append([record("called get_account", session_id="s2", created_at=later)])
        await MemoryService(second, clock=lambda: later).consolidate("alice")
        facts, pending = await first.peek("alice")
        assert not pending
        assert [f.reinforcement_count for f in facts] == [2]
        # The consolidation that follows in the first process uses what it just read.
        assert await _kept(first, "alice") == _by_subject(await second.facts("alice"))
    finally:
        await first.close()
        await second.close()


@pytest.mark.parametrize(("capacity", "reads", "dropped"), [(1, 5, 5), (10, 0, 0)])
async def test_stats_count_the_kept_facts_dropped_for_room_and_the_reads_they_cost(
    pg_url: str, capacity: int, reads: int, dropped: int
) -> None:
    """With room for one identity's fact, peeks of two identities in turn drop each
    other's and read it again every time, and so does the peek of a consolidation; with
    room for both, nothing is dropped or read again."""
    store = PostgresStore.from_url(pg_url, known_facts=capacity)
    service = MemoryService(store, clock=lambda: NOW)
    try:
        for who in ("alice", "bob"):
            await store.append([record(identity_id=who)])
            await service.consolidate(who)
        before = service.stats()
        for who in ("alice", "bob", "alice", "bob"):
            facts, pending = await store.peek(who)
            assert len(facts) == 1 and not pending
        later = NOW + timedelta(hours=1)
        await store.append([record(session_id="s2", created_at=later)])
        await MemoryService(store, clock=lambda: later).consolidate("alice")
        after = service.stats()
        assert after.facts_reads - before.facts_reads == reads
        assert after.kept_facts_dropped - before.kept_facts_dropped == dropped
        assert [f.reinforcement_count for f in await store.facts("alice")] == [2]
    finally:
        await service.close()


async def test_an_identity_with_more_facts_than_the_room_is_read_by_each_request(
    pg_url: str,
) -> None:
    """Facts that can't be kept are read by every peek, and again by the consolidation
    that follows one (it finds none kept); none is counted as dropped."""
    store = PostgresStore.from_url(pg_url, known_facts=1)
    service = MemoryService(store, clock=lambda: NOW)
    try:
        await store.append(
            [record(f"called {tool}", metadata={"toolName": tool}) for tool in ("a", "b")]
        )
        await service.consolidate("alice")
        before = service.stats()
        facts, _ = await store.peek("alice")
        assert len(facts) == 2
        middle = service.stats()
        later = NOW + timedelta(hours=1)
        await store.append([record("called a", metadata={"toolName": "a"}, created_at=later)])
        await MemoryService(store, clock=lambda: later).consolidate("alice")
        after = service.stats()
        assert middle.facts_reads - before.facts_reads == 1
        assert after.facts_reads - middle.facts_reads == 2
        assert after.kept_facts_dropped == before.kept_facts_dropped
    finally:
        await service.close()


async def test_a_peek_that_finds_observations_waiting_leaves_the_facts_to_the_kept_ones(
    pg_url: str,
) -> None:
    """The consolidation that follows uses the facts the store keeps, so the peek builds
    none; a load that outlives its timeout meanwhile answers with the kept ones."""
    store = await _consolidated(pg_url)
    service = MemoryService(store, clock=lambda: NOW, load_timeout=0.2)
    holder = engine(pg_url)
    try:
        await store.append([record("called get_account again", session_id="s2")])
        assert await store.peek("alice") == ([], True)
        assert [f.subject for f in await store.kept_facts("alice")] == ["tool_affinity:get_account"]
        # The consolidation waits for the checkpoint row: the load answers late, from
        # the facts at hand.
        async with holder.begin() as conn:
            await conn.execute(
                text("SELECT 1 FROM coda_memory.checkpoints WHERE identity_id = 'alice' FOR UPDATE")
            )
            loaded = await service.load_memory("alice")
        assert [f.subject for f in loaded.facts] == ["tool_affinity:get_account"]
        assert service.stats().load_stale == 1
    finally:
        await holder.dispose()
        await service.close()


async def test_a_peek_gives_the_facts_it_cannot_keep_even_when_observations_wait(
    pg_url: str,
) -> None:
    store = await _consolidated(pg_url, known_facts=0)
    try:
        await store.append([record("called get_account again", session_id="s2")])
        facts, pending = await store.peek("alice")
        assert pending and [f.subject for f in facts] == ["tool_affinity:get_account"]
        assert await store.kept_facts("alice") == []
    finally:
        await store.close()


async def test_forget_drops_the_kept_facts(pg_url: str) -> None:
    store = await _consolidated(pg_url)
    try:
        assert await _kept(store, "alice") is not None
        await store.forget("alice")
        assert await _kept(store, "alice") is None
        assert await store.peek("alice") == ([], False)
    finally:
        await store.close()


async def test_a_forget_cancelled_after_its_commit_leaves_no_fact_of_it_here(
    pg_url: str,
) -> None:
    """The caller cannot tell whether a cancelled forget erased the identity: kept facts
    and answers of it then served the forgotten facts to a late or stale load."""
    store = await _consolidated(pg_url)
    service = MemoryService(store, clock=lambda: NOW)
    run = store.run

    async def cancelled_after(work: Any, **options: Any) -> Any:
        await run(work, **options)  # committed ...
        raise asyncio.CancelledError  # ... and the cancellation arrives then

    try:
        assert [f.subject for f in (await service.load_memory("alice")).facts] == [
            "tool_affinity:get_account"
        ]
        assert service._recent.fresh("alice", NOW) is not None
        assert await _kept(store, "alice") is not None
        store.run = cancelled_after  # type: ignore[method-assign]
        with pytest.raises(asyncio.CancelledError):
            await service.forget("alice")
        assert await fetch(pg_url, "SELECT count(*) FROM coda_memory.facts") == [(0,)]
        assert await _kept(store, "alice") is None
        assert service._recent.fresh("alice", NOW) is None
    finally:
        store.run = run  # type: ignore[method-assign]
        await service.close()


async def test_facts_at_hand_that_the_catalog_leaves_out_are_no_stale_answer(
    pg_url: str,
) -> None:
    """Every kept fact about a tool the catalog dropped: the failed load's answer from
    them was empty, yet counted in ``load_stale`` (an answer that is not empty) and
    logged as answering with the facts of the last consolidation."""
    store = await _consolidated(pg_url)  # alice: tool_affinity:get_account, kept
    service = MemoryService(store, clock=lambda: NOW, tool_catalog={"run_sql"})

    async def failing(identity_id: str) -> Any:
        raise RuntimeError("the store failed")

    store.peek_versioned = failing  # type: ignore[method-assign]
    try:
        assert await _kept(store, "alice") is not None
        loaded = await service.load_memory("alice")
        stats = service.stats()
        assert loaded.facts == [] and loaded.prompt_section == ""
        assert (stats.load_stale, stats.load_errors) == (0, 1)
    finally:
        await service.close()


async def test_no_facts_are_kept_with_a_capacity_of_zero(pg_url: str) -> None:
    store = PostgresStore.from_url(pg_url, known_facts=0)
    try:
        await store.append([record("called get_account")])
        await MemoryService(store, clock=lambda: NOW).consolidate("alice")
        assert await _kept(store, "alice") is None
        facts, _ = await store.peek("alice")
        assert [f.subject for f in facts] == ["tool_affinity:get_account"]
    finally:
        await store.close()


async def test_a_load_after_this_service_stored_observations_skips_the_peek(
    pg_url: str,
) -> None:
    """Observations this service stored since it last consolidated the identity make the
    next load consolidate without peeking first (one round trip less); any other load
    peeks, so what another process stored or consolidated is still seen."""
    store = PostgresStore.from_url(pg_url)
    peeks: list[str] = []
    peek = store.peek_versioned

    async def counted_peek(identity_id: str) -> tuple[list[Fact], bool, str | None]:
        peeks.append(identity_id)
        return await peek(identity_id)

    store.peek_versioned = counted_peek  # type: ignore[method-assign]
    service = MemoryService(store, clock=lambda: NOW + timedelta(hours=1))
    other = PostgresStore.from_url(pg_url)
    try:
        service.emit_observation("alice", tool_ok("get_account", session="s1", at=NOW))
        await service.drain()
        # Nothing kept for alice yet: the first load peeks (and reads her facts).
        assert [f.reinforcement_count for f in (await service.load_memory("alice")).facts] == [1]
        assert peeks == ["alice"]
        service.emit_observation("alice", tool_ok("get_account", session="s2", at=NOW))
        await service.drain()
        assert "alice" in service.stored_for
        loaded = await service.load_memory("alice")
        assert [f.reinforcement_count for f in loaded.facts] == [2]
        assert peeks == ["alice"]  # consolidated without a peek
        assert "alice" not in service.stored_for
        # Nothing new from this service: the load peeks, and sees another process's work.
        await other.append([record("called get_account", session_id="s3", created_at=NOW)])
        loaded = await service.load_memory("alice")
        assert [f.reinforcement_count for f in loaded.facts] == [3]
        assert peeks == ["alice", "alice"]
        # A forgotten identity is not consolidated again (no checkpoint row comes back).
        service.emit_observation("alice", tool_ok("get_account", session="s4", at=NOW))
        await service.drain()
        await service.forget("alice")
        assert "alice" not in service.stored_for
        assert (await service.load_memory("alice")).facts == []
        assert await fetch(pg_url, "SELECT count(*) FROM coda_memory.checkpoints") == [(0,)]
    finally:
        await service.close()
        await other.close()


async def test_a_load_stuck_before_its_peek_answers_from_the_kept_facts(pg_url: str) -> None:
    """A load that times out before its peek returns (here the checkpoints table is
    locked, and the peek waits for it without limit) answers from the facts the store
    keeps, not empty."""
    store = await _consolidated(pg_url, table_lock_timeout=None)
    service = MemoryService(store, clock=lambda: NOW, load_timeout=0.2)
    try:
        async with locked(pg_url, "checkpoints"):
            loaded = await service.load_memory("alice")
        assert [f.subject for f in loaded.facts] == ["tool_affinity:get_account"]
        assert "get_account" in loaded.tool_affinities
        stats = service.stats()
        assert (stats.load_stale, stats.load_timeouts) == (1, 0)
    finally:
        await service.close()


async def test_a_cap_that_drops_many_facts_deletes_them_in_slices_and_keeps_the_best(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big identity: its facts are read in slices with turns of the loop, the collector
    is held off for its load and given back, and a cap's deletes go ahead in slices."""
    monkeypatch.setattr(turns, "SLICE", 10)
    monkeypatch.setattr(unit, "DELETE_SLICE", 7)
    store = PostgresStore.from_url(pg_url)
    writer = MemoryService(store, clock=lambda: NOW, max_facts=None)
    # tool_k is used in 1 + k % 4 sessions: the rank grows with that, then with the name.
    batch = [
        record(f"call {k}/{s}", metadata={"toolName": f"tool_{k:02}"}, session_id=f"s{s}")
        for k in range(60)
        for s in range(1 + k % 4)
    ]
    await store.append(batch)
    assert len(await writer.consolidate("alice")) == 60
    held: list[bool] = []
    take = turns._HOLDS.take

    def counted_take(may_collect: Callable[[], bool] | None = None) -> int:
        held.append(True)
        return take(may_collect)

    monkeypatch.setattr(turns._HOLDS, "take", counted_take)
    service = MemoryService(store, clock=lambda: NOW, max_facts=8)
    try:
        loaded = await service.load_memory("alice")
        stored = _by_subject(await store.facts("alice"))
        # Of the fifteen used in four sessions, equally ranked, the first eight by subject.
        expected = [f"tool_affinity:tool_{k:02}" for k in range(3, 60, 4)[:8]]
        assert [f.subject for f in stored] == expected
        assert [f.subject for f in loaded.facts] == expected
        assert await _kept(store, "alice") == stored
        assert service.stats().facts_evicted == 52
        assert held and gc.isenabled() and not turns.collector_held()
    finally:
        await service.close()
        await writer.close()


async def test_a_consolidation_that_finds_another_version_drops_the_kept_facts(
    pg_url: str,
) -> None:
    """Another process forgot the identity: a consolidation here that got as far as the
    checkpoint's lock and then failed (or outlived its load's timeout) left the erased
    facts kept, and a load answered from them (the answer of a load that timed out)."""
    store = await _consolidated(pg_url)
    other = PostgresStore.from_url(pg_url)
    try:
        assert await store.kept_facts("alice") != []
        await other.forget("alice")
        await store.append([record("called get_account again", session_id="s2")])
        with pytest.raises(RuntimeError, match="failed after the lock"):
            async with store.consolidation("alice"):
                raise RuntimeError("failed after the lock")
        assert await store.kept_facts("alice") == []
    finally:
        await other.close()
        await store.close()


async def test_a_consolidation_that_finds_the_kept_version_keeps_them(pg_url: str) -> None:
    store = await _consolidated(pg_url)
    try:
        kept = await store.kept_facts("alice")
        with pytest.raises(RuntimeError):
            async with store.consolidation("alice"):
                raise RuntimeError("failed after the lock")
        assert [f.subject for f in await store.kept_facts("alice")] == [f.subject for f in kept]
    finally:
        await store.close()


async def _history_sent_in(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, identity: str, slice_size: int
) -> tuple[list[dict[str, Any]], int]:
    """``identity``'s history after one consolidation of 30 observations in 6 sessions,
    with events sent ahead in slices of ``slice_size``; and how many were sent ahead."""
    monkeypatch.setattr(unit, "EVENTS_SLICE", slice_size)
    store = PostgresStore.from_url(pg_url)
    service = MemoryService(store, clock=lambda: NOW)
    sent: list[str] = []
    raw_execute = asyncpg.Connection.execute
    try:
        calls = [(k, s) for s in range(6) for k in range(5)]
        await store.append(
            [
                record(
                    f"call {k}/{s}",
                    identity_id=identity,
                    metadata={"toolName": f"tool_{k:02}"},
                    session_id=f"s{s}",
                )
                for k, s in calls
            ]
        )
        events_sql = store._statements.events.text

        async def counted(self: Any, query: str, *args: Any, **kw: Any) -> Any:
            if query == events_sql:
                sent.append(query)
            return await raw_execute(self, query, *args, **kw)

        with monkeypatch.context() as patched:
            patched.setattr(asyncpg.Connection, "execute", counted)
            await service.consolidate(identity)
        history = await service.history(identity)
        return [e.model_dump(exclude={"identity_id"}) for e in history], len(sent)
    finally:
        await service.close()


async def test_a_backlogs_history_goes_ahead_in_slices_in_its_order(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An identity that wrote 100,000 observations with no load made 100,000 events, and
    their one INSERT ran past the request pool's statement_timeout at every try: the
    identity was never consolidated. Sent ahead in slices, the history is the same, in
    the same order, as one statement records it."""
    whole, none_ahead = await _history_sent_in(pg_url, monkeypatch, "alice", 10_000)
    sliced, ahead = await _history_sent_in(pg_url, monkeypatch, "bob", 7)
    assert (len(whole), none_ahead, ahead) == (30, 0, 5)
    assert sliced == whole
