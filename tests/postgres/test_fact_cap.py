"""The cap on facts per identity applied on the server (coda_memory.core.caps.FactCap): an
identity far over the cap is brought down where its facts are, to the facts the
consolidation would have kept, without reading them all into the application."""

from __future__ import annotations

import logging
import random
from datetime import timedelta
from typing import Any

import pytest

from coda_memory import MemoryService
from coda_memory.core.caps import FactCap
from coda_memory.core.decay import AdaptiveDecay, DecayStrategy, ExponentialDecay
from coda_memory.core.model import Fact
from coda_memory.postgres import PostgresStore, known, rows, unit
from tests.helpers import tool_ok
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
        await fetch(
            url,
            "INSERT INTO coda_memory.checkpoints (identity_id, snapshot, consolidated_at, runs)"
            " VALUES (:identity, CAST(pg_current_snapshot() AS text), :at, 1)",
            identity=identity,
            at=NOW,
        )
    return expired


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


def _summary(facts: list[Fact]) -> list[tuple[str, float, int]]:
    return [(f.subject, f.confidence, f.reinforcement_count) for f in facts]


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
) -> None:
    expired = await _seed(pg_url, ["alice", "bob"], seed=3)
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
        with caplog.at_level(logging.WARNING, "coda_memory"):
            facts = await service.consolidate("alice")
        assert _summary(facts) == _summary(expected)
        stored = sorted(await store.facts("alice"), key=lambda f: f.subject)
        assert [f.subject for f in stored] == [f.subject for f in expected]
        # Read into the application: what the server left (the cap, a margin and the
        # expired facts), not the 400.
        cap = store._fact_cap
        assert isinstance(cap, FactCap) and cap.keep == KEEP
        assert decoded[0] <= cap.kept_on_server + len(gone)
        assert service.stats().facts_evicted == evicted
        assert "deleted by the store" in caplog.text
        # The expired facts went through the consolidation, which recorded their expiry.
        history = await service.history("alice")
        assert sorted(e.subject for e in history if e.kind == "expired") == gone
    finally:
        await service.close()
        await reference.close()


async def test_an_identity_whose_observations_wait_is_capped_by_its_consolidation(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Observations may raise a fact's rank: the store leaves the cap to the consolidation,
    which reads every fact."""
    await _seed(pg_url, ["alice", "bob"], seed=4)
    reference = MemoryService(
        PostgresStore.from_url(pg_url), clock=lambda: NOW, max_facts=KEEP, decay=PythonOnlyDecay()
    )
    service = MemoryService(PostgresStore.from_url(pg_url), clock=lambda: NOW, max_facts=KEEP)
    try:
        for who in (reference, service):
            who.emit_observation(
                "bob" if who is reference else "alice", tool_ok("get_account", at=NOW)
            )
            await who.drain()
        expected = await reference.consolidate("bob")
        decoded = _decoded(monkeypatch)
        facts = await service.consolidate("alice")
        assert _summary(facts) == _summary(expected)
        assert decoded[0] == FACTS
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
