"""Replay a timeline through a real MemoryService, and the baselines beside it.

For each session of a scored identity, in order of start: the simulated clock is set to
the session's start, the identity's memory is consolidated (what ``load_memory`` does
before the model sees the prompt), its facts are ranked as the prompt section ranks them
(confidence times reinforcement count) and scored against the subjects the session uses, and
then the session's events are emitted as observations at their own times.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from coda_memory.core.decay import DecayStrategy
from coda_memory.core.logs import short_error
from coda_memory.core.model import MAX_SPAN, Fact
from coda_memory.core.rank import ranked_facts
from coda_memory.errors import ConnectionLost
from coda_memory.replay.events import event_observation, fact_subject
from coda_memory.replay.metrics import Calibration, RankingScore
from coda_memory.replay.timeline import Session, Timeline
from coda_memory.service import MemoryService
from coda_memory.stores import REDIS_SCHEMES, url_scheme

logger = logging.getLogger("coda_memory")

#: How many subjects the baselines rank (NDCG@10 looks at ten).
TOP = 10

#: Emits between two drains at most (or ``queue_size``, when smaller).
_DRAIN_EVERY = 1_000


@dataclass
class PeriodScores:
    """The scores of one method over one period (fitting or held out)."""

    ranking: RankingScore = field(default_factory=RankingScore)
    calibration: Calibration = field(default_factory=Calibration)
    facts_total: int = 0

    @property
    def facts_per_identity(self) -> float:
        """Mean number of facts held at a scored session's start."""
        sessions = self.ranking.sessions
        return self.facts_total / sessions if sessions else float("nan")


@dataclass
class ReplayResult:
    """One method's scores on the fitting period and on the held-out one."""

    name: str
    fit: PeriodScores = field(default_factory=PeriodScores)
    test: PeriodScores = field(default_factory=PeriodScores)
    #: True for the decay strategies (their confidences are probabilities to calibrate).
    calibrated: bool = False

    def period(self, held_out: bool) -> PeriodScores:
        return self.test if held_out else self.fit


class _Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def _score(
    result: ReplayResult, timeline: Timeline, session: Session, facts: Sequence[Fact]
) -> None:
    scores = result.period(timeline.held_out(session))
    scores.ranking.add([f.subject for f in ranked_facts(facts)], session.subjects)
    scores.facts_total += len(facts)
    if not timeline.seen_through_horizon(session):
        return  # its "used within the horizon" would count only what the data still holds
    for fact in facts:
        used = timeline.used_within(session.identity, fact.subject, session.start)
        scores.calibration.add(fact.confidence, used)


async def replay_decay(
    timeline: Timeline,
    decay: DecayStrategy,
    *,
    name: str | None = None,
    url: str = "memory://",
    **options: Any,
) -> ReplayResult:
    """Replay the scored identities' sessions through a MemoryService using ``decay``.

    ``url`` is the store the replay writes to (any store; ``memory://`` by default, a
    fresh one per replay). Give it a scratch schema, database or prefix: the replay
    refuses a store that holds memory of any identity it replays
    (:class:`StoreNotScratch`), writes the identities' observations and facts there, and
    erases them when it ends, so that the next method replayed starts from nothing.
    ``options`` go to ``MemoryService.from_url``. A Redis store keeps each session's
    reinforcements for a ``session_horizon`` that covers the whole timeline unless one is
    given: with its 30 days, a session id that came back later reinforced its facts again,
    where Postgres and ``memory://`` keep them for good.
    """
    if url_scheme(url) in REDIS_SCHEMES and "session_horizon" not in options:
        times = [event.time for session in timeline.sessions for event in session.events]
        span = max(times) - min(times)
        options["session_horizon"] = min(MAX_SPAN, span + timedelta(seconds=1))
    result = ReplayResult(name or repr(decay), calibrated=True)
    clock = _Clock(timeline.sessions[0].start)
    service = MemoryService.from_url(url, decay=decay, clock=clock, **options)
    seen: set[str] = set()
    ended = False
    waiting, drain_every = 0, min(_DRAIN_EVERY, options.get("queue_size", _DRAIN_EVERY))
    try:
        if not url.startswith("memory:"):  # a memory:// store is new, so empty
            await _check_scratch(service, sorted(timeline.scored))
        for at, session, event in timeline.in_time_order():
            identity = session.identity
            if identity not in timeline.scored:
                continue
            clock.now = at
            if event is not None:
                service.emit_observation(identity, event_observation(event, session.key))
                waiting += 1
                if waiting >= drain_every:
                    # The writer runs only while the replay waits: more than its queue
                    # holds between two drains, and the rest were dropped ("queue full").
                    await service.drain()
                    waiting = 0
                continue
            if identity in seen:  # a session starts: it is scored on what came before
                await service.drain()
                waiting = 0
                _score(result, timeline, session, await service.consolidate(identity))
            seen.add(identity)
        await service.drain()
        ended = True
    except ConnectionLost:
        # The store is gone: each forget would wait out its 10 s before failing.
        if seen:
            logger.warning(
                "coda-memory: the replay lost its store; what it wrote of %d identities "
                "stays there",
                len(seen),
            )
        seen.clear()
        raise
    finally:
        try:
            await _erase(service, sorted(seen), ended)
        finally:
            await service.close()
    return result


