"""The cap on facts per identity applied on the server (coda_memory.core.caps.FactCap): an
identity far over the cap is brought down where its facts are, to the facts the
consolidation would have kept, without reading them all into the application."""

from __future__ import annotations

import logging
import random
from datetime import datetime, timedelta
from typing import Any

import pytest

from coda_memory import MemoryService
from coda_memory.core.caps import FactCap, kept_on_server
from coda_memory.core.decay import AdaptiveDecay, DecayStrategy, ExponentialDecay
from coda_memory.core.model import Fact, FactEvent
from coda_memory.postgres import PostgresStore, known, rows, unit
from coda_memory.postgres import store as store_module
from tests.helpers import entity, tool_ok
from tests.postgres.helpers import NOW, fetch

KEEP = 20
FACTS = 400
EXPIRED = 15


class PythonOnlyDecay(ExponentialDecay):
    """The default decay, as a strategy the store does not know the formula of: its
    consolidations apply the cap in the application only."""


class PythonOnlyAdaptive(AdaptiveDecay):
    """The same for AdaptiveDecay."""


async def _seed(url: str, identities: list[str], seed: int) -> list[str]:
    """``FACTS`` facts for each of ``identities`` (the same ones), with a checkpoint; the
    subjects of those expired at ``NOW``."""
    rng = random.Random(seed)
    rows: list[tuple[Any, ...]] = []
    expired: list[str] = []
    # Names whose code-point order differs from a natural-language collation's.
    names = ["A", "a", "B", "b", "_", "Z", "z", "é", "e"]
    for n in range(FACTS):
        subject = f"entity_frequency:account:{names[n % len(names)]}{n // len(names):03}"
        if n < EXPIRED:
            expired.append(subject)
            anchor, confidence, count = NOW - timedelta(days=400), 0.9, 5
        elif n % 7 == 0:
            # Tied on every input of the rank: the subject decides among them.
            anchor, confidence, count = NOW - timedelta(days=2), 0.6, 6
        elif n % 11 == 0:
            # Anchored ahead of NOW (a clock ahead reinforced it): no decay until then.
            anchor = NOW + timedelta(seconds=rng.uniform(0, 60 * 86_400))
            confidence, count = rng.uniform(0.2, 1.0), rng.randint(1, 12)
        else:
            anchor = NOW - timedelta(seconds=rng.uniform(0, 30 * 86_400))
            confidence, count = rng.uniform(0.2, 1.0), rng.randint(1, 12)
        ease = None if n % 3 == 0 else rng.uniform(1.3, 3.0)
        rows.append((subject, confidence, count, anchor, ease))
    for identity in identities:
        await fetch(
            url,
            "INSERT INTO coda_memory.facts (identity_id, subject, category, content, confidence,"
            " reinforcement_count, last_reinforced_at, confidence_at, created_at, updated_at,"
            " ease_factor) SELECT :identity, s, 'entity_frequency', 'Works with ' || s, c,"
            " n, a, a, a, a, e FROM unnest(CAST(:s AS text[]), CAST(:c AS float8[]),"
            " CAST(:n AS int[]), CAST(:a AS timestamptz[]), CAST(:e AS float8[]))"
            " AS t(s, c, n, a, e)",
            identity=identity,
            s=[r[0] for r in rows],
            c=[r[1] for r in rows],
            n=[r[2] for r in rows],
            a=[r[3] for r in rows],
            e=[r[4] for r in rows],
        )
        await _checkpoint(url, identity, NOW)
    return expired


async def _checkpoint(url: str, identity: str, at: datetime) -> None:
    """A checkpoint for ``identity`` that has consumed everything stored so far."""
    await fetch(
        url,
        "INSERT INTO coda_memory.checkpoints (identity_id, snapshot, consolidated_at, runs)"
        " VALUES (:identity, CAST(pg_current_snapshot() AS text), :at, 1)",
        identity=identity,
        at=at,
    )


