"""MemoryService: the composition root a host application talks to.

* ``emit_observation`` is fire-and-forget: it stamps the observation and appends it to a
  bounded queue, nothing more, on the caller's thread. A background writer validates,
  sanitises and stores observations in batches. When the queue is full (the store is
  down or slow) further observations are dropped, logged and counted.
* ``load_memory`` consolidates under ``load_timeout`` and never raises. A consolidation
  that outlives the timeout finishes in the background (it is not cancelled half-way);
  ``drain`` and ``close`` wait for it.
* Every "now" comes from ``clock``. An observation dated more than ``max_clock_skew``
  after the clock when the writer validates it is stored as made at that instant, and
  counted in ``stats().future_clamped``: a wrong or hostile date cannot keep a fact alive.

Keeping the loop responsive. Everything ``load_memory`` does in Python is proportional
to the identity's facts, which ``max_facts`` caps (best ranked kept, the rest deleted by
the next consolidation). Above :data:`OFFLOAD_FACTS` facts the planning, the views and
the prompt section are computed in a worker thread, so the loop keeps serving other
requests and ``load_timeout`` can fire. At most ``max_consolidations`` consolidations
(and peeks) talk to the store at once; the others wait in the loop, not on a
connection pool, newest first (see :mod:`coda_memory.slots`), and an identity has at
most one in flight (single flight).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection
from datetime import UTC, datetime, timedelta
from typing import Any, ParamSpec, TypeVar

from pydantic import BaseModel, ConfigDict

from coda_memory.core import emitters
from coda_memory.core.affinity import extract_tool_affinities
from coda_memory.core.caps import DEFAULT_MAX_FACTS, CapCounter, LogThrottle
from coda_memory.core.consolidation import (
    DEFAULT_RETENTION,
    ConsolidationInput,
    ConsolidationPlan,
    active_views,
    keep_by_rank,
    plan_consolidation,
)
from coda_memory.core.decay import DecayStrategy, ExponentialDecay
from coda_memory.core.logs import identity_label, short_error
from coda_memory.core.model import Fact, FactEvent, LoadedMemory, NewObservation
from coda_memory.core.prompt import format_memory_section
from coda_memory.core.sanitize import ObservationRejected, sanitize_observation
from coda_memory.errors import ConnectionLost
from coda_memory.ports import MemoryStore, ObservationRecord
from coda_memory.slots import LifoSlots
from coda_memory.telemetry import NoTelemetry, Telemetry, telemetry_for

logger = logging.getLogger("coda_memory")

Clock = Callable[[], datetime]
P = ParamSpec("P")
R = TypeVar("R")

#: Above this many facts, Python work of a load runs in a worker thread (see above).
OFFLOAD_FACTS = 300
#: Consolidations (and peeks) in flight at once, unless the store says otherwise.
DEFAULT_MAX_CONSOLIDATIONS = 8


#: The default bound on the bytes of queued observations (see ``queue_bytes``).
DEFAULT_QUEUE_BYTES = 64 * 1024 * 1024
#: What an observation costs beyond its text: the tuple, the model, the timestamps.
_ITEM_OVERHEAD = 512
#: Seconds ``close`` waits for the writer to stop, and for the store to close, after its
#: ``timeout``: a connection that never answers can't hold it up longer.
CLOSE_GRACE = 2.0


def _approximate_bytes(obs: NewObservation) -> int:
    """What a queued observation holds in memory, about: its text and its metadata's."""
    return _ITEM_OVERHEAD + sys.getsizeof(obs.content) + _nested_bytes(obs.metadata, 0)


def _nested_bytes(value: object, depth: int) -> int:
    if isinstance(value, str | bytes):
        return sys.getsizeof(value)
    if depth > 16:  # far deeper than validation accepts: count it as big
        return 1 << 20
    if isinstance(value, dict):
        return 64 + sum(
            _nested_bytes(k, depth + 1) + _nested_bytes(v, depth + 1) for k, v in value.items()
        )
    if isinstance(value, list | tuple | set | frozenset):
        return 64 + sum(_nested_bytes(v, depth + 1) for v in value)
    return 32


