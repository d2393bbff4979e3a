"""The write path of a service: the bounded queue of emitted observations and the
background writer that validates, sanitises and stores them in batches.

:class:`ObservationWriter` is the base of :class:`~coda_memory.service.MemoryService`: it
holds the queue, its counters and the writer task; the service sets the shared attributes
declared here (store, clock, logging, telemetry) and adds consolidation and loading.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import contextvars
import dataclasses
import sys
import threading
import uuid
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from functools import partial
from itertools import chain
from typing import Any, Protocol

from coda_memory.core.cancellation import run_to_end, to_the_end
from coda_memory.core.caps import LogThrottle
from coda_memory.core.logs import identity_label, short_error, without_identities
from coda_memory.core.model import NewObservation, ObservationType
from coda_memory.core.sanitize import (
    MAX_METADATA_BYTES,
    ObservationRejected,
    sanitize_fields,
    sanitize_observation,
)
from coda_memory.core.turns import collector_scope
from coda_memory.errors import ConnectionLost, StoreBusy
from coda_memory.ports import AppendOutcome, MemoryStore, ObservationRecord

Clock = Callable[[], datetime]


class Spans(Protocol):
    """What the writer needs of the service's telemetry (``coda_memory.telemetry``)."""

    def span(self, name: str, **attributes: Any) -> AbstractContextManager[Any]: ...


#: Seconds between attempts of a batch that a lock or a timeout kept out (StoreBusy).
BUSY_RETRY = 0.05

#: Seconds the writer waits before it goes on after an unexpected error that lost nothing.
WRITER_FAILED_RETRY = 0.1
#: Appends in flight at once, when a backlog of full batches waits (see ``_write_batches``).
MAX_APPENDS = 2
#: Full batches the writer validates ahead while an append waits to be retried (a lock,
#: an unreachable server), so that once the store answers again only the appends remain.
#: They count against ``queue_size``, as queued observations do. (Not otherwise: records
#: validated ahead live longer, which made a steady ingest slower.)
MAX_AHEAD = 4

#: The default bound on the bytes of queued observations (see ``queue_bytes``).
DEFAULT_QUEUE_BYTES = 64 * 1024 * 1024
#: What an observation costs beyond its text: the queue's tuple, the timestamps (and the
#: model, for one kept as it is).
_ITEM_OVERHEAD = 512


#: What an empty str costs; an ASCII str costs one byte more per character.
_STR_BYTES = sys.getsizeof("")


def _text_bytes(text: str) -> int:
    """``sys.getsizeof(text)``, from its length when it is ASCII (the common case, at a
    tenth of the cost of ``getsizeof`` on the emit path)."""
    return _STR_BYTES + len(text) if text.isascii() else sys.getsizeof(text)


def _id_bytes(value: object) -> int:
    """What an identity or session id holds in memory, about (the queue holds it until
    the writer rejects one too long: uncounted, long ids filled memory past
    ``queue_bytes``); nothing for None or an object that is not a ``str``, which the
    writer rejects."""
    if type(value) is str:
        return _text_bytes(value)
    return sys.getsizeof(value) if isinstance(value, str) else 0


class _TooManyValues(Exception):
    """Metadata of more values than validation accepts (see :func:`_approximate_bytes`)."""


def _approximate_bytes(obs: NewObservation) -> int:
    """What a queued observation holds in memory, about: its text (its session id's too)
    and its metadata's. Raises :class:`_TooManyValues` for metadata of more keys and
    values than fit in the 16 KiB validation allows (each costs a byte of JSON at least),
    having read no more of it than that: walked whole, a list of a million numbers held
    the caller 0.1 s."""
    size = _ITEM_OVERHEAD + _text_bytes(obs.content)
    session = obs.session_id
    if type(session) is str and session.isascii():  # (the common case, without a call)
        size += _STR_BYTES + len(session)
    elif session is not None:
        size += _id_bytes(session)
    metadata = obs.metadata
    return size + _nested_bytes(metadata, 0, [MAX_METADATA_BYTES]) if metadata else size


#: Scalar metadata values, counted flat (exact types, checked first: this is the emit path).
_SCALARS = frozenset({int, float, bool, type(None)})


def _nested_bytes(value: object, depth: int, left: list[int]) -> int:
    """``value``'s bytes, about; ``left``: how many more keys and values may be read."""
    kind = type(value)
    if kind is str:
        return _text_bytes(value)  # type: ignore[arg-type]
    if kind is bytes:
        return sys.getsizeof(value)
    if kind in _SCALARS:
        return 32
    if depth > 16:  # far deeper than validation accepts: count it as big
        return 1 << 20
    if isinstance(value, dict | list | tuple | set | frozenset):
        left[0] -= len(value) * (2 if isinstance(value, dict) else 1)
        if left[0] < 0:
            raise _TooManyValues
    if isinstance(value, dict):
        size = 64
        for key, item in value.items():
            # Flat metadata (string keys, scalar values) without a call per entry.
            if type(key) is str and key.isascii():
                size += _STR_BYTES + len(key)
            else:
                size += _nested_bytes(key, depth + 1, left)
            kind = type(item)
            if kind in _SCALARS:
                size += 32
            elif kind is str and item.isascii():
                size += _STR_BYTES + len(item)
            else:
                size += _nested_bytes(item, depth + 1, left)
        return size
    if isinstance(value, list | tuple | set | frozenset):
        return 64 + sum(_nested_bytes(item, depth + 1, left) for item in value)
    if isinstance(value, str | bytes):  # their subclasses
        return sys.getsizeof(value)
    return 32


