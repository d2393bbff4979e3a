"""``coda-memory import-redis``: every identity of a Redis deployment, copied into Postgres.

Identities are copied one at a time, in sorted order, each in one Postgres transaction
that ends with its ledger row (see :mod:`coda_memory.postgres.imports`): a second run
copies nothing, and a run killed half-way resumes at the identity it was copying. Each
identity is read from Redis as at one instant, in pages (:mod:`coda_memory.redis.export`),
within its copy's transaction: each page of observations is written as it is read, so a
run holds a page of them, not the identity; observations are validated as new emits are, and every
record that cannot be used is counted and reported by key, never stopping the copy.
An identity whose records fail in a way the checks did not foresee (a key of another
type, a value Postgres refuses, an identity that is not UTF-8 text) is left out whole and
reported, and the next one goes on; so is one whose checkpoint live traffic holds locked
past the store's lock timeout (``busy``: a later run copies it), and one that the ledger
says was copied from another key prefix (two deployments' users of one name would become
one). A store that fails stops the run.

Dates ahead. An observation dated more than the clock skew
(:data:`~coda_memory.core.model.DEFAULT_MAX_CLOCK_SKEW`) after the run's now is copied as
dated now, as a live server stores a new one; so is each time of a fact that lies that
far ahead, since a fact anchored ahead outlives its time (decay counts nothing before
its anchor). Both are counted
(``future_clamped``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from coda_memory.core.logs import short_error
from coda_memory.core.model import DEFAULT_MAX_CLOCK_SKEW, Fact, Observation, replaced
from coda_memory.core.sanitize import MAX_IDENTITY_CHARS, ObservationRecord
from coda_memory.errors import ConnectionLost
from coda_memory.postgres.connection import (
    LOCK_NOT_AVAILABLE,
    QUERY_CANCELED,
    is_data_error,
    sqlstate,
)
from coda_memory.postgres.imports import (
    CopiedFromAnotherSource,
    CopyWriter,
    IdentityCopy,
    copied_identities,
    copy_identity,
    settle_copies,
)
from coda_memory.postgres.store import PostgresStore
from coda_memory.redis.codec import BadRecord, sanitized
from coda_memory.redis.export import ObservationPage, stream_identity
from coda_memory.redis.store import RedisStore


@dataclass(slots=True)
class ImportSummary:
    """Counts of one run, per kind (copied now; skipped: copied by an earlier run)."""

    #: The key prefix the identities were read under.
    prefix: str = ""
    identities: int = 0
    copied: int = 0
    skipped: int = 0
    observations: int = 0
    consumed_observations: int = 0
    facts: int = 0
    fact_events: int = 0
    checkpoints: int = 0
    #: Observations and facts dated more than :data:`DEFAULT_MAX_CLOCK_SKEW` after the
    #: run's now, copied as dated now (a fact's times that lie that far ahead).
    future_clamped: int = 0
    #: (key, reason) of every record left out.
    bad: list[tuple[str, str]] = field(default_factory=list)
    #: Records left out by earlier runs' copies of the identities skipped (the ledger
    #: counts them; ``--dry-run`` lists them).
    bad_earlier: int = 0
    #: Identities (as printable labels) that live traffic held locked: not copied, and
    #: not in the ledger, so a later run copies them.
    busy: list[str] = field(default_factory=list)
    #: Identities (as printable labels) left out whole: their data failed in a way no
    #: check foresaw. Not in the ledger either: a later run tries them again.
    failed: list[str] = field(default_factory=list)


#: SQLSTATEs of a lock wait given up on: the lock timeout, or the statement timeout.
_BUSY = frozenset({LOCK_NOT_AVAILABLE, QUERY_CANCELED})

#: Seconds the import's Redis client waits for one reply (``socket_timeout``, which a
#: Redis URL's ``?socket_timeout=`` overrides). An identity is read in pages
#: (:data:`~coda_memory.redis.export.READ_PAGE`), each a reply of a few MiB at most, where
#: redis-py's default is 5 s. One that live traffic writes during each paged read is read
#: in one reply per key, on a connection of its own that waits longer
#: (:data:`~coda_memory.redis.export.WHOLE_READ_TIMEOUT`, 300 s): one of 500,000
#: observations took 25 to 32 s.
IMPORT_SOCKET_TIMEOUT = 30.0


def _clean(
    page: ObservationPage, observations: list[Observation], key: str
) -> list[ObservationRecord]:
    clean: list[ObservationRecord] = []
    for observation in observations:
        try:
            clean.append(sanitized(observation))
        except BadRecord as exc:
            page.bad.append((page.labels.get(observation.id, key), str(exc)))
    return clean


class _Pages:
    """The sink of one identity's observation pages: each is validated, its dates ahead
    held to the run's now, and written to ``writer`` (none: a dry run counts them)."""

    def __init__(self, writer: CopyWriter | None, obs_key: str, at: datetime) -> None:
        self.writer = writer
        self.obs_key = obs_key
        self.records = partial(_not_ahead, now=at, times=_RECORD_TIMES, replace=dataclasses.replace)
        self.restart_counts()

    def restart_counts(self) -> None:
        self.bad: list[tuple[str, str]] = []
        self.ahead = 0
        self.observations = 0
        self.consumed = 0

    async def page(self, page: ObservationPage) -> None:
        consumed, consumed_ahead = self.records(_clean(page, page.consumed, self.obs_key))
        pending, pending_ahead = self.records(_clean(page, page.pending, self.obs_key))
        self.bad += page.bad
        self.ahead += consumed_ahead + pending_ahead
        self.observations += len(consumed) + len(pending)
        self.consumed += len(consumed)
        if self.writer is not None:
            await self.writer.write(consumed, pending)

    async def restart(self) -> None:
        self.restart_counts()
        if self.writer is not None:
            await self.writer.restart()