async def _seed_alike(
    url: str,
    identity: str,
    subjects: list[str],
    confidence: float,
    count: int,
    at: datetime,
    checkpoint_at: datetime,
) -> None:
    """Facts of ``subjects`` for ``identity``, all with the same confidence, count and
    anchor (``at``), and a checkpoint made at ``checkpoint_at``."""
    await fetch(
        url,
        "INSERT INTO coda_memory.facts (identity_id, subject, category, content, confidence,"
        " reinforcement_count, last_reinforced_at, confidence_at, created_at, updated_at)"
        " SELECT :identity, s, 'entity_frequency', 'Works with ' || s, :c, :n, :at, :at,"
        " :at, :at FROM unnest(CAST(:s AS text[])) AS t(s)",
        identity=identity,
        s=subjects,
        c=confidence,
        n=count,
        at=at,
    )
    await _checkpoint(url, identity, checkpoint_at)


def _decoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the stored fact rows the store decodes into the application."""
    seen = [0]
    keep_row, fact_row = known.kept_from_row, rows.fact_from_row

    def kept_from_row(identity_id: str, row: Any) -> dict[str, Any]:
        seen[0] += 1
        return keep_row(identity_id, row)

    def fact_from_row(identity_id: str, row: Any) -> Fact:
        seen[0] += 1
        return fact_row(identity_id, row)

    monkeypatch.setattr(known, "kept_from_row", kept_from_row)
    monkeypatch.setattr(unit, "fact_from_row", fact_from_row)
    return seen


def _expiry(event: FactEvent) -> tuple[str, datetime, tuple[Any, ...]]:
    """An expiry event: its subject, its instant, and every other field but its identity
    and the instant it was recorded."""
    fields = event.model_dump(exclude={"identity_id", "subject", "at"})
    return event.subject, event.at, tuple(sorted(fields.items()))


def _summary(facts: list[Fact]) -> list[tuple[str, float, int]]:
    return [(f.subject, f.confidence, f.reinforcement_count) for f in facts]


def _chunks(
    monkeypatch: pytest.MonkeyPatch,
    size: int | None,
    fields: tuple[str, str] = ("dropped", "beyond"),
) -> list[tuple[int, int]]:
    """Sets the cap's chunk (None: the default) and records each transaction's
    ``fields`` (by default, how many it dropped and how many ranked beyond the cap)."""
    if size is not None:
        monkeypatch.setattr(store_module, "CAP_CHUNK", size)
    seen: list[tuple[int, int]] = []
    chunk = PostgresStore._cap_chunk

    async def recorded(self: PostgresStore, identity_id: str, cap: FactCap) -> Any:
        row = await chunk(self, identity_id, cap)
        seen.append((row[fields[0]], row[fields[1]]))
        return row

    monkeypatch.setattr(PostgresStore, "_cap_chunk", recorded)
    return seen


@pytest.mark.parametrize("chunk", [None, 50], ids=["one statement", "chunks of 50"])
@pytest.mark.parametrize(
    ("decay", "python_only"),
    [(ExponentialDecay(), PythonOnlyDecay()), (AdaptiveDecay(), PythonOnlyAdaptive())],
    ids=["exponential", "adaptive"],
)
async def test_an_identity_far_over_the_cap_keeps_what_the_consolidation_would_keep(
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    decay: DecayStrategy,
    python_only: DecayStrategy,
    chunk: int | None,
) -> None:
    """Also in chunks: each transaction deletes the lowest ranked, and those left are
    the same."""
    expired = await _seed(pg_url, ["alice", "bob"], seed=3)
    chunks = _chunks(monkeypatch, chunk)
    # bob: the same facts, capped by the consolidation in the application only.
    reference = MemoryService(
        PostgresStore.from_url(pg_url), clock=lambda: NOW, max_facts=KEEP, decay=python_only
    )
    store = PostgresStore.from_url(pg_url)
    service = MemoryService(store, clock=lambda: NOW, max_facts=KEEP, decay=decay)
    try:
        expected = await reference.consolidate("bob")
        assert len(expected) == KEEP
        gone = sorted(e.subject for e in await reference.history("bob") if e.kind == "expired")
        assert set(expired) <= set(gone)
        evicted = reference.stats().facts_evicted
        assert evicted == FACTS - len(gone) - KEEP
        decoded = _decoded(monkeypatch)
        caplog.clear()  # the reference's line
        with caplog.at_level(logging.WARNING, "coda_memory"):
            facts = await service.consolidate("alice")
        assert _summary(facts) == _summary(expected)
        stored = sorted(await store.facts("alice"), key=lambda f: f.subject)
        assert [f.subject for f in stored] == [f.subject for f in expected]
        # Read into the application: what the server left (the cap and a margin), not
        # the 400.
        cap = store._fact_cap
        assert isinstance(cap, FactCap) and cap.keep == KEEP
        assert decoded[0] <= cap.kept_on_server
        assert service.stats().facts_evicted == evicted
        # One cap, applied on the server and finished by the consolidation: counted and
        # logged once, as the reference's.
        assert service.stats().facts_capped == reference.stats().facts_capped == 1
        lines = [r for r in caplog.records if "facts per identity capped" in r.getMessage()]
        assert len(lines) == 1
        # ... with every fact the cap deleted, the server's and the consolidation's.
        by_server = FACTS - len(gone) - cap.kept_on_server
        by_consolidation = cap.kept_on_server - KEEP
        assert f"{evicted} deleted ({by_server} by the store, {by_consolidation} by the " in (
            lines[0].getMessage()
        )
        # Live facts beyond what the server keeps, deleted CAP_CHUNK (50 when so set) or
        # a quarter of those left at a time, whichever is more.
        beyond = FACTS - len(gone) - cap.kept_on_server
        size = chunk or store_module.CAP_CHUNK
        expected_chunks = []
        while beyond:
            expected_chunks.append((min(beyond, max(size, beyond // 4)), beyond))
            beyond -= expected_chunks[-1][0]
        assert chunks == expected_chunks
        # The expired facts went on the server, each with the event the consolidation
        # recorded for it (the instant it expired within a microsecond: the server
        # rounds the days to microseconds as it adds them, Python as it makes them).
        expiries = [_expiry(e) for e in await service.history("alice") if e.kind == "expired"]
        reference_expiries = [
            _expiry(e) for e in await reference.history("bob") if e.kind == "expired"
        ]
        assert [e[0] for e in expiries] == gone
        assert [e[0] for e in reference_expiries] == gone
        for (subject, at, rest), (_, expected_at, expected_rest) in zip(
            expiries, reference_expiries, strict=True
        ):
            assert rest == expected_rest, subject
            assert abs(at - expected_at) <= timedelta(microseconds=1), subject
    finally:
        await service.close()
        await reference.close()


async def test_a_dormant_identity_far_over_the_cap_has_its_expired_facts_expired_on_the_server(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fact expired (an identity imported, or far over the cap, then idle for a
    year): none ranks, so none is capped, but none is read into the application either;
    they expire on the server, 64 a transaction or a quarter of those left when that is
    more, each with its event."""
    subjects = [f"entity_frequency:account:x{n:03}" for n in range(FACTS)]
    year_ago = NOW - timedelta(days=365)
    await _seed_alike(pg_url, "alice", subjects, 0.8, 3, year_ago, year_ago)
    statements = _chunks(monkeypatch, 64, ("expired", "expirable"))
    decoded = _decoded(monkeypatch)
    service = MemoryService(PostgresStore.from_url(pg_url), clock=lambda: NOW, max_facts=KEEP)
    try:
        assert await service.consolidate("alice") == []
        assert decoded[0] == 0
        # 400 expired (counted before each statement): a quarter, then 64 at a time.
        assert statements == [(100, 400), (75, 300), (64, 225), (64, 161), (64, 97), (33, 33)]
        history = await service.history("alice")
        assert [e.subject for e in history if e.kind == "expired"] == subjects
        assert service.stats().facts_capped == 0  # expired, not capped
        assert await fetch(pg_url, "SELECT count(*) FROM coda_memory.facts") == [(0,)]
    finally:
        await service.close()


