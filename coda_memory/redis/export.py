"""Reading one identity out of the Redis layout whole, for a copy into another store.

One MULTI/EXEC reads every key of the identity at once, so an append or a consolidation
cannot land between the reads. Each observation is classed as the Redis store itself
would: pending when it is in the pending set, or when no checkpoint covers it (the
original server's new ones); consumed otherwise. A pending observation that the sorted
set no longer holds (pruned, or the key expired) is pending still, as the store reads
it. Records that do not parse, or hold a value of the wrong type or range, are reported
by key, with the reason, and left out; so is a fact whose ease factor no decay strategy
of the library would have given it (:func:`~coda_memory.core.decay.ease_bounds`). A
checkpoint that does not parse leaves the identity out whole (:class:`BadRecord`):
without it, nothing tells the consumed observations from the new ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime

from redis.exceptions import ResponseError

from coda_memory.core.decay import ease_bounds
from coda_memory.core.model import Fact, FactEvent, Observation, is_identifier
from coda_memory.redis.codec import (
    SUBJECT_RULE,
    BadRecord,
    checked_event_from_value,
    checkpoint_ms,
    fact_from_json,
    from_ms,
    observation_from_json,
    one_per_subject,
)
from coda_memory.redis.store import RedisStore


@dataclass(slots=True)
class ExportedIdentity:
    """One identity's records in the Redis layout, parsed."""

    identity_id: str
    consumed: list[Observation] = field(default_factory=list)
    pending: list[Observation] = field(default_factory=list)
    facts: list[Fact] = field(default_factory=list)
    events: list[FactEvent] = field(default_factory=list)
    checkpoint_at: datetime | None = None
    #: (key, reason) for each record left out.
    bad: list[tuple[str, str]] = field(default_factory=list)
    #: Where each observation was read from (by its id), to name one left out later.
    labels: dict[int, str] = field(default_factory=dict)


def _field_label(key: str, name: bytes) -> str:
    """A field of a hash, by its name when it is an identifier (what the layout's ids and
    subjects are made of), else by its size: a corrupt record may hold anything, personal
    data or a megabyte of it."""
    text = name.decode(errors="replace")
    shown = repr(text) if is_identifier(text) else f"of {len(name):,} bytes"
    return f"{key} field {shown}"


def _member_label(key: str, member: bytes, index: int) -> str:
    """A member of a sorted set: by its observation id when it holds a usable one, else
    by its place (``ZRANGE key index index`` finds it) and size."""
    try:
        value = json.loads(member)
    except ValueError:
        value = None
    if isinstance(value, dict):
        # (The original server's ids are strings, coda-memory's whole numbers.)
        found = value.get("id")
        if isinstance(found, int) and not isinstance(found, bool):
            return f"{key} id {found}"
        if is_identifier(found):
            return f"{key} id {found!r}"
    return f"{key} member #{index} ({len(member):,} bytes)"