async def import_redis(
    source: RedisStore,
    target: PostgresStore | None,
    *,
    now: Callable[[], datetime],
    on_identity: Callable[[str, int, int], None] | None = None,
    summary: ImportSummary | None = None,
) -> ImportSummary:
    """Copy every identity under ``source``'s prefix into ``target``; with ``target``
    None (a dry run) only read, validate and count. ``on_identity(identity, done, total)``
    is called after each identity. The counts go into ``summary`` when given (so that a
    caller has those of a run that a failing store stopped), else into a new one."""
    identities = await source.identities()
    summary = summary if summary is not None else ImportSummary()
    summary.prefix = source.keys.prefix
    summary.identities = len(identities)
    copied_before = {} if target is None else await copied_identities(target, source.keys.prefix)
    #: Whether the ledger lists an identity as this run wrote or found it, skipped ones
    #: too: an earlier run killed before its last write left its copies unflushed, and
    #: this one reports them copied (see settle_copies).
    listed = False
    for done, identity in enumerate(identities, start=1):
        if identity in copied_before:
            listed = True
            summary.skipped += 1
            summary.bad_earlier += copied_before[identity]
            if on_identity is not None:
                on_identity(identity, done, len(identities))
            continue
        problem = _unusable(identity)
        if problem is None:
            try:
                if await _copy_one(source, target, identity, summary, now):
                    listed = True
            except CopiedFromAnotherSource as exc:
                problem = (
                    f"not copied: copied from the prefix {exc.source!r} already (two "
                    "deployments' users of one name would become one; copy this prefix "
                    "into a schema of its own, --schema)"
                )
            except Exception as exc:
                if sqlstate(exc) in _BUSY:
                    # Live traffic is consolidating it: the others go on.
                    summary.busy.append(_label(identity))
                elif isinstance(exc, BadRecord) or is_data_error(exc):
                    problem = f"not copied: {short_error(exc, show=True)}"
                else:
                    raise  # the store, not this identity's records: the run stops
        if problem is not None:
            # Left out whole; it is not in the ledger, so a later run tries it again.
            summary.bad.append((f"{source.keys.prefix}*:{_label(identity)}", problem))
            summary.failed.append(_label(identity))
        if on_identity is not None:
            on_identity(identity, done, len(identities))
    if target is not None and listed:
        # The copies commit unflushed, this run's and those of an earlier one that was
        # killed before its last write: the run reports them once they are durable.
        await settle_copies(target)
    return summary


def _unusable(identity: str) -> str | None:
    """Why ``identity`` (from a Redis key) cannot be an identity in Postgres, if it can't."""
    if not identity:  # ("obs:" with nothing after the prefix) no service serves it
        return "the identity in the key is empty"
    try:
        identity.encode("utf-8")
    except UnicodeEncodeError:
        return "the identity in the key is not UTF-8 text"
    if "\x00" in identity:
        return "the identity in the key holds a NUL character"
    if len(identity) > MAX_IDENTITY_CHARS:
        return f"the identity in the key is longer than {MAX_IDENTITY_CHARS} characters"
    return None