#: Seconds ``close`` waits, after its ``timeout``, for the writer to stop, the
#: consolidations and the caller's calls in flight to end (one grace, which they share),
#: and then for the store to close: a connection that never answers can't hold it up
#: longer.
CLOSE_GRACE = 2.0
#: Observations the writer validates between two turns of the event loop (about a
#: millisecond of work), so that a large batch does not hold up requests.
VALIDATE_CHUNK = 64


#: How many identities :attr:`ObservationWriter.stored_for` remembers (then it starts over:
#: forgetting one only costs its next load a peek).
STORED_FOR_LIMIT = 100_000


#: A queued observation, one flat tuple: identity id, type, content, session id,
#: created_at, approximate bytes, the emitted object when it is not a plain
#: NewObservation (else None), its sequence, then the metadata's keys and values in turn
#: (see :func:`_queued`).
_Item = tuple[Any, ...]
#: Where an item's sequence is: which emit it came of (the count of emits with it), by
#: which a wait tells what was emitted before it began from what came after (see
#: :meth:`ObservationWriter._written`).
_SEQUENCE = 7
#: Where an item's metadata begins.
_METADATA = 8

#: The plain value of each observation type (a member is an object the collector tracks).
_TYPE_VALUES: dict[object, str] = {member: member.value for member in ObservationType}


def _queued(
    identity_id: str, obs: NewObservation, created_at: datetime, size: int, sequence: int
) -> _Item:
    """The queue's form of an observation: its fields in one flat tuple, without the
    model, the metadata as its keys and values.

    The queue holds many observations when the store keeps them out (a lock on
    ``observations`` held for 10 s queues about 25,000). Kept as models, each is a few
    objects that the cyclic garbage collector tracks: a full collection walks them with
    the event loop stalled, and their growth sets one off. CPython stops tracking a tuple
    that holds only untracked values (strings, numbers, datetimes, None, not a dict) at
    the first collection that sees it; nested, the outer one would wait for another. So
    an observation with scalar metadata waits out of the collector's sight. An object
    that is not a plain NewObservation is kept as it is and validated so."""
    if type(obs) is NewObservation:
        values = obs.__dict__
        kind = values.get("type")
        plain = _TYPE_VALUES.get(kind) if type(kind) is ObservationType else None
        metadata = values.get("metadata")
        if plain is not None and type(metadata) is dict:
            return (
                identity_id,
                plain,
                values.get("content"),
                values.get("session_id"),
                created_at,
                size,
                None,
                sequence,
                *chain.from_iterable(metadata.items()),
            )
    return (identity_id, None, None, None, created_at, size, obs, sequence)


class _Wait:
    """A wait for what was emitted before it began (see :meth:`ObservationWriter._written`).

    ``mark``: the sequence of the last emit it covers, read once the wait is listed (an
    emit refused on another thread meanwhile then finds it, and counts as later when it
    is); ``later``: how many items emitted after the mark were processed since, which the
    processed count holds but the wait does not wait for."""

    __slots__ = ("later", "mark")

    def __init__(self) -> None:
        self.mark = sys.maxsize  # (until it is read: no emit counts as later)
        self.later = 0