@pytest.mark.parametrize("chunk", [None, 7], ids=["one statement", "chunks of 7"])
async def test_facts_tied_on_their_rank_are_kept_by_subject_in_code_point_order(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, chunk: int | None
) -> None:
    """Every fact tied: the subject alone decides which are kept, at the server's cut and
    at the consolidation's, in chunks too."""
    chunks = _chunks(monkeypatch, chunk)
    subjects = [f"entity_frequency:account:{c}{n}" for n in range(12) for c in "aAbB_zZé"]
    for identity in ("alice", "bob"):
        await _seed_alike(pg_url, identity, subjects, 0.7, 4, NOW - timedelta(days=1), NOW)
    reference = MemoryService(
        PostgresStore.from_url(pg_url), clock=lambda: NOW, max_facts=KEEP, decay=PythonOnlyDecay()
    )
    service = MemoryService(PostgresStore.from_url(pg_url), clock=lambda: NOW, max_facts=KEEP)
    try:
        expected = await reference.consolidate("bob")
        facts = await service.consolidate("alice")
        assert [f.subject for f in facts] == [f.subject for f in expected]
        assert sorted(f.subject for f in facts) == sorted(subjects, key=str.encode)[:KEEP]
        assert sum(dropped for dropped, _ in chunks) == len(subjects) - (KEEP + 10)
        # 66 beyond the cap: 16, 12, 9, 7 (a quarter, at least 7), 7, 7, 7, 1.
        assert [d for d, _ in chunks] == ([66] if chunk is None else [16, 12, 9, 7, 7, 7, 7, 1])
    finally:
        await service.close()
        await reference.close()


