"""Consolidation as a pure function: (stored facts, new observations, now) -> plan.

The rules, which fix the original design's flaws:

* Each observation maps to one fact key (category, subject). Observations of one
  session reinforce a fact at most once, even when they arrive over several runs;
  observations without a session id form one session per run.
* Sessions are applied in time order. A session's reinforcement time is the latest
  ``created_at`` among its observations for that fact, never earlier than the fact's
  ``last_reinforced_at`` and never later than the run's ``now`` (a future-dated
  observation reinforces at ``now``, so no date can carry a fact forward). When a later
  observation of the session that last reinforced a fact arrives in a later run, that
  reinforcement is redone at the later time from the state the fact had before it (an
  ``extended`` event), so how often consolidation runs never changes the result.
* Stored confidence is the value at the last reinforcement; decay is computed from there
  and never written back, so there is no compounding.
* A fact already expired at a session's reinforcement time starts again at 0.5 with
  count 1. A fact expired at ``now`` is deleted and never returned. An observation dated
  from before a deleted fact expired (it arrived late, after a consolidation deleted the
  fact) resumes the fact's last life, read back from its history (``ended``), as the
  stored fact would have been reinforced had no consolidation deleted it.

Grouping a run's observations per session and fact (and ``fact_key``) lives in
:mod:`.sessions`; this module folds the groups into facts and events.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from coda_memory.core.decay import (
    DecayStrategy,
    Reinforcing,
    days_after,
    initial_ease,
    reinforcing,
)
from coda_memory.core.model import (
    Fact,
    FactEvent,
    FactEventKind,
    Observation,
    as_utc,
    fact_id,
    gc_paused,
    replaced,
    trusted,
    trusted_from,
    with_confidence,
)
from coda_memory.core.rank import score_key
from coda_memory.core.sessions import FactKey as FactKey
from coda_memory.core.sessions import (
    SessionGroup,
    grouping_by_session,
    prior_tool_counts,
    subjects_reached,
)
from coda_memory.core.sessions import fact_key as fact_key
from coda_memory.core.turns import SLICE, Steps, emptying, finished

NEW_FACT_CONFIDENCE = 0.5
DEFAULT_RETENTION = timedelta(days=7)
REINFORCING = frozenset({FactEventKind.CREATED, FactEventKind.REINFORCED, FactEventKind.EXTENDED})


@dataclass(frozen=True, slots=True)
class ConsolidationInput:
    """Everything consolidation reads for one identity, under its lock."""

    #: Observations not yet consolidated, in any order. The list is the caller's: the
    #: service empties it once the consolidation is committed (see
    #: :func:`~coda_memory.core.turns.released`), so a store gives one nothing else holds.
    observations: list[Observation]
    #: The identity's stored facts (stored form: confidence at its anchor).
    facts: list[Fact]
    #: Reinforcing events (created/reinforced/extended) of the sessions in ``observations``,
    #: from earlier runs: they stop a session from reinforcing a fact twice.
    session_events: list[FactEvent]
    #: For the subjects of :func:`lives_asked`: when a subject's latest event is an
    #: expiry (a consolidation deleted its fact), that expiry and the reinforcing event
    #: before it, in any order (see :func:`ended_lives`); nothing for the others.
    ended: list[FactEvent] = field(default_factory=list)
    #: True when ``facts`` were built for this consolidation and nothing else holds them
    #: (the Postgres unit's): the plan then turns the facts it leaves unchanged into
    #: their views in place, a copy fewer per fact. Never for facts a store keeps.
    facts_owned: bool = False


@dataclass(frozen=True, slots=True)
class ConsolidationPlan:
    """What one consolidation decided; a store applies it in one transaction."""

    identity_id: str
    now: datetime
    #: Facts to insert or overwrite, in stored form.
    upserts: list[Fact]
    #: Subjects of stored facts to delete (expired, or evicted by the cap).
    deletes: list[str]
    #: History entries to append, in order. A store copies what it keeps of them: the
    #: service empties the list once the consolidation is committed.
    events: list[FactEvent]
    #: Observations older than this are pruned.
    prune_before: datetime
    #: The identity's active facts after the plan, as views at ``now``.
    active: list[Fact]
    #: How many new observations this plan consumed.
    consumed: int
    #: Subjects dropped by the ``max_facts`` cap (deleted when stored).
    evicted: list[str] = field(default_factory=list)

    @property
    def writes_anything(self) -> bool:
        return bool(self.upserts or self.deletes or self.events or self.consumed)


@dataclass(slots=True)
class _Run:
    """Working state of one consolidation run."""

    identity_id: str
    now: datetime
    decay: DecayStrategy
    current: dict[str, Fact]
    events: list[FactEvent] = field(default_factory=list)
    #: The latest reinforcing event per (subject, session id), from earlier runs and this one.
    reinforced_by: dict[tuple[str, str], FactEvent] = field(default_factory=dict)
    #: The last life of a deleted fact, by subject: its last reinforcing event and its
    #: expiry (``ConsolidationInput.ended``).
    ended: dict[str, tuple[FactEvent, FactEvent]] = field(default_factory=dict)
    #: ``decay``'s reinforcement from a known confidence (see :func:`reinforcing`).
    reinforce_with: Reinforcing = field(init=False)

    def __post_init__(self) -> None:
        self.reinforce_with = reinforcing(self.decay)

    # Facts and events below are built without validation (``trusted``): every value is
    # a stored or validated one, or computed here (``now`` is made UTC by the plan).

    def fresh(self, group: SessionGroup, at: datetime) -> Fact:
        return trusted(
            Fact,
            id=fact_id(group.key.subject),
            identity_id=self.identity_id,
            category=group.key.category,
            subject=group.key.subject,
            content=group.content,
            confidence=NEW_FACT_CONFIDENCE,
            reinforcement_count=1,
            last_reinforced_at=at,
            created_at=at,
            updated_at=self.now,
            ease_factor=initial_ease(self.decay),
            confidence_at=at,
        )

    def expired_at(self, fact: Fact, until: datetime) -> datetime:
        """When the fact's confidence crossed the expiry threshold (at most ``until``).

        A strategy may say so itself with ``expires_at(fact)`` (PowerLawDecay does);
        otherwise the curve is taken as exponential between the anchor and one day later.
        """
        exact = getattr(self.decay, "expires_at", None)
        if exact is not None:
            when: datetime = exact(fact)
            return min(until, when)
        probe_days = 1.0
        probe = replaced(fact, confidence_at=fact.anchor)
        one_day = self.decay.decayed(probe, days_after(fact.anchor, probe_days))
        threshold = self.decay.expiry_threshold
        if not 0.0 < one_day < fact.confidence or threshold <= 0.0:
            return until
        days = math.log(threshold / fact.confidence) / math.log(one_day / fact.confidence)
        return min(until, days_after(fact.anchor, max(0.0, days)))

    def resumed(self, group: SessionGroup) -> Fact | None:
        """The fact as its last life left it, when a consolidation deleted it on its
        expiry after ``group``'s time (None otherwise): rebuilt from its last reinforcing
        event (``created_at``, which the event does not hold, is that event's time)."""
        ended = self.ended.pop(group.key.subject, None)
        if ended is None or group.at is None:
            return None
        reinforced, expiry = ended
        if group.at >= expiry.at or reinforced.confidence_after is None:
            return None
        return replaced(
            self.fresh(group, reinforced.at),
            confidence=reinforced.confidence_after,
            reinforcement_count=reinforced.count_after or 1,
            ease_factor=reinforced.ease_after,
        )

    def expire(self, fact: Fact, at: datetime) -> None:
        before: float | None = self.decay.decayed(fact, at)
        if before is not None and not math.isfinite(before):
            # (A host's decay that gives NaN expires the fact: its history holds no
            # confidence then, as JSON, which two stores write it as, has no NaN.)
            before = None
        self.events.append(
            trusted(
                FactEvent,
                identity_id=self.identity_id,
                subject=fact.subject,
                category=fact.category,
                kind=FactEventKind.EXPIRED,
                session_id=None,
                at=self.expired_at(fact, at),
                confidence_before=before,
                confidence_after=None,
                count_before=fact.reinforcement_count,
                count_after=None,
                ease_before=fact.ease_factor,
                ease_after=None,
                quality=None,
                hits=0,
                trials=0,
            )
        )

    def reinforce(
        self,
        before: Fact | None,
        group: SessionGroup,
        at: datetime,
        kind: FactEventKind,
        hits: int,
        trials: int,
        decayed: float | None = None,
    ) -> None:
        """Reinforce ``before`` (or create the fact) at ``at`` and record the event.
        ``decayed``: ``before``'s confidence at ``at``, when the caller has it already."""
        quality = hits / trials if trials else 1.0
        threshold = self.decay.expiry_threshold
        confidence_before = decayed
        if confidence_before is None and before is not None:
            confidence_before = self.decay.decayed(before, at)
        if before is None or confidence_before is None or confidence_before < threshold:
            after = self.fresh(group, at)
            if kind is FactEventKind.REINFORCED:
                kind = FactEventKind.CREATED
        else:
            after = self.reinforce_with(
                before,
                confidence_before,
                quality,
                at,
                {"content": group.content, "updated_at": self.now, "confidence_at": at},
            )
        event = trusted_from(
            FactEvent,
            {
                "identity_id": self.identity_id,
                "subject": group.key.subject,
                "category": group.key.category,
                "kind": kind,
                "session_id": group.session_id,
                "at": at,
                "confidence_before": confidence_before,
                "confidence_after": after.confidence,
                "count_before": None if before is None else before.reinforcement_count,
                "count_after": after.reinforcement_count,
                "ease_before": None if before is None else before.ease_factor,
                "ease_after": after.ease_factor,
                "quality": quality,
                "hits": hits,
                "trials": trials,
            },
        )
        self.events.append(event)
        self.current[group.key.subject] = after
        if group.session_id is not None:
            self.reinforced_by[(group.key.subject, group.session_id)] = event

    def fold_group(self, group: SessionGroup) -> bool:
        """Apply one session's observations for one fact; True when the fact changed."""
        subject = group.key.subject
        current = self.current.get(subject)
        session = group.session_id
        prior = None if session is None else self.reinforced_by.get((subject, session))
        if prior is None:
            if group.at is None:
                return False  # nothing of this session reinforced the fact before
            # A fact deleted since, which was alive at the group's time (it arrived late):
            # its last life resumes, as the stored fact would have been reinforced.
            resumed = current is None and (current := self.resumed(group)) is not None
            at = group.at if current is None else max(group.at, current.last_reinforced_at)
            at = min(at, self.now)  # a future date must not carry a fact forward
            if current is not None and group.at < current.last_reinforced_at:
                group.content = current.content  # (a late name is older than the one shown)
            decayed = None  # (the fact's confidence at ``at``, which reinforce needs too)
            if current is not None:
                decayed = self.decay.decayed(current, at)
                if decayed < self.decay.expiry_threshold:
                    if not resumed:  # (a resumed life's expiry is recorded already)
                        self.expire(current, at)
                    current = decayed = None
            self.reinforce(
                current, group, at, FactEventKind.REINFORCED, group.hits, group.trials, decayed
            )
            return True
        # The session already reinforced this fact in an earlier run. Only the fact's
        # latest reinforcement can be redone: at a later time, or with a new quality.
        is_latest = (
            current is not None
            and current.last_reinforced_at == prior.at
            and current.reinforcement_count == prior.count_after
        )
        at = min(prior.at if group.at is None else max(group.at, prior.at), self.now)
        unchanged = at == prior.at and (group.hits, group.trials) == (prior.hits, prior.trials)
        if current is None:
            # Deleted since (expired, or evicted by the cap): the session's reinforcement
            # is redone on the fact as it was before it, rebuilt from the event, as below
            # for a fact that no consolidation deleted in between, so that how often
            # consolidation runs never changes the result (only ``created_at``, which the
            # event does not hold, is the reinforcement's time). It starts anew at 0.5
            # when the session created it, or when that state had expired by then too.
            # So it is when only the session's quality changed (a later call of the
            # tool, which observed its other fact): a run that saw every call at once
            # reinforced with that quality.
            if unchanged:
                return False
            before = _state_before(prior, self.fresh(group, prior.at))
            kind = FactEventKind.REINFORCED if before is None else FactEventKind.EXTENDED
            self.reinforce(before, group, at, kind, group.hits, group.trials)
            return True
        if not is_latest or unchanged:
            return False
        if group.at is None or group.at < current.last_reinforced_at:
            group.content = current.content
        before = _state_before(prior, current)
        self.reinforce(before, group, at, FactEventKind.EXTENDED, group.hits, group.trials)
        return True


def lives_asked(
    observations: Iterable[Observation], stored: Iterable[Fact], before: datetime | None
) -> set[str]:
    """The subjects whose last life a store reads for ``ConsolidationInput.ended``: those
    that observations dated before ``before`` reach (the instant of the identity's last
    consolidation, after which no fact was deleted; None: never consolidated, none was)
    and no ``stored`` fact holds. Most runs have no such observation, and read nothing."""
    if before is None:
        return set()
    late = [o for o in observations if o.created_at < before]
    if not late:
        return set()
    return subjects_reached(late) - {fact.subject for fact in stored}


def ended_lives(events: Iterable[FactEvent], subjects: Collection[str]) -> list[FactEvent]:
    """``ConsolidationInput.ended`` from an identity's history (``events``, in the order
    written): for each of ``subjects`` whose latest event is an expiry, that expiry and
    the reinforcing event before it."""
    wanted = set(subjects)
    last: dict[str, FactEvent] = {}
    reinforcing: dict[str, FactEvent] = {}
    for event in events:
        if event.subject not in wanted:
            continue
        if event.kind in REINFORCING:
            reinforcing[event.subject] = event
        last[event.subject] = event
    return [
        event
        for subject, expiry in last.items()
        if expiry.kind is FactEventKind.EXPIRED and subject in reinforcing
        for event in (reinforcing[subject], expiry)
    ]


def _state_before(event: FactEvent, current: Fact) -> Fact | None:
    """The fact as it was just before ``event``'s reinforcement (None: it did not exist)."""
    if event.confidence_before is None or event.count_before is None:
        return None
    return replaced(
        current,
        confidence=event.confidence_before,
        confidence_at=event.at,
        last_reinforced_at=event.at,
        reinforcement_count=event.count_before,
        ease_factor=event.ease_before,
    )


def active_views(
    facts: Iterable[Fact],
    decay: DecayStrategy,
    now: datetime,
    max_facts: int | None = None,
    *,
    owned: bool = False,
) -> list[Fact]:
    """Views at ``now`` of the facts that have not expired, sorted by subject; with
    ``max_facts``, of the best ranked that many only. ``owned``: nothing else holds the
    facts, which become their views in place (a copy fewer per fact)."""
    return finished(viewing(facts, decay, now, max_facts, owned=owned))


def viewing(
    facts: Iterable[Fact],
    decay: DecayStrategy,
    now: datetime,
    max_facts: int | None = None,
    *,
    owned: bool = False,
) -> Steps[list[Fact]]:
    """:func:`active_views` as steps (see :mod:`~coda_memory.core.turns`): it yields after
    every :data:`~coda_memory.core.turns.SLICE` facts it decays."""
    threshold = decay.expiry_threshold
    alive: list[tuple[Fact, float]] = []
    for done, fact in enumerate(facts, 1):
        if done % SLICE == 0:
            yield
        # Decay once per fact, and build a view only for a fact that is returned.
        confidence = decay.decayed(fact, now)
        if confidence >= threshold:
            alive.append((fact, confidence))
    kept, _ = _best(alive, max_facts)
    return (yield from _views(kept, now, in_place=owned))


def _best(
    alive: list[tuple[Fact, float]], max_facts: int | None
) -> tuple[list[tuple[Fact, float]], list[tuple[Fact, float]]]:
    """Facts with their confidence: the ``max_facts`` best ranked (all when None) and the
    others, each in the order of ``alive``. No view is built, so a cap costs nothing for
    the facts it drops; and the best are selected, not all sorted (a cap that applies
    keeps hundreds of tens of thousands)."""
    if max_facts is None or len(alive) <= max_facts:
        return alive, []
    best = {id(pair) for pair in heapq.nsmallest(max_facts, alive, key=_pair_rank)}
    kept: list[tuple[Fact, float]] = []
    dropped: list[tuple[Fact, float]] = []
    for pair in alive:
        (kept if id(pair) in best else dropped).append(pair)
    return kept, dropped


def _pair_rank(pair: tuple[Fact, float]) -> tuple[float, str]:
    return score_key(pair[1], pair[0])


def _views(
    alive: list[tuple[Fact, float]],
    now: datetime,
    owned: dict[str, Fact] | None = None,
    *,
    by_subject: bool = False,
    in_place: bool = False,
) -> Steps[list[Fact]]:
    """Views of ``alive`` at ``now``, sorted by subject (``by_subject``: ``alive`` already
    is), as steps of :data:`~coda_memory.core.turns.SLICE` facts. The facts of ``owned``
    (by subject; nothing else may hold them), or all of them when ``in_place``, become
    their views in place."""
    views: list[Fact] = []
    for start in range(0, len(alive), SLICE):
        if start:
            yield
        _view_slice(alive[start : start + SLICE], now, owned, in_place, views)
    if not by_subject:
        views.sort(key=_subject)
    return views


def _view_slice(
    alive: list[tuple[Fact, float]],
    now: datetime,
    owned: dict[str, Fact] | None,
    in_place: bool,
    views: list[Fact],
) -> None:
    """:func:`_views` of one slice, appended to ``views``."""
    with gc_paused():
        for fact, confidence in alive:
            if in_place or (owned is not None and owned.get(fact.subject) is fact):
                values = fact.__dict__
                values["confidence"] = confidence
                values["confidence_at"] = now
                views.append(fact)
            else:
                views.append(with_confidence(fact, confidence, now))


def _subject(fact: Fact) -> str:
    return fact.subject


def plan_consolidation(
    identity_id: str,
    batch: ConsolidationInput,
    now: datetime,
    decay: DecayStrategy,
    retention: timedelta = DEFAULT_RETENTION,
    max_facts: int | None = None,
) -> ConsolidationPlan:
    """Decide what consolidating ``batch`` at ``now`` changes. Pure: no I/O.

    With ``max_facts``, at most that many facts stay active: the best ranked by
    :func:`~coda_memory.core.rank.rank_key`; the others are deleted and listed in ``evicted``."""
    return finished(planning(identity_id, batch, now, decay, retention, max_facts))


def planning(
    identity_id: str,
    batch: ConsolidationInput,
    now: datetime,
    decay: DecayStrategy,
    retention: timedelta = DEFAULT_RETENTION,
    max_facts: int | None = None,
) -> Steps[ConsolidationPlan]:
    """:func:`plan_consolidation` as steps (see :mod:`~coda_memory.core.turns`), so that a
    service can give the event loop turns in between. It yields after every half
    :data:`~coda_memory.core.turns.SLICE` of the observations it groups by session and
    once the groups are made (:func:`~coda_memory.core.sessions.grouping_by_session`),
    after every quarter SLICE of the groups it folds, after folding them all, after
    every SLICE facts it decays, and after every SLICE session groups it frees."""
    now = as_utc(now)  # the facts and events below take it unvalidated
    stored = {f.subject: f for f in batch.facts}
    run = _Run(identity_id, now, decay, dict(stored))
    for event in batch.session_events:
        if event.kind in REINFORCING and event.session_id is not None:
            run.reinforced_by[(event.subject, event.session_id)] = event
    lives: dict[str, dict[bool, FactEvent]] = {}
    for event in batch.ended:
        lives.setdefault(event.subject, {})[event.kind is FactEventKind.EXPIRED] = event
    for subject, life in lives.items():
        if True in life and False in life and subject not in stored:
            run.ended[subject] = (life[False], life[True])

    changed: set[str] = set()
    tool_counts = prior_tool_counts(run.reinforced_by.values())
    # A backlog of hundreds of observations (the sessions a held table kept waiting) is
    # grouped and folded in steps of at most about half a millisecond: an observation is
    # keyed in 2 to 7 us, a group folded in 4 to 14 us (2-core machines, quiet to busy;
    # the 4 us since a reinforcement decays and copies its fact once).
    grouped = yield from grouping_by_session(
        batch.observations, tool_counts, step=max(1, SLICE // 2)
    )
    by_subject = sorted(grouped.items())
    fold_step = max(1, SLICE // 4)
    folded = 0
    for subject, groups in by_subject:
        for group in groups:
            if run.fold_group(group):
                changed.add(subject)
            folded += 1
            if folded % fold_step == 0:
                yield

    yield
    deletes: list[str] = []
    alive: list[tuple[Fact, float]] = []
    threshold = decay.expiry_threshold
    for done, subject in enumerate(sorted(run.current), 1):
        if done % SLICE == 0:
            yield
        fact = run.current[subject]
        confidence = decay.decayed(fact, now)
        if not confidence >= threshold:  # (a NaN expires it too, as reads leave it out)
            run.expire(fact, now)
            if subject in stored:
                deletes.append(subject)
            continue
        alive.append((fact, confidence))
    # The cap: the best ranked facts stay, the others are deleted (no history event: they
    # did not expire, and a new observation starts them again like an expired fact).
    kept_pairs, dropped = _best(alive, max_facts)
    # Stored facts the run did not change, when nothing but this plan holds them.
    owned = stored if batch.facts_owned else None
    # Both in subject order, as taken above.
    active = yield from _views(kept_pairs, now, owned, by_subject=True)
    evicted_subjects = [fact.subject for fact, _ in dropped]
    deletes.extend(s for s in evicted_subjects if s in stored)
    deletes.sort()
    kept = {f.subject for f in active}
    upserts = [run.current[subject] for subject in sorted(changed) if subject in kept]
    # The session groups and the run's table of them, freed in steps (a backlog of
    # 100,000 observations makes about as many of each).
    yield from emptying([*(groups for _, groups in by_subject), run.reinforced_by], SLICE)
    return ConsolidationPlan(
        identity_id=identity_id,
        now=now,
        upserts=upserts,
        deletes=deletes,
        events=run.events,
        prune_before=now - retention,
        active=active,
        consumed=len(batch.observations),
        evicted=evicted_subjects,
    )