class ObservationWriter:
    """The queue and the background writer of a service (see the module docstring)."""

    # Set by the service: what the writer stores into, and how it validates and logs.
    store: MemoryStore
    clock: Clock
    max_clock_skew: timedelta
    tool_catalog: frozenset[str] | None
    log_identities: bool
    _log: LogThrottle
    _telemetry: Spans

    def __init__(
        self, *, queue_size: int, queue_bytes: int, batch_size: int, hold_gc: bool = True
    ) -> None:
        #: Whether validating and storing a batch holds the cyclic garbage collector off
        #: (:func:`~coda_memory.core.turns.collector_scope`).
        self.hold_gc = hold_gc
        self._queue_size = queue_size
        self._queue_bytes = queue_bytes
        #: Bytes of the observations queued or in the writer's hands (about).
        self._held_bytes = 0
        self._batch_size = batch_size
        self._queue: deque[_Item] = deque()
        self._inflight = 0
        #: Batches validated ahead, waiting for an append (see MAX_AHEAD), and their
        #: observations' count.
        self._ahead_batches: deque[tuple[list[_Item], list[ObservationRecord]]] = deque()
        #: The batches of the appends under way, by key (until each is settled).
        self._appending: dict[
            str, tuple[list[_Item], list[ObservationRecord], asyncio.Task[None]]
        ] = {}
        #: Batches whose append a cancellation cut short, other than close()'s, with
        #: their key: stored or not, the writer that runs next sends each again with it,
        #: and the store tells which.
        self._unsettled: deque[tuple[list[_Item], list[ObservationRecord], str]] = deque()
        self._ahead = 0
        #: The count of emits, which is also the sequence of the last one (see _SEQUENCE).
        self._emitted = 0
        self._stored = self._rejected = self._dropped = self._discarded = 0
        #: The waits of :meth:`_written` under way (a tuple replaced, not changed: an emit
        #: of another thread reads it as it is).
        self._waits: tuple[_Wait, ...] = ()
        #: The items the writer validates, by sequence, until they are in a batch (or back
        #: in the queue): what it holds beside its batches, should it fail meanwhile.
        self._validating: dict[int, _Item] = {}
        self._future_clamped = 0
        self._closed = False
        #: Set once close() stops the writer, for good: it is never started again, and
        #: what it held is counted as dropped (see _stop_writer).
        self._stopped = False
        #: Whether a wake-up of the writer is on its way to the service's loop from
        #: another thread (see _wake): one is enough for any number of emits.
        self._wake_scheduled = False
        #: The same for a wake-up of the drains waiting (see _wake_waiters).
        self._progress_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._writer: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        #: Set when the queue holds a full batch, and when an append starts to retry
        #: (what the writer waits for beside its appends).
        self._filled: asyncio.Event | None = None
        self._retry_started: asyncio.Event | None = None
        #: Appends waiting to be retried (see MAX_AHEAD).
        self._retrying = 0
        self._progress: asyncio.Event | None = None
        #: Identities this writer stored observations of since their last consolidation
        #: here: their next load consolidates without peeking first.
        self.stored_for: set[str] = set()

    def emit_observation(self, identity_id: str, obs: NewObservation) -> None:
        """Queue an observation for storage. Never raises and never waits on I/O."""
        emitted = 0  # (which emit this is, its sequence: see _refused_emit)
        try:
            emitted = self._emitted = self._emitted + 1
            try:
                size = _approximate_bytes(obs)
                # (An ASCII str, the common case, without the call.)
                if type(identity_id) is str and identity_id.isascii():
                    size += _STR_BYTES + len(identity_id)
                else:
                    size += _id_bytes(identity_id)
            except _TooManyValues:
                self._refused_emit(emitted)
                self._reject(identity_id, "metadata is larger than 16 KiB")
                self._wake_waiters()  # (a drain may wait for it: another thread's)
                return
            # A service whose event loop is closed (an asyncio.run() that ended) has no
            # writer that could store it: queued, it stayed pending for ever.
            loop_closed = self._loop is not None and self._loop.is_closed()
            if loop_closed:
                self._lost_with_loop()
            if (
                self._closed
                or loop_closed
                or len(self._queue) + self._ahead >= self._queue_size
                or self._held_bytes + size > self._queue_bytes
            ):
                if self._closed:
                    reason = "service closed"
                elif loop_closed:
                    reason = "the service's event loop is closed (one service per event loop)"
                elif size > self._queue_bytes:
                    reason = "observation larger than queue_bytes"
                elif len(self._queue) + self._ahead >= self._queue_size:
                    reason = "queue full"
                else:
                    reason = "queue_bytes full"
                self._refused_emit(emitted)
                self._drop(1, reason)
                return
            created_at = obs.created_at
            if created_at is None:
                try:
                    created_at = self.clock()
                except Exception as error:  # the host's clock: the observation stays
                    created_at = self._clock_failed(error)
            self._queue.append(_queued(identity_id, obs, created_at, size, emitted))
            self._held_bytes += size
        except Exception as error:  # the fire-and-forget boundary: log, count, carry on
            self._refused_emit(emitted)
            self._rejected += 1
            self._wake_waiters()
            self._log.warning(
                "not queued",
                "coda-memory: observation for %s not queued: %s",
                self._label(identity_id),
                # By its class only: the host's object raised it (a str subclass, an
                # observation of its own), and its message may quote what it held.
                type(error).__name__,
            )
            return
        try:
            self._wake()
        except Exception as error:
            # Queued: it is stored once the writer runs (the next emit, drain() or
            # close() starts it). Counted as rejected too, it counted twice, and pending
            # went below zero.
            self._log.warning(
                "writer not started",
                "coda-memory: the writer could not be started (%s); what is queued waits "
                "for the next emit, drain() or close()",
                type(error).__name__,
            )

    def _refused_emit(self, emitted: int) -> None:
        """Count an emit refused as it came (``emitted``: its sequence) as later for each
        wait begun before it (see :meth:`_written`). Before it counts as processed: a wait
        that saw it processed first (this may be another thread) ended an item early."""
        for wait in self._waits:
            if emitted > wait.mark:
                wait.later += 1

    def _count_later(self, items: list[_Item]) -> None:
        """Count, for each wait, the items of ``items`` emitted after it began, as they are
        processed (see :meth:`_written`)."""
        waits = self._waits
        if not waits:
            return
        # Sorted once, each wait's count a bisection: a scan per wait stalled the loop
        # for 109 ms with 500 drains (forgets, a host's per request) over 5,000 items.
        sequences = sorted(item[_SEQUENCE] for item in items)
        for wait in waits:
            later = len(sequences) - bisect.bisect_right(sequences, wait.mark)
            # Counted first: counted inside the +=, the +1 of another thread's emit
            # refused between the read of ``later`` and its write would be lost.
            wait.later += later

    def _may_collect(self) -> bool:
        """Whether a collection of the garbage collector, which stalls the event loop, may
        run now (:func:`~coda_memory.core.turns.collector_scope`)."""
        return True

    def _label(self, identity_id: object) -> str:
        return identity_label(identity_id, show=self.log_identities)

    def _drop(self, count: int, reason: str) -> None:
        self._dropped += count
        # At most one line a second (an outage can't flood the log), with the total.
        self._log.warning(
            f"dropped: {reason}",
            "coda-memory: dropped %d observation(s) (%s); %d dropped so far",
            count,
            reason,
            self._dropped,
        )
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        """Wake a ``drain()`` waiting for progress: what it waits for may just have been
        counted, here or by another thread's emit (a drain that never woke waited for
        ever). Through the service's loop from another thread; not at all once that loop
        is closed (nothing can wait on it, and its ``call_soon`` raises)."""
        progress, loop = self._progress, self._loop
        if progress is None or loop is None or loop.is_closed():
            return
        if self._loop_thread == threading.get_ident():
            progress.set()
            return
        if self._progress_scheduled:  # one on its way serves them all (see _wake)
            return
        self._progress_scheduled = True
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(self._progress_on_loop)

    def _progress_on_loop(self) -> None:
        """:meth:`_wake_waiters` for another thread, run on the service's loop."""
        self._progress_scheduled = False
        if self._progress is not None:
            self._progress.set()

    def _check_loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, which must be the one the service first ran on."""
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            raise RuntimeError(
                "this MemoryService is bound to the event loop it first ran on (its writer "
                "and connections live there); create one service per event loop, e.g. "
                "inside the asyncio.run() that uses it"
            )
        return loop

    def _wake(self) -> None:
        """Tell the writer that the queue grew, starting it first when it does not run
        (on the caller's event loop, or through the service's loop from another thread)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None and (self._loop is None or self._loop is loop):
            self._ensure_writer(loop)
            self._signal()
        elif (
            self._loop is not None
            and not self._loop.is_closed()
            and not self._wake_scheduled
            and (
                self._loop_thread != threading.get_ident()
                or not self._loop.is_running()
                or loop is not None
            )
        ):
            # From another thread or another event loop, or from the loop's own thread
            # between its runs (a host that runs each request with run_until_complete):
            # the writer is woken, or started, when the service's loop next runs.
            # (A loop that is closed has no writer: emit_observation drops what comes.
            # The loop may be bound by a load with no writer started yet: no start(),
            # and nothing emitted on the loop.) One wake-up on its way serves every emit
            # until it runs: a callback each, 8 threads emitting while the loop was held
            # for a second queued 72,000, and the loop's next turn took 58 ms.
            self._wake_scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._wake_on_loop)
            except RuntimeError:  # closed meanwhile: _lost_with_loop counts the queue
                self._wake_scheduled = False
        # Otherwise no loop runs yet: the items wait until the writer starts.

    def _wake_on_loop(self) -> None:
        """:meth:`_wake` for an emit of another thread, run on the service's loop."""
        self._wake_scheduled = False
        if self._loop is None:
            return
        if self._stopped:  # close() has dealt with what was queued before this came
            self._lost_after_close()
            return
        self._ensure_writer(self._loop)
        self._signal()

    def _signal(self) -> None:
        """Tell the writer that the queue grew (and whether it holds a full batch)."""
        assert self._wakeup is not None and self._filled is not None
        self._wakeup.set()
        if len(self._queue) >= self._batch_size:
            self._filled.set()

    def _events(self) -> None:
        """Make the events the writer and its waiters share, once."""
        if self._wakeup is None:
            self._wakeup, self._progress = asyncio.Event(), asyncio.Event()
            self._filled, self._retry_started = asyncio.Event(), asyncio.Event()

    def _ensure_writer(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the writer on ``loop`` unless it runs, or close() has stopped it."""
        if self._stopped or (self._writer is not None and not self._writer.done()):
            return
        self._loop, self._loop_thread = loop, threading.get_ident()
        self._events()
        # In a context of its own: the writer outlives the call that happened to start
        # it (a request), whose context variables (its trace, a host's request id) would
        # otherwise hold for every batch it ever stores. Made inside that context rather
        # than given it (create_task's context=), which a host's task factory of the
        # older (loop, coro) form refuses.
        self._writer = contextvars.Context().run(
            loop.create_task, self._write_loop(), name="coda-memory-writer"
        )

    async def _write_loop(self) -> None:
        """:meth:`_write_batches`, for as long as the writer runs: an unexpected error (a
        bug) loses the batches it held, counted as dropped with a log line, and the
        writer goes on with what is queued. (Stopped, it left them in flight for ever:
        ``drain()`` never returned, and nothing emitted was stored again.) Cancelled
        other than by ``close()`` (the event loop shutting down, an ``asyncio.run()``
        that returned without closing the service, a host cancelling every task before
        it closes), it keeps what it held (the batches its appends held, with their keys,
        and those validated ahead) and says how many observations wait: ``close()`` or
        ``drain()`` on the loop starts it again, and it stores them, each batch cut short
        sent again with its key (the store stores it once, and reports the outcome of
        the first COMMIT that landed);
        once the loop is closed, :meth:`_lost_with_loop` counts them as dropped. (They
        were counted as dropped at once: a batch whose COMMIT had landed was then
        counted as dropped though stored, and the batches validated ahead were lost.)"""
        while True:
            try:
                await self._write_batches()
            except asyncio.CancelledError:
                if not self._stopped:
                    # Its appends went with it (some before they began): each batch goes
                    # again with its key.
                    self._resend_cut_short()
                    waiting = len(self._queue) + self._inflight
                    if waiting:
                        self._log.warning(
                            "writer cancelled",
                            "coda-memory: the writer was cancelled (the event loop "
                            "stopping?) with %d observation(s) queued or in flight: lost "
                            "unless close() or drain() follows on this loop, or the "
                            "loop's shutdown_asyncgens() (asyncio.run() calls it), which "
                            "closes a service left open",
                            waiting,
                        )
                    assert self._progress is not None
                    self._progress.set()  # a drain() waiting starts it again (_written)
                raise
            except Exception as error:
                if self._loop is not None and self._loop.is_closed():
                    # Closed by the garbage collector after its loop closed (the host
                    # closed the loop under it): what it held counts as lost there.
                    self._lost_with_loop()
                    return
                if not self._writer_failed(error):
                    await asyncio.sleep(WRITER_FAILED_RETRY)  # nothing was lost: no spin

    def _resend_cut_short(self) -> None:
        """Note each batch whose append has ended without being settled (cancelled,
        before it began or during an attempt) for the next writer to send again with its
        key (an append still running settles its batch itself, or is noted as it ends:
        :meth:`_cut_short`)."""
        for key, (items, records, task) in list(self._appending.items()):
            if task.done():
                del self._appending[key]
                self._unsettled.append((items, records, key))

    def _lost_after_close(self) -> None:
        """Count as dropped what another thread queued once close() had stopped the
        writer (it had found the service open just before): no writer will store it."""
        if self._stopped and self._writer is None and self._queue:
            self._drop_held("service closed before they were stored", queued=True)

    def _lost_with_loop(self) -> None:
        """Count what waited to be stored as dropped once the service's event loop is
        closed before ``close()`` ended: no writer can ever store it (it stayed pending)."""
        loop = self._loop
        if loop is not None and loop.is_closed() and (self._queue or self._inflight):
            self._drop_held("the event loop stopped before close()", queued=True)

    def _writer_failed(self, error: Exception) -> int:
        """Count what the writer held when ``error`` stopped it as dropped; how many."""
        lost = self._drop_held(f"the writer met an unexpected {type(error).__name__}")
        self._wake_waiters()
        return lost

    def _drop_held(self, reason: str, *, queued: bool = False) -> int:
        """Count what the writer holds as dropped, for ``reason``, and let it go: its
        batches in flight (those validated ahead among them), and the queue too when
        ``queued``; how many."""
        taken = self._taken_off_queue() if queued else []
        lost = self._inflight + len(taken)
        held = [*taken, *self._held_items()]
        self._count_later(held)
        self._validating.clear()
        self._ahead_batches.clear()
        self._appending.clear()
        self._unsettled.clear()
        self._inflight = self._ahead = 0
        # Less what it let go, computed before the count is read (see _settled): set anew
        # from the queue after calls, it lost what an emit of another thread added.
        freed = sum(item[5] for item in held)  # bytes
        self._held_bytes -= freed
        if self._held_bytes < 0:
            self._held_bytes = 0
        if lost:
            self._drop(lost, reason)
        return lost

    def _held_items(self) -> list[_Item]:
        """The items the writer holds (see :meth:`_drop_held`): those it validates, and
        those of its batches."""
        return [
            *self._validating.values(),
            *chain.from_iterable(items for items, _ in self._ahead_batches),
            *chain.from_iterable(items for items, _, _ in self._appending.values()),
            *chain.from_iterable(items for items, _, _ in self._unsettled),
        ]

    def _taken_off_queue(self) -> list[_Item]:
        """What the queue holds, taken off it an item at a time: another thread may
        append meanwhile (it stays queued), or take too (an emit that found the loop
        closed), and a deque's append and popleft are atomic where iterating it raises."""
        queue = self._queue
        taken: list[_Item] = []
        with contextlib.suppress(IndexError):  # (taken by that other thread)
            for _ in range(len(queue)):
                taken.append(queue.popleft())
        return taken

    async def _write_batches(self) -> None:
        """Take batches off the queue and store them. One append at a time, and what
        arrives meanwhile makes the next batch; when a full batch waits (a backlog), a
        second append starts beside the first, so that the Python work of one batch
        (validation, encoding) overlaps the server's work on the other. While an append
        waits to be retried (a lock, an unreachable server), the full batches that keep
        arriving are validated ahead, up to :data:`MAX_AHEAD`, and go as soon as an
        append is done."""
        assert self._wakeup is not None
        assert self._filled is not None and self._retry_started is not None
        appends: set[asyncio.Task[None]] = set()
        ahead = self._ahead_batches  # kept by the writer, should it be started again
        waiters: dict[asyncio.Event, asyncio.Task[Any]] = {}
        loop = asyncio.get_running_loop()
        self._resend_cut_short()  # (an append that ended after the writer was cancelled)
        try:
            while True:
                while self._unsettled and len(appends) < MAX_APPENDS:
                    items, records, key = self._unsettled.popleft()
                    appends.add(self._appended(loop, items, records, key))
                while ahead and len(appends) < MAX_APPENDS:
                    items, records = ahead.popleft()
                    self._ahead -= len(items)
                    appends.add(self._appended(loop, items, records))
                backlog = len(self._queue) >= self._batch_size
                room = len(appends) < MAX_APPENDS or (self._retrying > 0 and len(ahead) < MAX_AHEAD)
                if (backlog and room) or (self._queue and not appends):
                    batch = await self._take()
                    if len(appends) < MAX_APPENDS:
                        appends.add(self._appended(loop, *batch))
                    else:
                        ahead.append(batch)
                        self._ahead += len(batch[0])
                    continue
                if not appends:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                # Wait for an append, or for what would let the next batch go: the queue
                # filling a batch, an append starting to retry.
                waits: set[asyncio.Future[Any]] = set(appends)
                for event, wanted in (
                    (self._filled, not backlog),
                    (self._retry_started, not self._retrying),
                ):
                    if wanted:
                        event.clear()
                        if event not in waiters or waiters[event].done():
                            waiters[event] = loop.create_task(event.wait())
                        waits.add(waiters[event])
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in done & appends:
                    appends.discard(task)
                    task.result()  # an unexpected error: see _write_loop
        finally:
            for task in (*appends, *waiters.values()):
                task.cancel()
            if appends:
                # Through a second cancellation too (a host cancelling every task again):
                # an append given a moment to end (see _attempt) counts its batch when it
                # ends, so the writer must not count it as dropped before then.
                await run_to_end(asyncio.wait(appends), limit=CLOSE_GRACE)

    async def _take(self) -> tuple[list[_Item], list[ObservationRecord]]:
        """The next batch off the queue (a full one, or what there is), validated: the
        items that became records, and the records (the others were rejected, and are
        no longer in flight)."""
        count = min(self._batch_size, len(self._queue))
        items = [self._queue.popleft() for _ in range(count)]
        self._inflight += len(items)
        self._validating = {item[_SEQUENCE]: item for item in items}
        try:
            with collector_scope(self.hold_gc, self._may_collect):
                batch = await self._validate(items)
        except asyncio.CancelledError:
            self._validating.clear()  # back at the front of the queue (see _validate)
            raise
        self._validating.clear()  # in the batch now, or rejected
        return batch

    def _appended(
        self,
        loop: asyncio.AbstractEventLoop,
        items: list[_Item],
        records: list[ObservationRecord],
        key: str | None = None,
    ) -> asyncio.Task[None]:
        """The task that stores a batch, noted under its key until it is settled (see
        :attr:`_appending`). ``key``: the batch's, when an append of it was cut short."""
        # One key per batch, kept across retries: a retry after a lost COMMIT
        # acknowledgement stores nothing twice (the store records the key).
        first_attempt = key is None
        key = str(uuid.uuid4()) if key is None else key
        task = loop.create_task(self._append(items, records, key, first_attempt))
        self._appending[key] = (items, records, task)  # (before the task can begin)
        task.add_done_callback(partial(self._cut_short, key))
        return task

    def _cut_short(self, key: str, task: asyncio.Task[None]) -> None:
        """Note the batch of an append that ended cancelled, unsettled, for the writer to
        send again with its key, as the append ends. Noted only by the writers
        (:meth:`_resend_cut_short`), it stayed in flight for ever when the append ended
        after its writer had ended (a host sweeping every task again cancelled the
        writer's wait for it) and after a new writer had begun."""
        entry = self._appending.get(key)
        if entry is None or entry[2] is not task or not task.cancelled():
            return
        del self._appending[key]
        self._unsettled.append((entry[0], entry[1], key))
        assert self._wakeup is not None and self._progress is not None
        self._wakeup.set()  # the writer that runs sends it ...
        self._progress.set()  # ... or the drain() waiting starts one (see _written)

    async def _append(
        self,
        items: list[_Item],
        records: list[ObservationRecord],
        key: str,
        first_attempt: bool,
    ) -> None:
        """Store one validated batch, retrying while the store is unreachable (until a
        connection is lost around an attempt, or an append of it was cut short, none of
        the batch can be stored: ``first_attempt``)."""
        assert self._progress is not None
        backoff = 0.05
        retried = False
        try:
            while records:
                try:
                    with (
                        collector_scope(self.hold_gc, self._may_collect),
                        self._telemetry.span("append", **{"coda_memory.batch": len(records)}),
                    ):
                        outcome, stopped = await self._attempt(records, key, first_attempt)
                except StoreBusy as error:
                    # A lock or a timeout: the attempt already waited (the writer's lock
                    # timeout), so the same batch goes again at once, and goes in as soon as
                    # the lock is released. When the store lost a connection around a COMMIT
                    # before that, the batch may be stored: the next attempt looks for it.
                    if error.may_have_stored:
                        first_attempt = False
                    self._log.warning(
                        "store busy",
                        "coda-memory: storing %d observation(s) waits (%s); retrying",
                        len(records),
                        short_error(error, self._identities(records), show=self.log_identities),
                    )
                    retried = retried or self._retry_begins()
                    await asyncio.sleep(BUSY_RETRY)
                    continue
                except (ConnectionLost, OSError) as error:
                    # A lost connection is worth retrying too: the same batch, same key.
                    first_attempt = False
                    self._log.warning(
                        "store unavailable",
                        "coda-memory: storing %d observation(s) failed (%s); retrying in %.2fs",
                        len(records),
                        short_error(error, self._identities(records), show=self.log_identities),
                        backoff,
                    )
                    retried = retried or self._retry_begins()
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                    continue
                except Exception as error:
                    # Permanent (the store blamed no single row, e.g. a missing table or
                    # privilege): retrying can't help, so the batch is rejected, once.
                    reason = short_error(error, self._identities(records), show=False)
                    self._reclaim(items, key)
                    for record in records:
                        self._reject(record.identity_id, f"not stored: {reason}")
                    break
                self._reclaim(items, key)
                self._stored += outcome.stored
                if outcome.stored:
                    if len(self.stored_for) > STORED_FOR_LIMIT:
                        self.stored_for.clear()
                    self.stored_for.update(record.identity_id for record in records)
                self._discarded += outcome.discarded
                for index, reason in outcome.refused:
                    self._reject(records[index].identity_id, reason)
                if stopped:
                    # Counted as what the store made of it; the writer still stops.
                    self._settled(items, key)
                    raise asyncio.CancelledError
                break
        finally:
            if retried:
                self._retrying -= 1
        self._settled(items, key)

    def _reclaim(self, items: list[_Item], key: str) -> None:
        """Take back from the dropped a batch counted as dropped while its append still
        ran (close() gave up waiting for it, cancelled meanwhile): its outcome came after
        all, and it counts as what the store made of it, once (it counted as both, and
        the count in flight went below zero)."""
        if key not in self._appending:
            count = len(items)  # (before: see _settled)
            self._dropped -= count

    def _settled(self, items: list[_Item], key: str | None = None) -> None:
        """``items`` are no longer in flight: stored, rejected or discarded (``key``: the
        batch they were, whose append is done; one counted as dropped meanwhile is out of
        flight already)."""
        assert self._progress is not None
        if key is not None and self._appending.pop(key, None) is None:
            self._progress.set()
            return
        self._count_later(items)
        # Computed before the count is read: an emit of another thread adds to it, and a
        # switch of threads at a call between the read and the write lost its addition.
        freed = sum(item[5] for item in items)  # bytes
        self._held_bytes -= freed
        if self._held_bytes < 0:
            self._held_bytes = 0
        self._inflight -= len(items)
        self._progress.set()

    async def _attempt(
        self, records: list[ObservationRecord], key: str, first_attempt: bool
    ) -> tuple[AppendOutcome, bool]:
        """One append of ``records``, and whether the writer was stopped meanwhile.

        Stopped (``close()`` cancels the writer) while the store appends, the append is
        given a moment (``CLOSE_GRACE / 2``) to end: its COMMIT may already be on its way,
        and a batch that the table holds but that was counted as dropped made ``stats()``
        disagree with the table. Ended, it is counted as what it was; not ended, it is
        cancelled, and its batch is counted as dropped by close(), or sent again with its
        key by the next writer after any other cancellation (see :meth:`_write_loop`)."""
        attempt = asyncio.ensure_future(
            self.store.append(records, batch_key=key, first_attempt=first_attempt)
        )
        try:
            outcome, stopped = await to_the_end(attempt, limit=CLOSE_GRACE / 2)
        except asyncio.CancelledError:
            attempt.cancel()  # not ended within the moment (a no-op if it failed)
            raise
        return outcome, stopped is not None

    def _retry_begins(self) -> bool:
        """Count an append that waits to be retried, and tell the writer (see MAX_AHEAD)."""
        assert self._retry_started is not None
        self._retrying += 1
        self._retry_started.set()
        return True

    @staticmethod
    def _identities(records: list[ObservationRecord]) -> tuple[str, ...]:
        return tuple({record.identity_id for record in records})

    async def _validate(self, items: list[_Item]) -> tuple[list[_Item], list[ObservationRecord]]:
        """Sanitise ``items``, letting the event loop run other work every
        :data:`VALIDATE_CHUNK` observations: a batch that piled up while the store was
        slow takes a moment to validate, and requests must not wait for all of it. Returns
        the items that became records, and the records; a rejected item is settled at once
        (counted as rejected, no longer in flight: ``close()`` would count it as dropped
        too, were it stopped before the batch's append ends)."""
        kept: list[_Item] = []
        records: list[ObservationRecord] = []
        # In UTC: the skew added to a local time (a clock in a ZoneInfo zone) is added to
        # the wall clock, which the fall back of daylight saving time stretches by an hour.
        try:
            now = self.clock().astimezone(UTC)
        except Exception as error:  # the host's clock: the batch stays (see _clock_failed)
            now = self._clock_failed(error)
        try:
            latest = now + self.max_clock_skew
        except OverflowError:  # a clock at the end of datetime's range: none is later
            latest = datetime.max.replace(tzinfo=UTC)
        catalog = self.tool_catalog
        clamped = 0
        for index, item in enumerate(items):
            if index and index % VALIDATE_CHUNK == 0:
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    # Back to the front of the queue, in order, for the writer that runs
                    # next (those rejected are settled): taken off it, they were in no
                    # batch that anything could store or count.
                    back = kept + items[index:]
                    self._queue.extendleft(reversed(back))
                    self._inflight -= len(back)
                    raise
            identity_id, kind, content, session_id, created_at, _, emitted, _ = item[:_METADATA]
            try:
                if emitted is None:
                    metadata = dict(zip(item[_METADATA::2], item[_METADATA + 1 :: 2], strict=True))
                    record = sanitize_fields(
                        identity_id, kind, content, metadata, session_id, created_at, catalog
                    )
                else:
                    record = sanitize_observation(identity_id, emitted, created_at, catalog)
                if record.created_at > latest:
                    record = dataclasses.replace(record, created_at=now)
                    clamped += 1
                records.append(record)
                kept.append(item)
                continue
            except ObservationRejected as rejected:
                reason = rejected.reason
            except Exception as error:  # a bug must not lose the rest of the batch
                # By its class only: a host's object raised it, and its message may
                # quote anything the observation held.
                reason = f"unexpected {type(error).__name__}"
            self._validating.pop(item[_SEQUENCE], None)
            self._settled([item])
            self._reject(identity_id, reason)
        self._future_clamped += clamped
        return kept, records

    def _clock_failed(self, error: Exception) -> datetime:
        """The system's UTC time, for a read of the host's clock that raised ``error``
        (logged by its class: the host's message may say anything). An emit dates its
        observation by it, and the writer checks a batch's dates against it: the
        observations are kept, where a clock that raised once lost them (the emit's was
        counted as rejected, the writer's whole batch as dropped)."""
        self._log.warning(
            "clock failed",
            "coda-memory: the clock raised %s; the system clock stood in for it",
            type(error).__name__,
        )
        return datetime.now(UTC)

    def _reject(self, identity_id: str, reason: str) -> None:
        self._rejected += 1
        if not self.log_identities:
            reason = without_identities(reason, (identity_id,))
        self._log.warning(
            "rejected",
            "coda-memory: observation for %s rejected: %s",
            self._label(identity_id),
            reason,
        )

    @property
    def _processed(self) -> int:
        return self._stored + self._rejected + self._dropped + self._discarded

    async def _written(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait until everything emitted so far is stored (or rejected or dropped): the
        writer is started for it unless it runs (never started, or cancelled meanwhile
        by a host's shutdown), and unless close() stopped it, which counted what it held
        (and counts what another thread queued since, :meth:`_lost_after_close`).

        Which emits, not how many: the wait's mark is the sequence of the last emit
        before it, and it ends once every emit up to the mark is processed, told by the
        processed count less what came after the mark (:attr:`_Wait.later`, counted by
        each item's sequence as it is processed, and by each emit refused as it came).
        By counts alone, an append of later items that ended before the one of earlier
        items (two are in flight under a backlog) ended the wait with those still
        unstored, as did emits refused during the wait (a closing service drops every
        emit, a full queue the overflow): close() then dropped what was queued before
        without waiting out its timeout. An emit that began before the wait (another
        thread's, under way) is waited for, stored or refused, as it is in the mark."""
        wait = _Wait()
        self._waits = (*self._waits, wait)  # listed before its mark is read (see _Wait)
        try:
            wait.mark = self._emitted
            self._events()
            assert self._progress is not None and self._wakeup is not None
            while self._processed - wait.later < wait.mark:
                self._progress.clear()
                self._lost_after_close()
                if self._processed - wait.later >= wait.mark:
                    break
                self._ensure_writer(loop)
                self._wakeup.set()
                await self._progress.wait()
        finally:
            self._waits = tuple(other for other in self._waits if other is not wait)

    def _forget_queued(self, identity_id: str) -> int:
        """Drop (and count) the identity's observations still in the queue; how many.

        The queue is filtered in place, each item taken off its front and put back at
        its end unless it is the identity's: another thread may append meanwhile (a
        deque's append and popleft are atomic), and an item it appends is never lost, as
        it was to a copy of the queue put in its place. Identities are compared as plain
        strings: a host's object queued as one (the writer rejects it) may have an ``==``
        that raises, which lost the item just taken off the queue."""
        queue = self._queue
        dropped: list[_Item] = []
        for _ in range(len(queue)):
            item = queue.popleft()
            queued = item[0]
            if isinstance(queued, str) and str.__eq__(queued, identity_id) is True:
                dropped.append(item)
            else:
                queue.append(item)
        if dropped:
            self._count_later(dropped)
            # (Computed before the counts are read: see _settled.)
            freed, count = sum(item[5] for item in dropped), len(dropped)
            self._held_bytes -= freed
            self._dropped += count  # asked for (forget): counted, with no warning
            self._wake_waiters()
        return len(dropped)

    async def _stop_writer(self, grace: float) -> None:
        """Stop the writer for good (waiting at most ``grace`` seconds, what is left of
        close()'s CLOSE_GRACE); drop and count what it held, also when this is cancelled
        meanwhile (the loop shutting down under a close() left to go on in the
        background)."""
        self._stopped = True
        writer = self._writer
        try:
            if writer is not None and not writer.done():
                writer.cancel()
                await asyncio.wait([writer], timeout=grace)
        finally:
            self._writer = None
            self._drop_held("service closed before they were stored", queued=True)