async def test_the_cap_runs_under_its_own_statement_timeout(pg_url: str) -> None:
    """The cap's statements rank all the identity's facts, so they run under
    CAP_STATEMENT_TIMEOUT, not the request's: under that one an identity with very many
    facts was never capped, and every load of it came back empty."""
    await _seed(pg_url, ["alice"], seed=5)
    # Here a delete of more than 100 facts takes 0.3 s (what the cap's statement does,
    # not the consolidation's), over the store's statement timeout of 0.2 s.
    await fetch(
        pg_url,
        "CREATE FUNCTION coda_memory.slow_delete() RETURNS trigger LANGUAGE plpgsql AS"
        " 'BEGIN IF (SELECT count(*) FROM gone) > 100 THEN PERFORM pg_sleep(0.3); END IF;"
        " RETURN NULL; END'",
    )
    await fetch(
        pg_url,
        "CREATE TRIGGER slow_delete AFTER DELETE ON coda_memory.facts REFERENCING OLD TABLE"
        " AS gone FOR EACH STATEMENT EXECUTE FUNCTION coda_memory.slow_delete()",
    )
    store = PostgresStore.from_url(pg_url, statement_timeout=timedelta(milliseconds=200))
    service = MemoryService(store, clock=lambda: NOW, max_facts=KEEP)
    try:
        facts = await service.consolidate("alice")
        assert len(facts) == KEEP
        # Applied on the server, then exactly: one cap, counted once.
        assert service.stats().facts_capped == 1
    finally:
        await service.close()


@pytest.mark.parametrize("chunk", [None, 50], ids=["one statement", "chunks of 50"])
async def test_the_cap_spares_the_facts_that_waiting_observations_may_change(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, chunk: int | None
) -> None:
    """Observations wait, and 30 sessions of them reach one of the lowest ranked facts,
    raising it into the cap, and a tool call reaches a fact not stored: the store
    caps the rest on the server (it does not read every fact) and spares what they
    reach, so the consolidation keeps what one that read every fact keeps."""
    expired = await _seed(pg_url, ["alice", "bob"], seed=4)
    chunks = _chunks(monkeypatch, chunk)
    # The lowest scored of the facts reinforced in the last day, more than once (far from
    # expiry, ranked by about their stored score), whose name is an identifier.
    [lowest] = await fetch(
        pg_url,
        "SELECT subject, reinforcement_count FROM coda_memory.facts WHERE identity_id = 'bob'"
        " AND confidence_at > :recent AND reinforcement_count > 1"
        " AND subject ~ ':[A-Za-z][0-9]+$'"
        " ORDER BY confidence * reinforcement_count, subject LIMIT 1",
        recent=NOW - timedelta(days=1),
    )
    entity_id = lowest[0].rsplit(":", 1)[1]
    reference = MemoryService(
        PostgresStore.from_url(pg_url), clock=lambda: NOW, max_facts=KEEP, decay=PythonOnlyDecay()
    )
    service = MemoryService(PostgresStore.from_url(pg_url), clock=lambda: NOW, max_facts=KEEP)
    try:
        for who, identity in ((reference, "bob"), (service, "alice")):
            for n in range(30):
                at = NOW - timedelta(minutes=60 - n)
                who.emit_observation(identity, entity("account", entity_id, session=f"w{n}", at=at))
            who.emit_observation(identity, tool_ok("get_account", at=NOW))
            await who.drain()
        expected = await reference.consolidate("bob")
        # The fact the observations reached is among those kept, reinforced 30 times: a
        # cap that deleted it would have it start again at a count of 1.
        raised = {f.subject: f.reinforcement_count for f in expected}
        assert raised[lowest[0]] == lowest[1] + 30
        gone = [e.subject for e in await reference.history("bob") if e.kind == "expired"]
        assert set(expired) <= set(gone)
        decoded = _decoded(monkeypatch)
        facts = await service.consolidate("alice")
        assert _summary(facts) == _summary(expected)
        # Capped on the server first: read into the application, the cap, its margin
        # and the one spared fact that was stored, not the 400 (nor the expired ones).
        assert chunks and sum(dropped for dropped, _ in chunks) > 0
        assert decoded[0] <= kept_on_server(KEEP) + 1
    finally:
        await service.close()
        await reference.close()


