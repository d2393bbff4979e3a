"""The consolidation unit of work on Redis.

The store hands a unit the identity's lock (a token in ``lock:{identityId}``). ``load``
reads everything with one script (``load.lua``): in one atomic read when the backlog fits
in a page (:data:`LOAD_PAGE`), else its first page and then the next ones, each a reply
of its own; ``write`` keeps the plan, and ``commit`` writes it
in one atomic script that first checks the lock is still this run's: facts, deletes,
history, the sessions' reinforcement records, the consumed pending observations, the
checkpoint, the counters and retention all change together, or not at all.

What is new
-----------
An observation coda-memory appends is, in one atomic step, numbered from the identity's
ingest sequence and added both to the seed's sorted set and to the pending set. ``load``
takes the pending set as it is at its first read (the members scored up to its highest
number, read in pages), and ``commit`` removes exactly those members: an append that
lands in between, numbered after them, is neither read nor removed, so the next run
consumes it, whatever its ``createdAt``. No timestamp decides what is new.

The original server never wrote a pending set; its observations count as new when scored
after the checkpoint, as it did itself. Every run moves the checkpoint to at least the
latest ``createdAt`` it consumed, so an observation coda-memory consumed is never scored
after the checkpoint and is never taken for one of the original server's; one still
pending is recognised by being in the pending set. Runs of one identity are serialised
by the lock, and a run that lost its lock (it expired) cannot commit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from coda_memory.core.caps import LogThrottle
from coda_memory.core.consolidation import (
    REINFORCING,
    ConsolidationInput,
    ConsolidationPlan,
    ended_lives,
    lives_asked,
)
from coda_memory.core.logs import identity_label, without_identities
from coda_memory.core.model import Fact, FactEvent, Observation, fact_id
from coda_memory.core.turns import mapped
from coda_memory.ports import check_plan_identity
from coda_memory.redis.codec import (
    SUBJECT_RULE,
    BadRecord,
    checked_event_from_value,
    dumps,
    event_value,
    fact_from_json,
    fact_json,
    from_ms,
    observation_from_json,
    one_per_subject,
    to_ms,
)
from coda_memory.redis.keys import Keys

_log = LogThrottle(logging.getLogger("coda_memory"))

Script = Callable[..., Awaitable[Any]]

#: The most members of the pending set, or of the observations scored after the
#: checkpoint, that one reply of the consolidation's read carries (``load.lua``): a
#: backlog of hundreds of thousands read in one reply outlived redis-py's socket timeout
#: (5 s) at every attempt, and the identity was never consolidated. A page of 10,000
#: observations is about 3 MB.
LOAD_PAGE = 10_000
#: The bytes of observations past which a page ends (with the one that reaches it): a
#: record may hold up to 2,000 characters of content and 16 KiB of metadata, and 10,000
#: of those made a reply of hundreds of megabytes.
LOAD_PAGE_BYTES = 4 * 1024 * 1024
#: The upper bound of an observation's score, as ZRANGEBYSCORE takes it: year 10000
#: (datetime's range ends before it).
_DATES_END = "(253402300800000"

#: The keys the commit script takes, in its order (``checkpoint``: the checkpoint map).
COMMIT_KEYS = (
    "lock",
    "facts",
    "history",
    "pending",
    "obs",
    "checkpoint",
    "state",
    "sessions",
    "session-times",
)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def parse_facts(
    identity_id: str, values: Sequence[bytes | str], on_bad: Callable[[str], None] | None = None
) -> list[Fact]:
    """The facts of a hash's values, one per subject; a bad one is skipped and reported
    to ``on_bad``, and so is a second one about a subject (see :func:`facts_of`)."""
    return facts_of(identity_id, values, on_bad)[0]


def facts_of(
    identity_id: str, values: Sequence[bytes | str], on_bad: Callable[[str], None] | None = None
) -> tuple[list[Fact], list[Fact]]:
    """The facts of a hash's values, one per subject by the rule every reader keeps
    (:func:`~coda_memory.redis.codec.one_per_subject`), and those the rule left out; a
    bad one is skipped, and each one skipped or left out is reported to ``on_bad``."""
    facts: list[tuple[Fact, bytes | str]] = []
    for raw in values:
        try:
            facts.append((fact_from_json(identity_id, raw), raw))
        except BadRecord as exc:
            if on_bad is not None:
                on_bad(str(exc))
    kept, left_out = one_per_subject(facts)
    if on_bad is not None:
        for _ in left_out:
            on_bad(f"a second fact about its subject: {SUBJECT_RULE}")
    return kept, left_out


def _session_events(identity_id: str, raw: str | bytes) -> dict[str, FactEvent]:
    """The latest event of each subject in a session's record (a JSON array of events),
    checked as a record anything may have written; :class:`BadRecord` when it is not
    one."""
    try:
        values = json.loads(raw)
    except ValueError as exc:  # not JSON (its message quotes no value)
        raise BadRecord(f"not JSON ({exc})") from None
    if not isinstance(values, list):
        raise BadRecord("not a JSON array")
    return {
        event.subject: event
        for event in (checked_event_from_value(identity_id, value) for value in values)
    }


class PendingMoved(RuntimeError):
    """The pending set held members numbered among those the run read that it did not
    read (something reset the identity's sequence): the commit wrote nothing, and is
    sent again with the members the run consumed."""


class RedisConsolidationUnit:
    """A unit of work over one identity that holds its lock; writes only on commit."""

    def __init__(
        self,
        *,
        keys: Keys,
        identity_id: str,
        token: str,
        load_script: Script,
        commit_script: Script,
        read_sessions: Callable[[list[str]], Awaitable[list[bytes | str | None]]],
        read_history: Callable[[], Awaitable[list[FactEvent]]],
        history_limit: int,
        session_horizon: timedelta,
    ) -> None:
        self.identity_id = identity_id
        self._keys = keys
        self._token = token
        self._load = load_script
        self._commit = commit_script
        self._read_sessions = read_sessions
        self._read_history = read_history
        self._history_limit = history_limit
        self._session_horizon = session_horizon
        self._loaded = False
        self._committed = False
        self._plan: ConsolidationPlan | None = None
        self._consumed_pending: list[bytes] = []
        self._highest: bytes | None = None
        self._checkpoint: float | None = None
        self._stored_ids: dict[str, str] = {}
        self._left_out_ids: list[str] = []
        self._sessions: dict[str, dict[str, FactEvent]] = {}

    def _bad(self, what: str) -> Callable[[str], None]:
        def report(reason: str) -> None:
            # The identity by its label, as in every log line (it may be personal data),
            # and one line a second at most for a run of bad records.
            identity = self.identity_id
            _log.warning(
                f"bad {what}",
                "coda-memory: skipped a bad %s of %s in Redis: %s",
                what,
                identity_label(identity),
                without_identities(reason, (identity,)),
            )

        return report

    async def load(self) -> ConsolidationInput:
        self._check_open()
        k, identity = self._keys, self.identity_id
        keys = [*k.read_keys(identity), k.of("state", identity)]
        (
            checkpoint,
            highest,
            after_min,
            first_pending,
            first_after,
            fact_values,
            consolidated,
        ) = await self._load(keys=keys, args=[identity, LOAD_PAGE, LOAD_PAGE_BYTES])
        read, _ = await self._pages(keys, ["pending", "-inf", highest], first_pending)
        pending = list(read)
        after, read_as_pending = await self._pages(
            keys, ["obs", after_min, _DATES_END], first_after, highest or ""
        )
        waiting = set(pending)
        # In slices with turns of the loop between them (mapped): after an outage thousands
        # wait, and parsing them in one go held the loop for tens of milliseconds.
        parsed = await mapped(pending, self._observation)
        later = await mapped([m for m in after if m not in waiting], self._observation)
        new = [o for o in (*parsed, *later) if o is not None]
        times = [float(to_ms(o.created_at)) for o in parsed if o is not None]
        times += [float(score) for score in after.values()]
        times += read_as_pending
        if checkpoint is not None:
            times.append(float(checkpoint))
        latest = max(times, default=None)
        facts, left_out = facts_of(identity, fact_values, self._bad("fact"))
        self._stored_ids = {f.subject: f.id for f in facts}
        # Erased by the commit: read again once the kept one is deleted, or decayed below
        # its stale confidence, it came back (never the kept one's field, should a
        # corrupt record carry its id).
        kept_ids = set(self._stored_ids.values())
        self._left_out_ids = sorted({f.id for f in left_out} - kept_ids)
        self._consumed_pending = list(pending)
        self._highest = highest
        self._checkpoint = latest
        sessions = sorted({o.session_id for o in new if o.session_id is not None})
        self._sessions = {}
        events: list[FactEvent] = []
        if sessions:
            for session, raw in zip(sessions, await self._read_sessions(sessions), strict=True):
                if raw is None:
                    continue
                try:
                    latest_by_subject = _session_events(identity, raw)
                except BadRecord as exc:
                    # Skipped as a bad fact or observation is: read as a session without
                    # earlier events (its own consolidation writes its record anew),
                    # rather than failing every consolidation of the identity for ever.
                    self._bad("session's events")(str(exc))
                    continue
                self._sessions[session] = latest_by_subject
                events.extend(latest_by_subject.values())
        # The last lives of deleted facts that late observations may resume (rarely any;
        # the history is capped, so a life it no longer holds starts anew).
        asked = lives_asked(new, facts, self._consolidated_at(consolidated))
        ended = ended_lives(await self._read_history(), asked) if asked else []
        self._loaded = True
        return ConsolidationInput(observations=new, facts=facts, session_events=events, ended=ended)

    async def _pages(
        self, keys: list[str], which: list[Any], first: list[Any], *pending: Any
    ) -> tuple[dict[bytes, bytes], list[float]]:
        """Every member (with its score) of the pages that ``load.lua`` reads after its
        ``first``, of ``which`` (``pending`` or ``obs``, and the range of scores), in
        order, each once (one whose place a removal by something else moved can be read
        twice); and the scores of the members that the pages of the observations left
        out as read among the pending ones (one of each page at most: the highest)."""
        read: dict[bytes, bytes] = {}
        as_pending: list[float] = []
        page = first
        while True:
            more, last, last_score, pending_max, *items = page
            for member, score in zip(items[0::2], items[1::2], strict=True):
                read.setdefault(member, score)
            if pending_max is not None:
                as_pending.append(float(pending_max))
            if not int(more) or which[2] is None or last is None:
                return read, as_pending
            page = await self._load(
                keys=keys,
                args=[
                    *(self.identity_id, LOAD_PAGE, LOAD_PAGE_BYTES),
                    *(*which, last, last_score, *pending),
                ],
            )

    def _observation(self, member: Any) -> Observation | None:
        """The observation of a stored record; None for one that does not parse (reported)."""
        try:
            return observation_from_json(self.identity_id, member)
        except BadRecord as exc:
            self._bad("observation")(str(exc))
            return None

    def _consolidated_at(self, raw: bytes | str | None) -> datetime | None:
        """When coda-memory last consolidated the identity (the state's
        ``consolidatedAt``); None when it never did, or when the value does not parse
        (reported: late observations then start deleted facts anew)."""
        if raw is None:
            return None
        try:
            return from_ms(float(raw), "consolidatedAt")
        except (ValueError, BadRecord) as exc:
            self._bad("state")(f"consolidatedAt is not epoch ms ({type(exc).__name__})")
            return None

    def _sessions_before(self, now: datetime) -> int | float:
        """Epoch ms before which a session's reinforcement record may go: ``now`` less
        ``session_horizon``, counted in milliseconds past the first date (a clock within
        the horizon of year 1, a test's, failed every consolidation)."""
        try:
            return to_ms(now - self._session_horizon)
        except OverflowError:
            return to_ms(now) - self._session_horizon / timedelta(milliseconds=1)

    async def write(self, plan: ConsolidationPlan) -> None:
        self._check_open()
        if not self._loaded:
            raise RuntimeError("write() needs load() first: the plan must come from this unit")
        check_plan_identity(plan, self.identity_id)
        self._plan = plan

    async def commit(self) -> None:
        self._check_open()
        plan = self._plan
        if plan is not None:
            k, identity = self._keys, self.identity_id
            keys = [
                k.checkpoint if kind == "checkpoint" else k.of(kind, identity)
                for kind in COMMIT_KEYS
            ]
            consumed = self._consumed_pending
            args: list[Any] = [self._token, identity, await self._payload(plan)]
            args += [self._highest or "", len(consumed)]
            try:
                # The consumed pending members by their numbers (see commit.lua): sent
                # whole, a backlog's made a request of hundreds of megabytes.
                await self._commit(keys=keys, args=args)
            except PendingMoved:
                await self._commit(keys=keys, args=[*args, *consumed])
        self._committed = True

    async def _payload(self, plan: ConsolidationPlan) -> str:
        """The commit script's document, made in slices with turns of the event loop
        between them (mapped: a backlog's plan has thousands of events)."""

        def upsert(fact: Fact) -> tuple[str, str]:
            stored_id = self._stored_ids.get(fact.subject, fact.id)
            return stored_id, fact_json(fact, stored_id)

        upserts = [part for pair in await mapped(plan.upserts, upsert) for part in pair]
        deletes = [self._stored_ids.get(s, fact_id(s)) for s in plan.deletes]
        upserted = set(upserts[0::2])
        deletes += [stored_id for stored_id in self._left_out_ids if stored_id not in upserted]
        touched: set[str] = set()
        for event in plan.events:
            if event.kind in REINFORCING and event.session_id is not None:
                self._sessions.setdefault(event.session_id, {})[event.subject] = event
                touched.add(event.session_id)

        def session_record(session: str) -> tuple[str, str, str]:
            """The session, its events' document and its latest event's time."""
            events = list(self._sessions[session].values())
            latest = _number_text(max(to_ms(e.at) for e in events))
            return session, dumps([event_value(e) for e in events]), latest

        records = await mapped(sorted(touched), session_record)
        sessions = [part for session, document, _ in records for part in (session, document)]
        session_times = [part for session, _, at in records for part in (at, session)]
        written = await mapped(plan.events, lambda event: dumps(event_value(event)))
        return dumps(
            {
                "upserts": upserts,
                "deletes": deletes,
                "events": written,
                "historyLimit": self._history_limit,
                "sessions": sessions,
                "sessionTimes": session_times,
                "sessionsBefore": _number_text(self._sessions_before(plan.now)),
                "sessionHorizon": self._session_horizon / timedelta(milliseconds=1),
                "checkpoint": None if self._checkpoint is None else _number_text(self._checkpoint),
                "pruneBefore": _number_text(to_ms(plan.prune_before)),
                "consumed": plan.consumed,
                "now": _number_text(to_ms(plan.now)),
            }
        )

    def _check_open(self) -> None:
        if self._committed:
            raise RuntimeError("this unit of work is committed; open a new one")


__all__ = ["COMMIT_KEYS", "PendingMoved", "RedisConsolidationUnit", "facts_of", "parse_facts"]
