"""Reading one identity out of the Redis layout, for a copy into another store.

Every key of the identity is read as it was at one instant, so that an append or a
consolidation cannot land between the reads, in pages (:data:`READ_PAGE` records,
:data:`READ_PAGE_BYTES`): an identity of hundreds of thousands of observations read in
one reply outlived redis-py's socket timeout (5 s) at every attempt. Its observations go
to a sink (:class:`PageSink`) a page at a time as they are read, and are not kept: an
import held them all, as lists, then as the copy's, 550 MiB for 300,000 of them. One
``MULTI``/``EXEC`` reads the checkpoint and the first page of each key; an identity that
holds more is read again under ``WATCH`` of its keys, page by page, each a reply of its
own (the pending set, facts, history and session records first, held: the facts' rule
and the events need all of them; then the observations, each page given to the sink),
and the checkpoint once more in a closing ``MULTI``/``EXEC``: when anything wrote one of
the keys (or the identity's checkpoint changed) meanwhile, ``EXEC`` runs nothing, the
sink is told that the pages it had are void (:meth:`PageSink.restart`), and the read
starts again, :data:`READ_ATTEMPTS` times at most. An identity written during each of
them (live traffic throughout a migration) is then read whole in one ``MULTI``/``EXEC``,
a reply per key, which no write can land in, on a connection that waits
:data:`WHOLE_READ_TIMEOUT` (300 s) for a reply: left for a later run instead, it was left
at every run while the traffic lasted. That read holds the identity's replies whole (the
sink still gets its observations a page at a time).
Each observation is classed as the Redis store itself
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

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, cast

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError, WatchError

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


#: The most records of one key that one reply of the read carries (members of a sorted
#: set, items of a list, fields of a hash as HSCAN counts them): an identity of hundreds
#: of thousands of observations read in one reply outlived redis-py's socket timeout
#: (5 s) at every attempt.
READ_PAGE = 10_000
#: The bytes of records a page aims at: each next page of a key holds as many records as
#: the previous one's size says fit (at most twice as many), and the first page of each
#: holds at most one per 4 KiB of it.
READ_PAGE_BYTES = 4 * 1024 * 1024
#: Seconds the whole read (:func:`_read_whole`) waits for a reply at least: its replies
#: hold every record of a key (one of 500,000 observations took 25 to 32 s), where a
#: page's come in well under a second, and the import waits less for those.
WHOLE_READ_TIMEOUT = 300.0
#: Paged reads of an identity that something wrote meanwhile, before it is read whole in
#: one ``MULTI``/``EXEC`` (see :func:`_read_whole`).
READ_ATTEMPTS = 5


def _first_page() -> int:
    return max(1, min(READ_PAGE, READ_PAGE_BYTES // 4096))


def _next_page(count: int, read: list[bytes]) -> int:
    """How many records the page after one of ``count`` that held ``read`` asks for."""
    size = sum(len(item) for item in read)
    fit = count * READ_PAGE_BYTES // size if size else READ_PAGE
    return max(1, min(READ_PAGE, 2 * count, fit))


@dataclass(slots=True)
class _Keys:
    """What one read took of an identity's keys (the observations of ``obs:`` aside,
    which go to the sink a page at a time)."""

    checkpoint: bytes | None
    pending: list[bytes]
    facts: dict[bytes, bytes]
    history: list[bytes]
    sessions: list[bytes]


class PageSink(Protocol):
    """Where an identity's observations go as they are read, a page at a time."""

    async def page(self, page: ObservationPage) -> None:
        """The next page of the read under way."""

    async def restart(self) -> None:
        """The pages of the read so far are void: the identity is read again."""


@dataclass(slots=True)
class ObservationPage:
    """One page of an identity's observations, parsed and classed."""

    consumed: list[Observation] = field(default_factory=list)
    pending: list[Observation] = field(default_factory=list)
    #: (key, reason) for each record of the page left out.
    bad: list[tuple[str, str]] = field(default_factory=list)
    #: Where each observation of the page was read from (by its id).
    labels: dict[int, str] = field(default_factory=dict)