def _label(identity: str) -> str:
    """``identity`` as printable text: what is not UTF-8 as escaped bytes."""
    raw = identity.encode("utf-8", "surrogateescape")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return repr(raw)
    return text if text.isprintable() else repr(text)


#: The times of an observation and of a fact, each of which is copied as dated now when
#: it lies ahead.
_RECORD_TIMES = ("created_at",)
_FACT_TIMES = ("last_reinforced_at", "confidence_at", "created_at", "updated_at")

_Dated = TypeVar("_Dated", ObservationRecord, Fact)


def _not_ahead(
    items: Sequence[_Dated],
    now: datetime,
    times: tuple[str, ...],
    replace: Callable[..., _Dated],
) -> tuple[list[_Dated], int]:
    """``items``, each of their ``times`` that lies more than the clock skew after ``now``
    set to ``now`` (as the writer dates a new emit), and how many items had one."""
    latest = now + DEFAULT_MAX_CLOCK_SKEW
    dated: list[_Dated] = []
    ahead = 0
    for item in items:
        late = {name: now for name in times if (getattr(item, name) or now) > latest}
        if late:
            item = replace(item, **late)
            ahead += 1
        dated.append(item)
    return dated, ahead


class _RedisFailed(Exception):
    """A failure of Redis while an identity is read within its copy's Postgres
    transaction, carried out of it with no cause: a Redis timeout is an OSError (as
    TimeoutError is), and so is what a lost Redis connection was raised from, which the
    Postgres store takes for its own connection dead (it replaced its pool and read the
    identity again)."""

    def __init__(self, error: Exception, cause: Exception) -> None:
        super().__init__(str(error))
        self.error = error
        self.cause = cause


async def _copy_one(
    source: RedisStore,
    target: PostgresStore | None,
    identity: str,
    summary: ImportSummary,
    now: Callable[[], datetime],
) -> bool:
    """Read ``identity`` from ``source``, and copy it into ``target`` (None: count it);
    whether ``target``'s ledger now lists it (copied here, or found copied: by another
    run, or by this one's commit whose connection was lost before it answered)."""
    at = now()
    pages: _Pages | None = None
    facts_ahead = 0
    bad: list[tuple[str, str]] = []

    async def read(writer: CopyWriter | None) -> IdentityCopy:
        nonlocal pages, facts_ahead, bad
        pages = _Pages(writer, source.keys.of("obs", identity), at)
        try:
            exported = await stream_identity(source, identity, pages)
        except RedisTimeoutError as exc:
            raise _RedisFailed(
                TimeoutError(
                    f"Redis did not answer within its socket timeout while the identity "
                    f"{_label(identity)} was read (a large one: give it longer with "
                    "?socket_timeout=SECONDS in the Redis URL); the next run resumes there"
                ),
                exc,
            ) from None
        except RedisConnectionError as exc:
            raise _RedisFailed(
                ConnectionLost(
                    f"the connection to Redis was lost while the identity "
                    f"{_label(identity)} was read ({exc}); the next run resumes there"
                ),
                exc,
            ) from None
        facts, facts_ahead = _not_ahead(exported.facts, at, _FACT_TIMES, replaced)
        bad = [*pages.bad, *exported.bad]
        return IdentityCopy(
            identity_id=identity,
            source=source.keys.prefix,
            facts=facts,
            events=exported.events,
            checkpoint_at=exported.checkpoint_at,
            bad_records=len(bad),
        )

    try:
        if target is None:
            copy = await read(None)
        else:
            counts = await copy_identity(target, identity, source.keys.prefix, read, at)
    except _RedisFailed as failed:
        raise failed.error from failed.cause
    if target is None:
        assert pages is not None
        summary.bad += bad
        summary.copied += 1
        summary.observations += pages.observations
        summary.consumed_observations += pages.consumed
        summary.facts += len(copy.facts)
        summary.fact_events += len(copy.events)
        summary.checkpoints += copy.checkpoint_at is not None
        summary.future_clamped += pages.ahead + facts_ahead
        return False
    if counts is None:
        summary.skipped += 1
        return True
    assert pages is not None
    summary.bad += bad
    summary.copied += 1
    summary.observations += counts.observations
    summary.consumed_observations += counts.consumed_observations
    summary.facts += counts.facts
    summary.fact_events += counts.fact_events
    summary.checkpoints += counts.checkpoints
    summary.future_clamped += pages.ahead + facts_ahead
    return True