async def _erase(service: MemoryService, identities: Sequence[str], ended: bool) -> None:
    """Forget what the replay wrote of ``identities`` (the store held none of them before
    it). A replay that failed or was cancelled half-way erases what it can, keeping its
    own error: what it left would make the next replay on the store refuse it as
    holding memory; the first forget that fails (the store gone) ends the attempt."""
    for identity in identities:
        try:
            await service.forget(identity)
        except Exception as exc:
            if ended:  # (the replay's own error is this one)
                raise
            logger.warning(
                "coda-memory: the failed replay could not erase what it wrote (%s)",
                short_error(exc, (identity,)),
            )
            return


class StoreNotScratch(ValueError):
    """The replay's store already holds memory of an identity the replay would write."""


async def _check_scratch(service: MemoryService, identities: Sequence[str]) -> None:
    """Raise :class:`StoreNotScratch` unless no identity of ``identities`` has facts,
    observations waiting or history in ``service``'s store: the replay would mix its
    writes with that memory, and then erase it."""
    held = 0
    for identity in identities:
        facts, waiting = await service.store.peek(identity)
        if facts or waiting or await service.history(identity):
            held += 1
    if held:
        raise StoreNotScratch(
            f"the replay's store already holds memory of {held} of the {len(identities)} "
            "identities it replays (is it the live database?): give it an empty schema, "
            "database or prefix, since the replay writes there and erases what it wrote"
        )


class _Popularity:
    """Subjects by how many sessions of any identity used them so far (exact top ``TOP``;
    counts only grow, so a subject enters the top only when its own count does)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.top: list[str] = []

    def _key(self, subject: str) -> tuple[int, str]:
        return (-self.counts[subject], subject)

    def add(self, subject: str) -> None:
        self.counts[subject] = self.counts.get(subject, 0) + 1
        if subject not in self.top:
            if len(self.top) >= TOP and self._key(subject) >= self._key(self.top[-1]):
                return
            self.top.append(subject)
        self.top.sort(key=self._key)
        del self.top[TOP:]


def replay_baselines(timeline: Timeline) -> list[ReplayResult]:
    """The methods without decay, on the same sessions: global popularity so far (no
    memory), the identity's subjects by most recent use, and by all-time use count."""
    popularity = ReplayResult("no memory (global popularity)")
    recency = ReplayResult("recency only")
    frequency = ReplayResult("all-time frequency")
    global_counts = _Popularity()
    last_used: dict[str, dict[str, tuple[datetime, int]]] = {}
    counted: set[tuple[int, str]] = set()  # (session, subject): a session counts once
    for _, session, event in timeline.in_time_order():
        identity = session.identity
        if event is not None:  # what a session used, as it happens (see in_time_order)
            subject = fact_subject(event)
            if subject is None:
                continue
            first = (id(session), subject) not in counted
            if first:
                counted.add((id(session), subject))
                global_counts.add(subject)
            # Its last use is this one (events come in time order; the session's start
            # ranked a subject used late in a session as if used when it began).
            used_by = last_used.setdefault(identity, {})
            count = used_by.get(subject, (event.time, 0))[1]
            used_by[subject] = (event.time, count + first)
            continue
        history = last_used.get(identity)
        if identity in timeline.scored and history is not None:
            held_out = timeline.held_out(session)
            used = session.subjects
            popularity.period(held_out).ranking.add(global_counts.top, used)
            known = history
            # Ties by subject, as memory ranks its facts (coda_memory.core.rank).
            by_recency = heapq.nsmallest(TOP, known, key=lambda s: (-known[s][0].timestamp(), s))
            by_count = heapq.nsmallest(TOP, known, key=lambda s: (-known[s][1], s))
            for result, ranked in ((recency, by_recency), (frequency, by_count)):
                scores = result.period(held_out)
                scores.ranking.add(ranked, used)
                scores.facts_total += len(history)
        last_used.setdefault(identity, {})
    return [popularity, recency, frequency]