class _Classer:
    """Classes an identity's observations as the Redis store does, a page at a time
    (see the module's docstring), and remembers the pending members it met in ``obs:``:
    the rest of the pending set are pending observations the sorted set no longer holds."""

    def __init__(self, store: RedisStore, identity_id: str, keys: _Keys) -> None:
        self.identity_id = identity_id
        self.obs_key = store.keys.of("obs", identity_id)
        self.pending_key = store.keys.of("pending", identity_id)
        self.limit = _limit(store, identity_id, keys.checkpoint)
        self.pending = keys.pending
        self.in_pending = set(keys.pending)
        self.met: set[bytes] = set()

    def page(self, members: list[tuple[bytes, float]], start: int) -> ObservationPage:
        """The page of ``members`` of ``obs:``, the first of them at rank ``start``."""
        out = ObservationPage()
        for index, (member, score) in enumerate(members, start=start):
            if member in self.in_pending:
                self.met.add(member)
            self._one(out, member, score, self.obs_key, index)
        return out

    def lost(self) -> Iterator[ObservationPage]:
        """The pending observations that ``obs:`` did not hold, in pages."""
        out = ObservationPage()
        for index, member in enumerate(self.pending):
            if member not in self.met:
                self._one(out, member, None, self.pending_key, index)
                if len(out.consumed) + len(out.pending) + len(out.bad) >= READ_PAGE:
                    yield out
                    out = ObservationPage()
        if out.consumed or out.pending or out.bad:
            yield out

    def _one(
        self, out: ObservationPage, member: bytes, score: float | None, key: str, index: int
    ) -> None:
        try:
            if score is not None and member not in self.in_pending:
                # Outside the range of dates (±inf, past year 9999): the store reads no
                # observation there (load.lua).
                from_ms(score, "its score")
            observation = observation_from_json(self.identity_id, member)
        except BadRecord as exc:
            out.bad.append((_member_label(key, member, index), str(exc)))
            return
        out.labels[observation.id] = _member_label(key, member, index)
        limit = self.limit
        if member in self.in_pending or limit is None or score is None or score > limit:
            out.pending.append(observation)
        else:
            out.consumed.append(observation)


def _limit(store: RedisStore, identity_id: str, checkpoint: bytes | None) -> float | None:
    """The identity's checkpoint in epoch ms (None: never consolidated)."""
    if checkpoint is None:
        return None
    try:
        return checkpoint_ms(checkpoint)
    except BadRecord as exc:
        # Without it, nothing tells the consumed observations from the new ones: all
        # would count again.
        raise BadRecord(
            f"{store.keys.checkpoint} field {identity_id!r} is not epoch ms ({exc}): which"
            " observations were consumed is not known"
        ) from None