async def _offload(size: int, work: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``work(*args)``, in a worker thread when ``size`` (facts) is above OFFLOAD_FACTS."""
    if size > OFFLOAD_FACTS:
        return await asyncio.to_thread(work, *args, **kwargs)
    return work(*args, **kwargs)


def system_clock() -> datetime:
    """The default clock: the system's UTC time."""
    return datetime.now(UTC)


class MemoryStats(BaseModel):
    """Counters of a service since it started."""

    model_config = ConfigDict(frozen=True)

    #: Observations passed to ``emit_observation``.
    emitted: int
    #: Observations the store accepted.
    stored: int
    #: Observations refused as bad input (by validation or by the store), with a log line.
    rejected: int
    #: Observations dropped because the queue was full or the service was closed.
    dropped: int
    #: Observations emitted but not yet stored, rejected, dropped or discarded.
    pending: int
    #: ``load_memory`` calls, and how many of them returned empty on timeout or error.
    loads: int = 0
    load_timeouts: int = 0
    load_errors: int = 0
    #: Observations the store accepted and threw away by design (``null://``).
    discarded: int = 0
    #: Observations (also counted as stored or rejected) dated more than
    #: ``max_clock_skew`` after the service clock, stored as made at the clock's now.
    future_clamped: int = 0
    #: Loads that outlived the timeout and answered with the facts of the identity's
    #: last consolidation (not empty, and not counted in ``load_timeouts``).
    load_stale: int = 0
    #: Consolidations where the ``max_facts`` cap applied, and the facts it deleted.
    facts_capped: int = 0
    facts_evicted: int = 0
    #: Tool results (in this process) whose entities were cut to ``max_entities``.
    entity_results_capped: int = 0


#: (identity id, observation, created_at, approximate bytes)
_Item = tuple[str, NewObservation, datetime, int]

#: How far past the service clock an observation's ``created_at`` may be.
DEFAULT_MAX_CLOCK_SKEW = timedelta(minutes=5)


class MemoryService:
    """Memory for one agent server process, over one store."""

    def __init__(
        self,
        store: MemoryStore,
        *,
        decay: DecayStrategy | None = None,
        load_timeout: float = 0.1,
        clock: Clock | None = None,
        retention: timedelta = DEFAULT_RETENTION,
        queue_size: int = 100_000,
        batch_size: int = 5_000,
        prompt_budget_tokens: int = 300,
        max_clock_skew: timedelta = DEFAULT_MAX_CLOCK_SKEW,
        tool_catalog: Collection[str] | None = None,
        token_counter: Callable[[str], int] | None = None,
        telemetry: bool | Telemetry | NoTelemetry = False,
        max_facts: int | None = DEFAULT_MAX_FACTS,
        max_consolidations: int | None = None,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        log_identities: bool = False,
    ) -> None:
        if load_timeout <= 0:
            raise ValueError("load_timeout must be positive")
        if max_clock_skew < timedelta(0):
            raise ValueError("max_clock_skew must not be negative")
        if queue_size < 1 or batch_size < 1 or queue_bytes < 1:
            raise ValueError("queue_size, queue_bytes and batch_size must be at least 1")
        if max_facts is not None and max_facts < 1:
            raise ValueError("max_facts must be at least 1 (or None: no cap)")
        if max_consolidations is None:
            max_consolidations = getattr(store, "request_slots", DEFAULT_MAX_CONSOLIDATIONS)
        if max_consolidations < 1:
            raise ValueError("max_consolidations must be at least 1")
        self.store = store
        self.decay: DecayStrategy = decay if decay is not None else ExponentialDecay()
        self.load_timeout = load_timeout
        self.clock: Clock = clock if clock is not None else system_clock
        self.retention = retention
        self.prompt_budget_tokens = prompt_budget_tokens
        self.max_clock_skew = max_clock_skew
        #: When set, only tool observations naming one of these tools are stored.
        self.tool_catalog = None if tool_catalog is None else frozenset(tool_catalog)
        #: Exact token counting for the prompt section (default: a conservative estimate).
        self.token_counter = token_counter
        self.max_facts = max_facts
        self._slots = LifoSlots(max_consolidations)
        self._log = LogThrottle(logger)
        self._facts_cap = CapCounter(self._log, "facts per identity capped")
        self._queue_size = queue_size
        self._queue_bytes = queue_bytes
        #: Bytes of the observations queued or in the writer's hands (about).
        self._held_bytes = 0
        self._batch_size = batch_size
        self.log_identities = log_identities
        self._queue: deque[_Item] = deque()
        self._inflight = 0
        self._emitted = self._stored = self._rejected = self._dropped = self._discarded = 0
        self._loads = self._load_timeouts = self._load_errors = self._future_clamped = 0
        self._closed = False
        # OpenTelemetry spans and metrics (coda_memory.telemetry); off by default.
        self._telemetry = telemetry_for(telemetry)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._writer: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._progress: asyncio.Event | None = None
        self._background: set[asyncio.Task[LoadedMemory]] = set()
        self._loading: dict[str, asyncio.Task[LoadedMemory]] = {}
        #: Facts as of the last consolidation, for the identities being consolidated.
        self._stale: dict[str, list[Fact]] = {}
        self._load_stale = 0
        self._telemetry.observe(self.stats)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        decay: DecayStrategy | None = None,
        load_timeout: float = 0.1,
        clock: Clock | None = None,
        **options: Any,
    ) -> MemoryService:
        """A service over the store that ``url`` names: ``memory://``, a Postgres URL
        (``postgresql://``, ``postgresql+asyncpg://``), a Redis URL (``redis://host:port/db``,
        ``rediss://…``; needs the ``redis`` extra) or ``null://`` (memory switched off).
        Extra keyword options go to the service (``retention``, ``queue_size``,
        ``batch_size``, ``prompt_budget_tokens``, ``max_clock_skew``, ``tool_catalog``,
        ``token_counter``, ``telemetry``, ``max_facts``, ``max_consolidations``) or to the store
        (Postgres: ``schema``, ``pool_size``, ``lock_timeout``, …; Redis: ``prefix``,
        ``lock_timeout``, ``history_limit``, …)."""
        service_keys = {
            "retention",
            "queue_size",
            "queue_bytes",
            "log_identities",
            "batch_size",
            "prompt_budget_tokens",
            "max_clock_skew",
            "tool_catalog",
            "token_counter",
            "telemetry",
            "max_facts",
            "max_consolidations",
        }
        service_options = {k: v for k, v in options.items() if k in service_keys}
        store_options = {k: v for k, v in options.items() if k not in service_keys}
        scheme = url.split(":", 1)[0].split("+", 1)[0].lower()
        store: MemoryStore
        if scheme in ("memory", "null"):
            if store_options:
                raise TypeError(f"unexpected options for {scheme}://: {sorted(store_options)}")
            if scheme == "null":
                from coda_memory.null import NullStore

                store = NullStore()
            else:
                from coda_memory.testing import InMemoryStore

                store = InMemoryStore()
        elif scheme in ("postgresql", "postgres"):
            from coda_memory.postgres import PostgresStore

            store = PostgresStore.from_url(url, **store_options)
        elif scheme in ("redis", "rediss"):
            try:
                from coda_memory.redis import RedisStore
            except ImportError as exc:
                raise ImportError(
                    "redis:// needs the redis extra: pip install 'coda-memory[redis]'"
                ) from exc
            store = RedisStore.from_url(url, **store_options)
        else:
            raise ValueError(
                "unsupported memory URL scheme: use memory://, postgresql://…, redis://… "
                f"or null:// (got {url.split(':', 1)[0]!r})"
            )
        return cls(store, decay=decay, load_timeout=load_timeout, clock=clock, **service_options)

    # -- writes -------------------------------------------------------------------------

    def emit_observation(self, identity_id: str, obs: NewObservation) -> None:
        """Queue an observation for storage. Never raises and never waits on I/O."""
        try:
            self._emitted += 1
            size = _approximate_bytes(obs)
            if (
                self._closed
                or len(self._queue) >= self._queue_size
                or self._held_bytes + size > self._queue_bytes
            ):
                self._drop(1, "service closed" if self._closed else "queue full")
                return
            created_at = obs.created_at if obs.created_at is not None else self.clock()
            self._queue.append((identity_id, obs, created_at, size))
            self._held_bytes += size
            self._wake()
        except Exception as error:  # the fire-and-forget boundary: log, count, carry on
            self._rejected += 1
            self._log.warning(
                "not queued",
                "coda-memory: observation for %s not queued: %s",
                self._label(identity_id),
                short_error(error),
            )

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
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if (
            loop is not None
            and self._loop is not None
            and self._loop is not loop
            and (self._loop.is_closed() or not self._loop.is_running())
        ):
            # Emitted from a later event loop than the service's, which is gone: say so
            # (rate-limited), never raise to the caller. drain() and close() raise.
            self._log.warning(
                "wrong loop",
                "coda-memory: emit_observation from an event loop the service does not "
                "run on; its writer can't store it (create one service per event loop)",
            )
            return
        if loop is not None and (self._loop is None or self._loop is loop):
            self._ensure_writer(loop)
            assert self._wakeup is not None
            self._wakeup.set()
        elif self._loop is not None and self._loop_thread != threading.get_ident():
            wakeup = self._wakeup
            if wakeup is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(wakeup.set)
        # Otherwise no loop runs yet: the items wait until the writer starts.

    def _ensure_writer(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._writer is not None and not self._writer.done():
            return
        self._loop, self._loop_thread = loop, threading.get_ident()
        if self._wakeup is None:
            self._wakeup, self._progress = asyncio.Event(), asyncio.Event()
        self._writer = loop.create_task(self._write_loop(), name="coda-memory-writer")

    async def _write_loop(self) -> None:
        assert self._wakeup is not None and self._progress is not None
        backoff = 0.05
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            items = [self._queue.popleft() for _ in range(min(self._batch_size, len(self._queue)))]
            self._inflight = len(items)
            records = self._validate(items)
            # One key per batch, kept across retries: a retry after a lost COMMIT
            # acknowledgement stores nothing twice (the store records the key).
            key = str(uuid.uuid4())
            while records:
                try:
                    with self._telemetry.span("append", **{"coda_memory.batch": len(records)}):
                        outcome = await self.store.append(records, batch_key=key)
                except (ConnectionLost, OSError) as error:
                    # Only a lost connection is worth retrying: the same batch, same key.
                    self._log.warning(
                        "store unavailable",
                        "coda-memory: storing %d observation(s) failed (%s); retrying in %.2fs",
                        len(records),
                        short_error(error, self._identities(records), show=self.log_identities),
                        backoff,
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                    continue
                except Exception as error:
                    # Permanent (the store blamed no single row, e.g. a missing table or
                    # privilege): retrying can't help, so the batch is rejected, once.
                    reason = short_error(error, self._identities(records), show=False)
                    for record in records:
                        self._reject(record.identity_id, f"not stored: {reason}")
                    break
                backoff = 0.05
                self._stored += outcome.stored
                self._discarded += outcome.discarded
                for index, reason in outcome.refused:
                    self._reject(records[index].identity_id, reason)
                break
            self._held_bytes = max(0, self._held_bytes - sum(item[3] for item in items))
            self._inflight = 0
            self._progress.set()

    @staticmethod
    def _identities(records: list[ObservationRecord]) -> tuple[str, ...]:
        return tuple({record.identity_id for record in records})

    def _validate(self, items: list[_Item]) -> list[ObservationRecord]:
        records: list[ObservationRecord] = []
        now = self.clock()
        latest = now + self.max_clock_skew
        for identity_id, obs, created_at, _ in items:
            try:
                record = sanitize_observation(identity_id, obs, created_at, self.tool_catalog)
                if record.created_at > latest:
                    record = dataclasses.replace(record, created_at=now)
                    self._future_clamped += 1
                records.append(record)
            except ObservationRejected as rejected:
                self._reject(identity_id, rejected.reason)
            except Exception as error:  # a bug must not lose the rest of the batch
                self._reject(identity_id, f"unexpected {type(error).__name__}: {error}")
        return records

    def _reject(self, identity_id: str, reason: str) -> None:
        self._rejected += 1
        if not self.log_identities and isinstance(identity_id, str) and identity_id:
            reason = reason.replace(identity_id, identity_label(identity_id))
        self._log.warning(
            "rejected",
            "coda-memory: observation for %s rejected: %s",
            self._label(identity_id),
            reason,
        )

    @property
    def _processed(self) -> int:
        return self._stored + self._rejected + self._dropped + self._discarded

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until everything emitted so far is stored (or rejected or dropped), and
        every background consolidation has finished. With ``timeout``, raise
        ``TimeoutError`` after that many seconds."""
        loop = self._check_loop()
        async with asyncio.timeout(timeout):
            target = self._emitted
            if self._queue or self._inflight:
                self._ensure_writer(loop)
                assert self._wakeup is not None
                self._wakeup.set()
            while self._processed < target:
                assert self._progress is not None
                self._progress.clear()
                if self._processed >= target:
                    break
                await self._progress.wait()
            while self._background:
                await asyncio.gather(*list(self._background), return_exceptions=True)

    # -- consolidation ------------------------------------------------------------------

    async def start(self) -> None:
        """Open the store's connections, prepare its statements and start the writer, so
        that the first requests don't pay for it. Optional: without it, everything starts
        on first use."""
        self._ensure_writer(asyncio.get_running_loop())
        start = getattr(self.store, "start", None)
        if start is not None:
            await start()

    async def consolidate(self, identity_id: str) -> list[Fact]:
        """Consolidate the identity's new observations now (no timeout) and return its
        active facts; raises on storage errors."""
        loop = self._check_loop()
        if self._loop is None:  # the store's connections will belong to this loop
            self._loop, self._loop_thread = loop, threading.get_ident()
        # Most requests find nothing new: answer those from one read, without the lock.
        with self._telemetry.span("consolidate") as span:
            facts = await self._consolidate(identity_id)
            if span is not None:
                span.set_attribute("coda_memory.facts", len(facts))
            return facts

    async def _consolidate(self, identity_id: str) -> list[Fact]:
        async with self._slots:
            stored, pending = await self.store.peek(identity_id)
        if pending and stored and identity_id in self._loading:
            # What a load that outlives its timeout answers with (see load_memory).
            self._stale[identity_id] = stored
        if not pending and (self.max_facts is None or len(stored) <= self.max_facts):
            views = await _offload(len(stored), active_views, stored, self.decay, self.clock())
            if len(views) == len(stored):  # else some expired: the consolidation deletes them
                return views
        async with self._slots, self.store.consolidation(identity_id) as unit:
            batch = await unit.load()
            plan = await _offload(len(batch.facts), self._plan, identity_id, batch)
            if plan.writes_anything:
                await unit.write(plan)
                await unit.commit()
        if plan.evicted:
            self._facts_cap.hit(
                len(plan.evicted),
                f"{self._label(identity_id)} keeps its {len(plan.active)} best ranked facts, "
                f"{len(plan.evicted)} deleted",
            )
        return plan.active

    def _plan(self, identity_id: str, batch: ConsolidationInput) -> ConsolidationPlan:
        return plan_consolidation(
            identity_id, batch, self.clock(), self.decay, self.retention, self.max_facts
        )

    async def facts(self, identity_id: str) -> list[Fact]:
        """The identity's active facts at the clock's now, without consolidating."""
        return active_views(await self.store.facts(identity_id), self.decay, self.clock())

    async def history(self, identity_id: str, subject: str | None = None) -> list[FactEvent]:
        """Every create, reinforce, extend and expire of the identity's facts, in order."""
        return await self.store.history(identity_id, subject)

    async def load_memory(self, identity_id: str) -> LoadedMemory:
        """Consolidate, then format the prompt section and tool affinities, all within
        ``load_timeout``; never raises.

        When the consolidation outlives the timeout (it then finishes in the background),
        the answer is built from the facts as of the last consolidation, read before it
        started (``stats().load_stale``): only the newest observations are missing.
        Without those, and on any error, the result is empty."""
        self._loads += 1
        started = time.perf_counter()
        with self._telemetry.span("load_memory") as span:
            loaded, outcome = await self._answer(identity_id)
            if span is not None:
                span.set_attribute("coda_memory.outcome", outcome)
                span.set_attribute("coda_memory.facts", len(loaded.facts))
        self._telemetry.load_finished(time.perf_counter() - started, outcome)
        return loaded

    async def _answer(self, identity_id: str) -> tuple[LoadedMemory, str]:
        try:
            task = self._loading.get(identity_id)
            if task is None or task.done():
                task = asyncio.get_running_loop().create_task(self._load(identity_id))
                self._loading[identity_id] = task
                self._background.add(task)
                task.add_done_callback(lambda t: self._finished(identity_id, t))
            return await asyncio.wait_for(asyncio.shield(task), self.load_timeout), "ok"
        except TimeoutError:
            stale = self._stale.get(identity_id)
            if stale is not None:
                self._load_stale += 1
                self._log.warning(
                    "load stale",
                    "coda-memory: consolidating %s took over %.0f ms; answering with the "
                    "facts of its last consolidation",
                    self._label(identity_id),
                    self.load_timeout * 1000,
                )
                return await self._loaded_as_of_last_consolidation(stale), "stale"
            self._load_timeouts += 1
            self._log.warning(
                "load timeout",
                "coda-memory: load_memory for %s timed out after %.0f ms; returning empty",
                self._label(identity_id),
                self.load_timeout * 1000,
            )
            return LoadedMemory.empty(), "timeout"
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self._load_errors += 1
            self._log.warning(
                f"load failed: {type(error).__name__}",
                "coda-memory: load_memory for %s failed (%s); returning empty",
                self._label(identity_id),
                short_error(error, (identity_id,), show=self.log_identities),
            )
        return LoadedMemory.empty(), "error"

    async def _load(self, identity_id: str) -> LoadedMemory:
        """One consolidation and its prompt section, shared by concurrent loads."""
        facts = await self.consolidate(identity_id)
        return await _offload(len(facts), self._loaded, facts)

    async def _loaded_as_of_last_consolidation(self, stored: list[Fact]) -> LoadedMemory:
        def build() -> LoadedMemory:
            views = active_views(stored, self.decay, self.clock())
            return self._loaded(keep_by_rank(views, self.max_facts)[0])

        return await _offload(len(stored), build)

    def _loaded(self, facts: list[Fact]) -> LoadedMemory:
        return LoadedMemory(
            facts=facts,
            prompt_section=format_memory_section(
                facts, self.prompt_budget_tokens, token_counter=self.token_counter
            ),
            tool_affinities=extract_tool_affinities(facts),
        )

    def _finished(self, identity_id: str, task: asyncio.Task[LoadedMemory]) -> None:
        self._background.discard(task)
        if self._loading.get(identity_id) is task:
            del self._loading[identity_id]
            self._stale.pop(identity_id, None)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            # The same cause as a load that failed with it: one outage, one line a second.
            self._log.warning(
                f"load failed: {type(error).__name__}",
                "coda-memory: background consolidation of %s failed (%s)",
                self._label(identity_id),
                short_error(error, (identity_id,), show=self.log_identities),
            )

    # -- administration -----------------------------------------------------------------

    async def forget(self, identity_id: str) -> None:
        """Delete every observation, fact, fact event and checkpoint of the identity,
        including observations of it still queued in this service."""
        kept = deque(item for item in self._queue if item[0] != identity_id)
        if len(kept) != len(self._queue):
            self._held_bytes -= sum(item[3] for item in self._queue if item[0] == identity_id)
            self._drop(len(self._queue) - len(kept), "identity forgotten")
            self._queue = kept
        await self.drain()
        await self.store.forget(identity_id)

    def stats(self) -> MemoryStats:
        """Counts of observations emitted, stored, rejected, dropped and pending."""
        return MemoryStats(
            emitted=self._emitted,
            stored=self._stored,
            rejected=self._rejected,
            dropped=self._dropped,
            pending=self._emitted - self._processed,
            loads=self._loads,
            load_timeouts=self._load_timeouts,
            load_errors=self._load_errors,
            discarded=self._discarded,
            future_clamped=self._future_clamped,
            load_stale=self._load_stale,
            facts_capped=self._facts_cap.applied,
            facts_evicted=self._facts_cap.dropped,
            entity_results_capped=emitters.ENTITY_CAP.applied,
        )

    async def close(self, timeout: float | None = 30.0) -> None:
        """Drain (up to ``timeout`` seconds), stop the writer and release the store.
        Observations that could not be stored by then are dropped and counted."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.drain(timeout)
        except TimeoutError:
            logger.warning("coda-memory: close timed out with %d pending", self.stats().pending)
        finally:
            # Each wait below is bounded: a connection that never answers (its command
            # timeout not reached yet) can't hold close() up beyond its timeout.
            if self._writer is not None:
                self._writer.cancel()
                await asyncio.wait([self._writer], timeout=CLOSE_GRACE)
                self._writer = None
            leftover = len(self._queue) + self._inflight
            if leftover:
                self._queue.clear()
                self._inflight = 0
                self._held_bytes = 0
                self._drop(leftover, "service closed before they were stored")
            for task in list(self._background):
                task.cancel()
            if self._background:
                await asyncio.wait(list(self._background), timeout=CLOSE_GRACE)
            try:
                await asyncio.wait_for(self.store.close(), CLOSE_GRACE)
            except TimeoutError:
                logger.warning("coda-memory: the store did not close within %.0f s", CLOSE_GRACE)

    async def __aenter__(self) -> MemoryService:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