async def export_identity(store: RedisStore, identity_id: str) -> ExportedIdentity:
    """Everything the Redis layout holds for ``identity_id``, read atomically."""
    k = store.keys
    obs_key, facts_key = k.of("obs", identity_id), k.of("facts", identity_id)
    history_key, sessions_key = k.of("history", identity_id), k.of("sessions", identity_id)
    async with store.client.pipeline(transaction=True) as pipe:
        pipe.hget(k.checkpoint, identity_id)
        pipe.zrange(obs_key, 0, -1, withscores=True)
        pipe.zrange(k.of("pending", identity_id), 0, -1)
        pipe.hgetall(facts_key)
        pipe.lrange(history_key, 0, -1)
        pipe.hvals(sessions_key)
        try:
            checkpoint, members, pending, facts, history, sessions = await pipe.execute()
        except ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                # A refusal of the server's (NOPERM: an ACL user without MULTI, EXEC or
                # a read command) is no fault of the identity's keys: the run stops on
                # it, named, rather than leave out every identity as "of the wrong type".
                raise
            raise BadRecord(f"a key of the wrong type ({exc})") from exc
    out = ExportedIdentity(identity_id)
    limit: float | None = None
    if checkpoint is not None:
        try:
            limit = checkpoint_ms(checkpoint)
        except BadRecord as exc:
            # Without it, nothing tells the consumed observations from the new ones: all
            # would count again.
            raise BadRecord(
                f"{k.checkpoint} field {identity_id!r} is not epoch ms ({exc}): which"
                " observations were consumed is not known"
            ) from None
        out.checkpoint_at = from_ms(limit, "checkpoint")
    in_pending = set(pending)
    # With the pending observations that the sorted set no longer holds (the original
    # server's prune, or the key's TTL, took them): the Redis store still consolidates
    # them. (Their score is the pending set's, which only says they are pending.)
    held = {member for member, _ in members}
    pending_key = k.of("pending", identity_id)
    lost = [
        (member, None, pending_key, index)
        for index, member in enumerate(pending)
        if member not in held
    ]
    for member, score, key, index in [
        *((m, s, obs_key, i) for i, (m, s) in enumerate(members)),
        *lost,
    ]:
        try:
            if score is not None and member not in in_pending:
                # Outside the range of dates (±inf, past year 9999): the store reads no
                # observation there (load.lua).
                from_ms(score, "its score")
            observation = observation_from_json(identity_id, member)
        except BadRecord as exc:
            out.bad.append((_member_label(key, member, index), str(exc)))
            continue
        out.labels[observation.id] = _member_label(key, member, index)
        if member in in_pending or limit is None or score is None or score > limit:
            out.pending.append(observation)
        else:
            out.consumed.append(observation)
    fields: dict[int, bytes] = {}  # each parsed fact's field (by the fact's id())
    parsed: list[tuple[Fact, bytes]] = []
    for name, raw in sorted(facts.items()):
        try:
            fact = fact_from_json(identity_id, raw)
        except BadRecord as exc:
            out.bad.append((_field_label(facts_key, name), str(exc)))
            continue
        fields[id(fact)] = name
        parsed.append((fact, raw))
    # Postgres holds one fact per subject: the one the Redis store itself reads. The rule
    # takes every fact that parses, as the store's does; the one it keeps is checked
    # after, and left out, named, when the import cannot use it.
    kept, left_out = one_per_subject(parsed)
    unusable: set[str] = set()
    for fact in kept:
        try:
            out.facts.append(_with_usable_ease(fact))
        except BadRecord as exc:
            out.bad.append((_field_label(facts_key, fields[id(fact)]), str(exc)))
            unusable.add(fact.subject)
    read = {fact.subject: fields[id(fact)] for fact in kept}
    for fact in left_out:
        kept_field = _field_label(facts_key, read[fact.subject]).removeprefix(f"{facts_key} ")
        copied = "is read instead, and left out" if fact.subject in unusable else "is copied"
        out.bad.append(
            (
                _field_label(facts_key, fields[id(fact)]),
                f"a second fact about its subject ({kept_field} {copied}: {SUBJECT_RULE})",
            )
        )
    out.events, bad_events = _events(identity_id, history, sessions)
    out.bad += [(history_key if i < len(history) else sessions_key, r) for i, r in bad_events]
    return out


def _with_usable_ease(fact: Fact) -> Fact:
    """``fact``, unless its ease is outside what the library's strategies make of its
    reinforcement count: an ease of 1e308 would never decay."""
    ease = fact.ease_factor
    if ease is not None:
        low, high = ease_bounds(fact.reinforcement_count)
        if not low <= ease <= high:
            raise BadRecord(f"easeFactor {ease!r} is outside {low:.10g}..{high:.10g}")
    return fact


def _identity_of(event: FactEvent) -> tuple[object, ...]:
    return (event.subject, event.session_id, event.kind, event.at, event.count_after)


def _events(
    identity_id: str, history: list[bytes], sessions: list[bytes]
) -> tuple[list[FactEvent], list[tuple[int, str]]]:
    """The history, then session records the capped history no longer holds."""
    events: list[FactEvent] = []
    bad: list[tuple[int, str]] = []
    for index, raw in enumerate(history):
        try:
            events.append(checked_event_from_value(identity_id, json.loads(raw)))
        except BadRecord as exc:
            bad.append((index, f"fact event: {exc}"))
        except ValueError as exc:  # not JSON
            bad.append((index, f"fact event: {type(exc).__name__}"))
    seen = {_identity_of(e) for e in events}
    extra: list[FactEvent] = []
    for index, raw in enumerate(sessions, start=len(history)):
        try:
            values = json.loads(raw)
            if not isinstance(values, list):
                raise BadRecord("not a JSON array")
            recorded = [checked_event_from_value(identity_id, v) for v in values]
        except BadRecord as exc:
            bad.append((index, f"session record: {exc}"))
            continue
        except ValueError as exc:  # not JSON
            bad.append((index, f"session record: {type(exc).__name__}"))
            continue
        for event in recorded:
            if (
                event.subject,
                event.session_id,
                event.kind,
                event.at,
                event.count_after,
            ) not in seen:
                extra.append(event)
    extra.sort(key=lambda e: e.at)
    return extra + events, bad