async def _read_keys(store: RedisStore, identity_id: str, sink: PageSink) -> _Keys:
    """The identity's keys as they were at one instant (see the module's docstring), its
    observations given to ``sink`` a page at a time."""
    k = store.keys
    obs, pending = k.of("obs", identity_id), k.of("pending", identity_id)
    facts, history = k.of("facts", identity_id), k.of("history", identity_id)
    sessions = k.of("sessions", identity_id)
    first = _first_page()
    async with store.client.pipeline(transaction=True) as pipe:
        pipe.hget(k.checkpoint, identity_id)
        pipe.zrange(obs, 0, first - 1, withscores=True)
        pipe.zcard(obs)
        pipe.zrange(pending, 0, first - 1)
        pipe.zcard(pending)
        pipe.hscan(facts, 0, count=first)
        pipe.lrange(history, 0, first - 1)
        pipe.llen(history)
        pipe.hscan(sessions, 0, count=first)
        with _typed():
            read: list[Any] = await pipe.execute()
    checkpoint, members, n_obs, pending_read, n_pending = read[:5]
    (facts_cursor, facts_read), history_read, n_history = read[5:8]
    sessions_cursor, sessions_read = read[8]
    if (
        len(members) == n_obs
        and len(pending_read) == n_pending
        and len(history_read) == n_history
        and int(facts_cursor) == 0
        and int(sessions_cursor) == 0
    ):
        keys = _Keys(
            checkpoint, pending_read, facts_read, history_read, list(sessions_read.values())
        )
        await _give(sink, _Classer(store, identity_id, keys), members)
        return keys
    del members, pending_read, facts_read, history_read, sessions_read
    # More than a page: all of it again, under WATCH (the first read's EXEC ended it).
    # The checkpoint map is shared by every identity, and not watched: the identity's
    # checkpoint is read again in the closing EXEC instead. The observations go to the
    # sink as they are read (into a Postgres transaction, for the import): a read that
    # the closing EXEC finds overtaken voids them (sink.restart) and starts again.
    for attempt in range(READ_ATTEMPTS):
        if attempt:
            await sink.restart()
        async with store.client.pipeline(transaction=True) as pipe:
            try:
                with _typed():
                    await pipe.watch(obs, pending, facts, history, sessions)
                    checkpoint = cast(bytes | None, await pipe.hget(k.checkpoint, identity_id))
                    keys = _Keys(
                        checkpoint,
                        [member for member, _ in await _zset(pipe, pending)],
                        await _hash(pipe, facts),
                        await _list(pipe, history),
                        list((await _hash(pipe, sessions)).values()),
                    )
                    classer = _Classer(store, identity_id, keys)
                    async for start, page in _zset_pages(pipe, obs):
                        await sink.page(classer.page(page, start))
                    for lost in classer.lost():
                        await sink.page(lost)
                    pipe.multi()  # type: ignore[no-untyped-call]
                    pipe.hget(k.checkpoint, identity_id)
                    (again,) = await pipe.execute()
            except WatchError:
                continue
            if again == checkpoint:
                return keys
    await sink.restart()
    return await _read_whole(store, identity_id, sink)


async def _give(sink: PageSink, classer: _Classer, members: list[tuple[bytes, float]]) -> None:
    """``members`` of ``obs:`` (all of them) to ``sink`` in pages, then the pending
    observations they do not hold."""
    for start in range(0, len(members), READ_PAGE):
        await sink.page(classer.page(members[start : start + READ_PAGE], start))
    for lost in classer.lost():
        await sink.page(lost)


async def _read_whole(store: RedisStore, identity_id: str, sink: PageSink) -> _Keys:
    """Every key of the identity in one ``MULTI``/``EXEC``, a reply per key: for an
    identity that something wrote during each of :data:`READ_ATTEMPTS` paged reads, which
    no write can land in. A reply may be large (one of 500,000 observations took 25 to
    32 s), and is held whole: it waits :data:`WHOLE_READ_TIMEOUT` for its replies (see
    :func:`_patient`), and the sink gets it a page at a time."""
    k = store.keys
    async with _patient(store) as client, client.pipeline(transaction=True) as pipe:
        pipe.hget(k.checkpoint, identity_id)
        pipe.zrange(k.of("obs", identity_id), 0, -1, withscores=True)
        pipe.zrange(k.of("pending", identity_id), 0, -1)
        pipe.hgetall(k.of("facts", identity_id))
        pipe.lrange(k.of("history", identity_id), 0, -1)
        pipe.hvals(k.of("sessions", identity_id))
        with _typed():
            checkpoint, members, pending, facts, history, sessions = await pipe.execute()
    keys = _Keys(checkpoint, pending, facts, history, sessions)
    await _give(sink, _Classer(store, identity_id, keys), members)
    return keys


@contextlib.asynccontextmanager
async def _patient(store: RedisStore) -> AsyncIterator[Redis]:
    """A client of ``store``'s server that waits :data:`WHOLE_READ_TIMEOUT` at least for
    a reply (the store's own when its socket timeout is longer, or none), closed after."""
    pool = store.client.connection_pool
    options = dict(pool.connection_kwargs)
    timeout = options.get("socket_timeout")
    if timeout is None or timeout >= WHOLE_READ_TIMEOUT:
        yield store.client
        return
    options["socket_timeout"] = WHOLE_READ_TIMEOUT
    own = ConnectionPool(connection_class=pool.connection_class, max_connections=1, **options)
    try:
        yield Redis(connection_pool=own)
    finally:
        await own.disconnect()