async def test_a_strategy_the_store_cannot_compute_is_capped_in_the_application(
    pg_url: str,
) -> None:
    store = PostgresStore.from_url(pg_url)
    service = MemoryService(store, clock=lambda: NOW, max_facts=KEEP, decay=PythonOnlyDecay())
    try:
        assert store._fact_cap is None
        uncapped = MemoryService(PostgresStore.from_url(pg_url), max_facts=None)
        assert uncapped.store._fact_cap is None  # type: ignore[attr-defined]
        await uncapped.close()
        await _seed(pg_url, ["alice"], seed=5)
        assert len(await service.consolidate("alice")) == KEEP
    finally:
        await service.close()


async def test_facts_decayed_past_what_a_float_holds_expire_on_the_server(pg_url: str) -> None:
    """With base 0.5, a fact three years old decays to 0.5 ** 1095: below the smallest
    float. Postgres's power() fails on that ("value out of range: underflow") where
    Python's gives 0.0, so the cap failed, and the identity's consolidation with it."""
    subjects = [f"entity_frequency:account:x{n:03}" for n in range(FACTS)]
    long_ago = NOW - timedelta(days=3 * 365)
    await _seed_alike(pg_url, "alice", subjects, 0.8, 3, long_ago, long_ago)
    service = MemoryService(
        PostgresStore.from_url(pg_url),
        clock=lambda: NOW,
        max_facts=KEEP,
        decay=ExponentialDecay(base=0.5),
    )
    try:
        assert await service.consolidate("alice") == []
        assert await fetch(pg_url, "SELECT count(*) FROM coda_memory.facts") == [(0,)]
    finally:
        await service.close()


@pytest.mark.parametrize("ease", [5e-5, 5e-324], ids=["small", "subnormal"])
async def test_facts_of_a_tiny_ease_expire_on_the_server(pg_url: str, ease: float) -> None:
    """An ease of 5e-5 (``AdaptiveDecay(min_ease=5e-5)`` allows it) made the expiry's
    one-day power fail with "underflow"; one of 5e-324 (as an import may bring) made
    days / ease fail with "overflow". Either failed the cap, and every consolidation of
    the identity with it. Python's power of such a fact is 0.0: it has expired."""
    subjects = [f"entity_frequency:account:x{n:03}" for n in range(FACTS)]
    await _seed_alike(pg_url, "alice", subjects, 0.8, 3, NOW - timedelta(days=2), NOW)
    fragile = subjects[: FACTS // 2]
    await fetch(
        pg_url,
        "UPDATE coda_memory.facts SET ease_factor = :ease WHERE subject = ANY(:subjects)",
        ease=ease,
        subjects=fragile,
    )
    service = MemoryService(
        PostgresStore.from_url(pg_url),
        clock=lambda: NOW,
        max_facts=KEEP,
        decay=AdaptiveDecay(min_ease=ease),
    )
    try:
        kept = await service.consolidate("alice")
        # The others, tied on their rank, are kept by subject.
        assert [f.subject for f in kept] == subjects[FACTS // 2 :][:KEEP]
        expired = {e.subject for e in await service.history("alice") if e.kind == "expired"}
        assert expired == set(fragile)
    finally:
        await service.close()