async def _zset_pages(pipe: Pipeline, key: str) -> AsyncIterator[tuple[int, list[Any]]]:
    """The members of a sorted set (with their scores) by rank, a page at a time, each
    with the rank of its first: under WATCH, nothing moves them, or the closing EXEC runs
    nothing."""
    start, count = 0, _first_page()
    while True:
        page: list[Any] = await pipe.zrange(key, start, start + count - 1, withscores=True)
        if page:
            yield start, page
        start += len(page)
        if len(page) < count:
            return
        count = _next_page(count, [member for member, _ in page])


async def _zset(pipe: Pipeline, key: str) -> list[tuple[bytes, float]]:
    """Every member of a sorted set (with its score), by rank."""
    out: list[tuple[bytes, float]] = []
    async for _, page in _zset_pages(pipe, key):
        out += page
    return out


async def _list(pipe: Pipeline, key: str) -> list[bytes]:
    out: list[bytes] = []
    count = _first_page()
    while True:
        page: list[Any] = await pipe.lrange(key, len(out), len(out) + count - 1)
        out += page
        if len(page) < count:
            return out
        count = _next_page(count, page)


async def _hash(pipe: Pipeline, key: str) -> dict[bytes, bytes]:
    """Every field of a hash, by HSCAN (which may give one twice)."""
    out: dict[bytes, bytes] = {}
    cursor, count = 0, _first_page()
    while True:
        reply: Any = await pipe.hscan(key, cursor, count=count)
        cursor, page = reply
        out.update(page)
        if int(cursor) == 0:
            return out
        count = _next_page(count, [*page.keys(), *page.values()])


@contextlib.contextmanager
def _typed() -> Iterator[None]:
    """A key of another type as the :class:`BadRecord` that leaves the identity out."""
    try:
        yield
    except ResponseError as exc:
        if "WRONGTYPE" not in str(exc):
            # A refusal of the server's (NOPERM: an ACL user without MULTI, EXEC, WATCH or
            # a read command) is no fault of the identity's keys: the run stops on it,
            # named, rather than leave out every identity as "of the wrong type".
            raise
        raise BadRecord(f"a key of the wrong type ({exc})") from exc


class _Collected:
    """A sink that keeps every page (for :func:`export_identity`)."""

    def __init__(self, out: ExportedIdentity) -> None:
        self.out = out

    async def page(self, page: ObservationPage) -> None:
        self.out.consumed += page.consumed
        self.out.pending += page.pending
        self.out.bad += page.bad
        self.out.labels.update(page.labels)

    async def restart(self) -> None:
        self.out.consumed, self.out.pending, self.out.bad = [], [], []
        self.out.labels = {}


async def export_identity(store: RedisStore, identity_id: str) -> ExportedIdentity:
    """Everything the Redis layout holds for ``identity_id``, as at one instant."""
    out = ExportedIdentity(identity_id)
    rest = await stream_identity(store, identity_id, _Collected(out))
    out.facts, out.events, out.checkpoint_at = rest.facts, rest.events, rest.checkpoint_at
    out.bad += rest.bad
    return out


async def stream_identity(store: RedisStore, identity_id: str, sink: PageSink) -> ExportedIdentity:
    """What the Redis layout holds for ``identity_id``, as at one instant: its
    observations given to ``sink`` a page at a time (of :data:`READ_PAGE` at most), the
    rest returned (with no observations; ``bad`` names the other records left out)."""
    k = store.keys
    facts_key = k.of("facts", identity_id)
    history_key, sessions_key = k.of("history", identity_id), k.of("sessions", identity_id)
    snapshot = await _read_keys(store, identity_id, sink)
    facts, history, sessions = snapshot.facts, snapshot.history, snapshot.sessions
    out = ExportedIdentity(identity_id)
    limit = _limit(store, identity_id, snapshot.checkpoint)
    if limit is not None:
        out.checkpoint_at = from_ms(limit, "checkpoint")
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
