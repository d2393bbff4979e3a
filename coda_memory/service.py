"""MemoryService: the composition root a host application talks to.

The queue and background writer live in :mod:`coda_memory.writer` (the service's base
class), the counters in :mod:`coda_memory.stats`, the choice of store for a URL in
:mod:`coda_memory.stores`; here are consolidation, ``load_memory`` and the lifecycle.

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
* A service belongs to the event loop of its first call. One that its host never closes
  closes itself as that loop shuts down (``MemoryService._watch_loop_end``), storing
  what is queued, and says so with one ResourceWarning; calls from a later loop then
  raise :class:`~coda_memory.errors.ServiceClosed` naming the cause.

Peeking. A load first reads, without a lock, whether anything new waits (``peek``), and
answers from that read when nothing does. It skips the peek when this service stored
observations of the identity since it last consolidated it there and the store keeps the
identity's facts (``keeps_facts``): then something new waits for sure.

Keeping the loop responsive. Everything ``load_memory`` does in Python is proportional
to the identity's facts, which ``max_facts`` caps (best ranked kept, the rest deleted by
the next consolidation, or by the store, see :class:`~coda_memory.core.caps.FactCap`).
Up to :data:`OFFLOAD_FACTS` facts, twice the default cap, the planning, the views and the
prompt section run on the loop in steps of at most :data:`~coda_memory.core.turns.SLICE`
facts (a few tenths of a millisecond), with a turn of the loop between two
(:func:`~coda_memory.core.turns.stepped`).
Above it they run in a worker thread, so the loop keeps serving other requests and
``load_timeout`` can fire; but under the GIL the loop then waits up to a switch interval
(5 ms) each time it wakes up, so a thread costs every other request more than a short
step on the loop does.

One load at a time runs its steps (:data:`STEPPING_AT_ONCE`), and converts rows into
models (the store's :func:`~coda_memory.core.turns.mapped`, which takes the same turns);
the others' steps wait their turn, first come first served, while their round trips to
the store go on. Each
turn of the loop then runs the next step of one load, not of every load in flight, so a
timer or a new request waits for one step; and a load's steps, once it has its turn,
are not drawn out by every other load's, so loads end in the order their Python began
rather than all late together. In an in-process A/B of the host-shaped run (8 requests
in flight, six interleaved windows of 800 requests each way), the 1 ms ticker's lag p99
went from 8.2 to 5.4 ms and its max from 13.8 to 10.1 ms (medians), at the same CPU per
request (4.95 and 4.97 ms) and throughput; load_memory's p99 was 60.6 against 64.9 ms,
within the windows' spread (51.7 to 78.0 ms). Two loads at once gave a lag p99 of 8.0
against 9.0 ms in another such A/B. The store's conversions taking the same turns
lowered the lag p99 again, from 4.96 to 3.40 ms, and its max from 11.3 to 7.6 ms, at the
same CPU (six windows each way). The answer from the facts at hand (after
:data:`HEDGE_AT` of the timeout) does not wait for the turn: it is what keeps a load
within its timeout. A consolidation waits for its turn inside its transaction (the
identity's checkpoint row locked, a connection held), for the steps of the loads ahead
of it: a few milliseconds under 8 loads in flight. At most ``max_consolidations`` consolidations
(and peeks) talk to the store at once; the others wait in the loop, not on a
connection pool, newest first (see :mod:`coda_memory.slots`), and an identity has at
most one in flight (single flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import itertools
import logging
import threading
import time
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, cast

from coda_memory.core import emitters
from coda_memory.core.affinity import extract_tool_affinities, outside_catalog
from coda_memory.core.answers import RecentAnswers, own_copy
from coda_memory.core.caps import (
    DEFAULT_MAX_FACTS,
    MAX_FACTS,
    CapCounter,
    FactCap,
    LogThrottle,
    flush_held,
)
from coda_memory.core.consolidation import (
    DEFAULT_RETENTION,
    ConsolidationInput,
    ConsolidationPlan,
    planning,
    viewing,
)
from coda_memory.core.decay import DecayStrategy, ExponentialDecay, decay_formula
from coda_memory.core.logs import short_error
from coda_memory.core.model import DEFAULT_MAX_CLOCK_SKEW as DEFAULT_MAX_CLOCK_SKEW
from coda_memory.core.model import MAX_SPAN, Fact, FactEvent, LoadedMemory
from coda_memory.core.options import (
    NONE,
    require_callables,
    require_flags,
    require_types,
    seconds_or_none,
)
from coda_memory.core.prompt import section_steps
from coda_memory.core.rank import ranked_facts
from coda_memory.core.sanitize import ObservationRejected, check_identity, has_nul_or_surrogate
from coda_memory.core.turns import (
    Steps,
    collector_scope,
    finished,
    released,
    stepped,
    taking_turns,
)
from coda_memory.errors import HostCallbackError, ServiceClosed, StoreBusy
from coda_memory.ports import HELD_OUT, Forgotten, MemoryStore
from coda_memory.slots import LifoSlots
from coda_memory.stats import MemoryStats as MemoryStats
from coda_memory.stores import store_from_url
from coda_memory.telemetry import NoTelemetry, Telemetry, telemetry_for
from coda_memory.writer import CLOSE_GRACE, DEFAULT_QUEUE_BYTES, Clock, ObservationWriter

logger = logging.getLogger("coda_memory")

#: The identities whose facts the store capped on the server during the peek of the
#: consolidation under way in this context, with how many facts it deleted (see
#: ``MemoryService._consolidate``).
_CAPPED_BY_STORE: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar(
    "coda_memory_capped_by_store", default=None
)
#: Set by :meth:`MemoryService.consolidate`: the consolidations of this context that
#: answered from the peek alone (nothing waited, or a held table kept the peek out), one
#: True each (see ``_peek_then_consolidate``).
_FROM_PEEK: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "coda_memory_from_peek", default=None
)

R = TypeVar("R")

#: Above this many facts, Python work of a load runs in a worker thread (see above).
OFFLOAD_FACTS = 2 * DEFAULT_MAX_FACTS
#: Loads whose steps run on the loop at once (see above).
STEPPING_AT_ONCE = 1
#: The share of ``load_timeout`` after which a load still waiting for its consolidation
#: starts making its fallback answer from the facts at hand, so that the answer is ready
#: when the timeout fires rather than made after it (see ``load_memory``). Every such
#: answer that the consolidation then beats is wasted work, and on a loaded loop many are:
#: in host-shaped runs on a slow machine, from half the timeout on 153 to 323 were made
#: per 1,600 requests and at 70 % 17 to 26, with the same throughput and no empty load.
HEDGE_AT = 0.7
#: The share of ``load_timeout`` at which a load still waiting for its consolidation stops
#: waiting and answers from the facts at hand: the rest of the timeout is left for that
#: answer to reach the caller through a busy event loop (a timer fires as late as the
#: loop is busy), so that load_memory returns within load_timeout.
ANSWER_BY = 0.95
#: The share of ``load_timeout`` past which a load in flight keeps the garbage collector's
#: collections from starting (``_may_collect``).
COLLECTION_BEFORE = 1 / 3
#: Consolidations (and peeks) in flight at once, unless the store says otherwise.
DEFAULT_MAX_CONSOLIDATIONS = 8
#: How long a service that its host never closed takes, as its event loop ends, to store
#: what is queued before it releases the store (see ``MemoryService._watch_loop_end``), and
#: then at most for the connections still being opened to end once cancelled: the host did
#: not ask for the wait, and its shutdown waits for it.
CLOSE_AT_LOOP_END = 5.0
#: How long ``forget`` waits for the observations this service is storing (some may be
#: the identity's) before it erases what is stored: past it (the store unreachable, the
#: table held), it raises TimeoutError and erases nothing stored.
FORGET_WAIT = 10.0


async def _within(task: asyncio.Task[R], seconds: float) -> R:
    """``task``'s outcome, waited for at most ``seconds`` (TimeoutError), the task itself
    shielded from the wait's end. A cancellation of the caller always propagates (Python
    3.11's ``wait_for`` returned the result instead when the task finished in the same
    turn of the loop). When the task was cancelled but the caller was not (``close`` ends
    the loads in flight), LoadCancelled: the load fails, the caller's request does not."""
    try:
        async with asyncio.timeout(seconds):
            return await asyncio.shield(task)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if task.cancelled() and current is not None and not current.cancelling():
            raise LoadCancelled("the load was cancelled: the service is closing") from None
        raise


class LoadCancelled(Exception):
    """A load in flight was cancelled under its callers (by ``close``)."""


class _FailedAfterPeek(Exception):
    """A load's consolidation failed (``error``) once its peek had read the identity's
    facts (``facts``), which the loads that waited for it answer from: they are gone
    from the service's table of them when these loads wake up (see ``MemoryService._load``)."""

    def __init__(self, error: Exception, facts: list[Fact]) -> None:
        super().__init__()
        self.error = error
        self.facts = facts


def _failure(error: BaseException) -> tuple[BaseException, list[Fact] | None]:
    """A load's error as it happened, with the facts its peek read (None: none)."""
    if isinstance(error, _FailedAfterPeek):
        return error.error, error.facts
    return error, None


def _host_counter(counter: Callable[[str], int]) -> Callable[[str], int]:
    """The host's ``token_counter``, whose errors are a :class:`HostCallbackError` that
    names their class only: it is given the prompt section's text, which the error's
    message may quote, and the load's log line reports the error. So is a count that is
    not a number from 0 up: a NaN or a negative one passed every comparison with the
    budget, and the section held every fact."""

    def count(text: str) -> int:
        try:
            tokens = counter(text)
        except Exception as error:
            raise HostCallbackError(f"token_counter raised {type(error).__name__}") from None
        try:
            counted = bool(tokens >= 0)  # NaN fails too
        except Exception:
            counted = False
        if not counted:
            raise HostCallbackError(
                f"token_counter returned {type(tokens).__name__}, not a count of tokens "
                "(a number from 0 up)"
            )
        return tokens

    return count


def _identity_argument(identity_id: object) -> str:
    """``identity_id`` of a call other than ``load_memory`` (which never raises) as the
    store takes it (see :func:`~coda_memory.core.sanitize.check_identity`): TypeError or
    ValueError saying what is wrong, without the identity (it may be personal data)."""
    if not isinstance(identity_id, str):
        raise TypeError(f"identity_id must be a str, not {type(identity_id).__name__}")
    try:
        return check_identity(identity_id)
    except ObservationRejected as rejected:
        raise ValueError(rejected.reason) from None


def _tool_catalog(tool_catalog: object) -> frozenset[str] | None:
    """``tool_catalog`` as a set of tool names; TypeError naming it otherwise."""
    if tool_catalog is None:
        return None
    if isinstance(tool_catalog, str | bytes):
        raise TypeError("tool_catalog must be a collection of tool names, not one string")
    try:
        names: frozenset[object] = frozenset(tool_catalog)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"tool_catalog must be a collection of tool names, not {type(tool_catalog).__name__}"
        ) from None
    odd = next((name for name in names if not isinstance(name, str)), None)
    if odd is not None:
        raise TypeError(f"tool_catalog holds a {type(odd).__name__}, not a tool name (str)")
    return cast(frozenset[str], names)


def _answered(loaded: LoadedMemory | None) -> LoadedMemory:
    """A consolidation's answer, read by a load that waited for it (one is made whenever
    a load waits, see ``MemoryService._load``), as that load's own: concurrent loads of
    one identity share the consolidation, not the lists and dicts they are given."""
    if loaded is None:  # pragma: no cover - a load waits for every answer it reads
        raise RuntimeError("a consolidation made no answer for a load that waited for it")
    return own_copy(loaded)


async def _offload_steps(size: int, steps: Steps[R]) -> R:
    """The result of ``steps``: in a worker thread when ``size`` (facts) is above
    OFFLOAD_FACTS, else on the loop with a turn between two steps (in the load's turn,
    see STEPPING_AT_ONCE)."""
    if size > OFFLOAD_FACTS:
        return await asyncio.to_thread(finished, steps)
    return await stepped(steps)


def _drop_traceback(error: BaseException) -> None:
    """Forget where ``error`` was raised, once it is logged (in one line, without its
    traceback). The traceback holds the frames it went through, and their locals the
    task or future that holds ``error``: a reference cycle that only the garbage
    collector frees, tens to hundreds of objects per failed load (the facts of its
    fallback answer among them), whose collections pause the event loop for longer the
    more of them an outage leaves."""
    error.__traceback__ = None


def _check_clock(clock: Clock) -> None:
    """Ask ``clock`` once: a naive datetime (or none) would date every observation with a
    time no store can compare, and memory would stop working without a word."""
    now: object = clock()
    if not isinstance(now, datetime):
        raise TypeError(f"clock must return a datetime, not {type(now).__name__}")
    if now.utcoffset() is None:
        raise ValueError(
            "clock must return a timezone-aware datetime (e.g. datetime.now(UTC)), not a naive one"
        )


#: The first date there is (see ``MemoryService._planning``).
_FIRST_DATE = datetime.min.replace(tzinfo=UTC)


def system_clock() -> datetime:
    """The default clock: the system's UTC time."""
    return datetime.now(UTC)


#: The longest ``retention`` and ``max_clock_skew`` (much longer ones made every
#: consolidation, or the writer, fail).
MAX_DURATION = MAX_SPAN

#: How far ahead the timer that keeps a service not yet closed alive on its loop is set
#: (see ``MemoryService._watch_loop_end``): on a real clock it never fires; on a loop
#: whose clock jumps (a test's), it is set again when it does.
_HELD_FOR = 365 * 24 * 3600.0


#: The warning of asyncio's and uvloop's first-iteration hook for an async generator first
#: stepped once the loop's ``shutdown_asyncgens()`` began (which closes only those that
#: were parked before it).
_AFTER_SHUTDOWN = r"asynchronous generator .* was scheduled after loop\.shutdown_asyncgens\(\)"


def _parked(watch: AsyncGenerator[None, None], loop: asyncio.AbstractEventLoop) -> bool:
    """Step ``watch`` to its first ``yield``, now: the running loop's first-iteration hook
    registers it with the generators its ``shutdown_asyncgens()`` closes. False when the
    shutdown began (``watch`` left unstepped), or when the hook refused it (``watch``
    closed without having run)."""
    # asyncio's loop tells that its shutdown began by an attribute; uvloop's only by the
    # hook's warning, made an error here. The filters are the process's (and a change to
    # them shows again the warnings shown once), so they change for uvloop's loop alone,
    # for the one step, once per service.
    began = getattr(loop, "_asyncgens_shutdown_called", None)
    if began:
        # (Never stepped, not even closed: its first step, or its aclose(), would call
        # the hook that warns.)
        return False
    try:
        with contextlib.ExitStack() as filters:
            if began is None:
                filters.enter_context(warnings.catch_warnings())
                warnings.filterwarnings("error", _AFTER_SHUTDOWN, ResourceWarning)
            with contextlib.suppress(StopIteration):
                watch.asend(None).send(None)
    except Exception:
        # Closed here, before it ever ran: left to the collector, its finalizer had the
        # loop schedule a task to close it, which the loop's end could leave pending.
        with contextlib.suppress(StopIteration):
            watch.aclose().send(None)
        return False
    return True


class MemoryService(ObservationWriter):
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
        telemetry: bool | Telemetry | NoTelemetry | None = False,
        max_facts: int | None = DEFAULT_MAX_FACTS,
        max_consolidations: int | None = None,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        log_identities: bool = False,
        hold_gc: bool = True,
    ) -> None:
        require_types(
            load_timeout=(load_timeout, (int, float), "a number of seconds, e.g. 0.1"),
            max_clock_skew=(max_clock_skew, timedelta, "a timedelta, e.g. timedelta(minutes=5)"),
            retention=(retention, timedelta, "a timedelta, e.g. timedelta(days=7)"),
            prompt_budget_tokens=(prompt_budget_tokens, int, "a number of tokens, e.g. 300"),
        )
        require_flags(log_identities=log_identities, hold_gc=hold_gc)
        require_callables(clock=clock, token_counter=token_counter)
        if decay is not None and not all(
            hasattr(decay, name) for name in ("expiry_threshold", "decayed", "reinforce")
        ):
            raise TypeError(
                "decay must be a decay strategy (e.g. ExponentialDecay()), "
                f"not {type(decay).__name__}"
            )
        catalog = _tool_catalog(tool_catalog)
        if clock is not None:
            _check_clock(clock)
        try:
            finite = 0 < float(load_timeout) < float("inf")  # NaN fails too
        except OverflowError:  # an int past the floats
            finite = False
        if not finite:
            raise ValueError("load_timeout must be a positive, finite number of seconds")
        require_types(
            queue_size=(queue_size, int, "a whole number"),
            batch_size=(batch_size, int, "a whole number"),
            queue_bytes=(queue_bytes, int, "a whole number"),
            max_facts=(max_facts, (int, NONE), "a whole number"),
            max_consolidations=(max_consolidations, (int, NONE), "a whole number"),
        )
        if prompt_budget_tokens < 0:
            raise ValueError("prompt_budget_tokens must not be negative")
        if not timedelta(0) <= max_clock_skew <= MAX_DURATION:
            raise ValueError(f"max_clock_skew must be from 0 to {MAX_DURATION.days:,} days")
        if not timedelta(0) <= retention <= MAX_DURATION:
            raise ValueError(f"retention must be from 0 to {MAX_DURATION.days:,} days")
        if queue_size < 1 or batch_size < 1 or queue_bytes < 1:
            raise ValueError("queue_size, queue_bytes and batch_size must be at least 1")
        if max_facts is not None and not 1 <= max_facts <= MAX_FACTS:
            raise ValueError(f"max_facts must be from 1 to {MAX_FACTS} (or None: no cap)")
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
        self.tool_catalog = catalog
        #: Exact token counting for the prompt section (default: a conservative estimate).
        self.token_counter = token_counter
        self._count_tokens = None if token_counter is None else _host_counter(token_counter)
        self.max_facts = max_facts
        self._slots = LifoSlots(max_consolidations)
        self._log = LogThrottle(logger)
        self._facts_cap = CapCounter(self._log, "facts per identity capped")
        cap_facts: Callable[[FactCap], None] | None = getattr(store, "cap_facts", None)
        formula = decay_formula(self.decay)
        if cap_facts is not None and max_facts is not None and formula is not None:
            # A store that can apply the cap where the facts are (FactCap says when).
            cap_facts(FactCap(max_facts, formula, self._now, self._capped_in_store))
        super().__init__(
            queue_size=queue_size, queue_bytes=queue_bytes, batch_size=batch_size, hold_gc=hold_gc
        )
        self.log_identities = log_identities
        self._loads = self._load_timeouts = self._load_errors = 0
        # OpenTelemetry spans and metrics (coda_memory.telemetry); off by default.
        self._telemetry: Telemetry | NoTelemetry = telemetry_for(telemetry)
        self._background: set[asyncio.Task[LoadedMemory | None]] = set()
        #: Set when close() has released the store (a second close() waits for it).
        self._close_done: asyncio.Event | None = None
        #: close()'s task, held here while a cancelled caller leaves it running.
        self._closing: asyncio.Future[None] | None = None
        # Calls of the caller's own that use the store (consolidate, facts, …), which
        # close() waits for before it releases the store.
        self._calls_in_flight = 0
        self._calls_ended: asyncio.Event | None = None
        #: close() released the store while calls were still in flight (see _using_store).
        self._released_under_calls = False
        self._loading: dict[str, asyncio.Task[LoadedMemory | None]] = {}
        #: How many load_memory calls wait for each identity's consolidation's answer.
        self._waiting: dict[str, int] = {}
        #: Facts the peek read, for the identities being consolidated.
        self._stale: dict[str, list[Fact]] = {}
        self._load_stale = 0
        #: Each load_memory call in flight, by call (while in flight only): when it
        #: started (the loop's time, see ``_may_collect``) and its identity; and the calls
        #: a forget of their identity met (see ``_forgetting``).
        self._answering: dict[int, tuple[float, str]] = {}
        self._forgotten_under: set[int] = set()
        #: The consolidations of loads that a forget of their identity met, while they
        #: run: no later load joins one, nor does its peek give the facts at hand.
        self._voided: set[asyncio.Task[Any]] = set()
        #: The tasks of consolidate() calls in flight, by task: the identity of each. A
        #: forget of it voids one as it does a load's consolidation (its peek's facts are
        #: no facts at hand for a load).
        self._consolidating: dict[asyncio.Task[Any], str] = {}
        self._answers = itertools.count()
        #: Answers given again while nothing changed (coda_memory.core.answers).
        self._recent = RecentAnswers()
        self._loads_reused = 0
        #: The loads whose steps may run on the loop now (see STEPPING_AT_ONCE).
        self._stepping = asyncio.Semaphore(STEPPING_AT_ONCE)
        #: The async generator that closes the service when its event loop ends, while
        #: one is parked on the loop, and the timer by which the loop holds the service
        #: meanwhile (see ``_watch_loop_end``).
        self._loop_end: AsyncGenerator[None, None] | None = None
        self._held_by_loop: asyncio.TimerHandle | None = None
        #: Its loop's shutdown of async generators had begun when the watch of its end
        #: would have been parked: there is none (see ``_watch_loop_end``).
        self._loop_ending = False
        #: Closed by the end of its event loop, not by the host (see ``_check_open``).
        self._closed_by_loop_end = False
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
        ``token_counter``, ``telemetry``, ``max_facts``, ``max_consolidations``, ``hold_gc``,
        ``queue_bytes``, ``log_identities``)
        or to the store
        (Postgres: ``schema``, ``pool_size``, ``lock_timeout``, ``known_facts``, …; Redis:
        ``prefix``, ``lock_timeout``, ``history_limit``, …)."""
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
            "hold_gc",
        }
        service_options = {k: v for k, v in options.items() if k in service_keys}
        store_options = {k: v for k, v in options.items() if k not in service_keys}
        store = store_from_url(url, store_options)
        return cls(store, decay=decay, load_timeout=load_timeout, clock=clock, **service_options)

    # -- writes -------------------------------------------------------------------------

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until everything emitted so far is stored (or rejected or dropped), and
        every background consolidation has finished. With ``timeout``, raise
        ``TimeoutError`` after that many seconds."""
        timeout = seconds_or_none("timeout", timeout)
        if self._close_done is not None and self._close_done.is_set():
            return  # closed: nothing is queued or running (whatever the loop)
        loop = self._check_loop()
        async with asyncio.timeout(timeout):
            await self._written(loop)
            while self._background:
                # wait(), not gather(): a drain that times out (or is cancelled) must not
                # cancel the consolidations of the loads in flight with it.
                await asyncio.wait(list(self._background))

    # -- consolidation ------------------------------------------------------------------

    async def start(self) -> None:
        """Open the store's connections, prepare its statements and start the writer, so
        that the first requests don't pay for it. Optional: without it, everything starts
        on first use."""
        async with self._using_store():
            self._ensure_writer(self._check_loop())
            start = getattr(self.store, "start", None)
            if start is not None:
                await start()

    async def consolidate(self, identity_id: str) -> list[Fact]:
        """Consolidate the identity's new observations now (no timeout) and return its
        active facts; raises on storage errors, and :class:`StoreBusy` when a table held
        past the store's lock timeout kept the consolidation out (a load answers from the
        stored facts then; this call consolidated nothing, and is worth retrying)."""
        identity_id = _identity_argument(identity_id)
        held: list[str] = []
        from_peek: list[bool] = []
        token, peek_token = HELD_OUT.set(held), _FROM_PEEK.set(from_peek)
        task = asyncio.current_task()
        if task is not None:
            self._consolidating[task] = identity_id
        try:
            async with self._using_store():
                with collector_scope(self.hold_gc, self._may_collect):
                    facts, _ = await self._consolidated(identity_id)
        finally:
            if task is not None:
                self._consolidating.pop(task, None)
                self._voided.discard(task)
            _FROM_PEEK.reset(peek_token)
            HELD_OUT.reset(token)
        # Held out and answered from the peek: nothing consolidated. (A peek held out
        # that went on to consolidate, its facts expired or over the cap, did.)
        if held and from_peek:
            raise StoreBusy(
                "a table the consolidation reads is held (lock timeout): nothing was "
                "consolidated, retry later"
            )
        return facts

    async def _consolidated(self, identity_id: str) -> tuple[list[Fact], str | None]:
        """:meth:`consolidate`, with the version of the facts (see ``_consolidate``)."""
        self._bind(self._check_loop())
        with self._telemetry.span("consolidate") as span:
            if span is None:
                return await self._consolidate(identity_id)
            outer = HELD_OUT.get()  # (consolidate()'s, which raises when held out)
            held: list[str] = []
            token = HELD_OUT.set(held)
            try:
                facts, version = await self._consolidate(identity_id)
            finally:
                HELD_OUT.reset(token)
                if outer is not None:
                    outer.extend(held)
            span.set_attribute("coda_memory.facts", len(facts))
            if held:  # a peek a held table kept out: answered from the facts alone
                span.set_attribute("coda_memory.held_out", held)
            return facts, version

    async def _consolidate(self, identity_id: str) -> tuple[list[Fact], str | None]:
        """The identity's active facts and, when they are the stored ones (nothing waited
        to be consolidated) and the store tells it, the version of the stored facts they
        were made from (read where they were, not after: another consolidation of the
        identity may end meanwhile). A load keeps an answer only with a version (see
        ``_load``)."""
        # Whether the store capped the identity's facts during this call's peek (its
        # consolidation then finishes that cap, and counts and logs it once, with what it
        # deleted itself): this call's own, as concurrent calls for the identity may differ.
        capped: dict[str, int] = {}
        token = _CAPPED_BY_STORE.set(capped)
        try:
            return await self._peek_then_consolidate(identity_id, capped)
        finally:
            _CAPPED_BY_STORE.reset(token)
            for capped_identity, deleted in capped.items():  # no consolidation finished it
                self._capped_by_store(capped_identity, deleted)

    async def _peek_then_consolidate(
        self, identity_id: str, capped: dict[str, int]
    ) -> tuple[list[Fact], str | None]:
        """:meth:`_consolidate`, with the identities that the store capped during the
        peek in ``capped``: the consolidation itself."""
        # Most requests find nothing new: answer those from one read, without the lock.
        # When this service stored observations of the identity since it last consolidated
        # it, and the store keeps the identity's facts, there is no need to peek. (What is
        # stored from here on marks the identity again.)
        skip_peek = identity_id in self.stored_for and self._keeps_facts(identity_id)
        self.stored_for.discard(identity_id)
        if not skip_peek:
            async with self._slots:
                stored, pending, version = await self._peek(identity_id)
            if (
                identity_id in self._loading
                and asyncio.current_task() not in self._voided
                and (stored or not pending)
            ):
                # What a load that outlives its timeout answers with (see load_memory);
                # when the store left the facts out, the ones it keeps.
                self._stale[identity_id] = stored
            if not pending and (self.max_facts is None or len(stored) <= self.max_facts):
                views = await _offload_steps(len(stored), viewing(stored, self.decay, self.clock()))
                if len(views) == len(stored):  # else some expired: consolidating deletes them
                    if (from_peek := _FROM_PEEK.get()) is not None:
                        from_peek.append(True)
                    return views, version
        async with self._slots, self.store.consolidation(identity_id) as unit:
            batch = await unit.load()
            # A turn of the loop between the steps (reading the batch, planning, writing)
            # that run without waiting for the server: under concurrent loads, the loop
            # then runs one step of each in a turn, not all of a load's Python at once,
            # and other tasks wait less (event-loop lag p99 -0.8 ms on 8 requests).
            await asyncio.sleep(0)
            plan = await _offload_steps(len(batch.facts), self._planning(identity_id, batch))
            await asyncio.sleep(0)
            if plan.writes_anything:
                await unit.write(plan)
                await unit.commit()
        deleted = capped.pop(identity_id, None)
        if deleted is not None:
            # The cap the store applied on the server, finished exactly: counted once.
            self._capped_by_store(identity_id, deleted, plan)
        elif plan.evicted:
            self._facts_cap.hit(
                len(plan.evicted),
                f"{self._label(identity_id)} keeps its {len(plan.active)} best ranked facts, "
                f"{len(plan.evicted)} deleted",
            )
        # The observations read and the history recorded are this call's own: freed in
        # steps, not in one go as the call returns (a backlog's, 100,000 of each: a stall
        # of the loop of 60 to 140 ms otherwise; see :func:`released`). Last, once the
        # consolidation is counted: a cancellation meanwhile leaves nothing uncounted.
        await released(batch.observations, plan.events)
        return plan.active, None

    def _now(self) -> datetime:
        return self.clock()

    def _capped_in_store(self, identity_id: str, deleted: int) -> None:
        """The store's report of the cap it applied on the server (:class:`FactCap`),
        counted and logged when the consolidation under way has finished it."""
        capped = _CAPPED_BY_STORE.get()
        if capped is None:
            self._capped_by_store(identity_id, deleted)
        else:
            capped[identity_id] = capped.get(identity_id, 0) + deleted

    def _capped_by_store(
        self, identity_id: str, deleted: int, plan: ConsolidationPlan | None = None
    ) -> None:
        """Count and log the cap the store applied (``deleted`` facts), with what the
        consolidation that finished it deleted more (``plan``)."""
        kept = (
            "its best ranked facts" if plan is None else f"its {len(plan.active)} best ranked facts"
        )
        evicted = 0 if plan is None else len(plan.evicted)
        how = (
            f"{deleted + evicted} deleted ({deleted} by the store, {evicted} by the consolidation)"
            if evicted
            else f"{deleted} deleted by the store"
        )
        self._facts_cap.hit(deleted + evicted, f"{self._label(identity_id)} keeps {kept}, {how}")

    def _keeps_facts(self, identity_id: str) -> bool:
        """Whether the store keeps the identity's facts between requests (the Postgres
        store does, see ``known_facts``)."""
        keeps: Callable[[str], bool] | None = getattr(self.store, "keeps_facts", None)
        return keeps is not None and keeps(identity_id)

    async def _kept_facts(self, identity_id: str) -> list[Fact]:
        """The identity's facts as the store keeps them between requests (none when it
        does not keep them), as new models each time: the caller's own, which it may turn
        into views in place."""
        kept: Callable[[str], Awaitable[list[Fact]]] | None = getattr(
            self.store, "kept_facts", None
        )
        return [] if kept is None else await kept(identity_id)

    def _planning(self, identity_id: str, batch: ConsolidationInput) -> Steps[ConsolidationPlan]:
        now = self.clock()
        # Within the retention of year 1 (a test's clock), now less the retention, the
        # prune bound, left the range of dates and every consolidation failed: the bound
        # is the first date then.
        retention = min(self.retention, max(timedelta(0), now - _FIRST_DATE))
        return planning(identity_id, batch, now, self.decay, retention, self.max_facts)

    async def facts(self, identity_id: str) -> list[Fact]:
        """The identity's active facts at the clock's now, without consolidating."""
        identity_id = _identity_argument(identity_id)
        async with self._using_store():
            with collector_scope(self.hold_gc, self._may_collect):
                stored = await self.store.facts(identity_id)
                return await stepped(viewing(stored, self.decay, self.clock()))

    async def history(self, identity_id: str, subject: str | None = None) -> list[FactEvent]:
        """Every create, reinforce, extend and expire of the identity's facts, in order."""
        identity_id = _identity_argument(identity_id)
        if subject is not None and not isinstance(subject, str):
            raise TypeError(f"subject must be a str (or None), not {type(subject).__name__}")
        async with self._using_store():
            if subject is not None and has_nul_or_surrogate(subject):
                # No stored subject holds one; the Postgres driver's error would quote it.
                return []
            return await self.store.history(identity_id, subject)

    async def load_memory(self, identity_id: str) -> LoadedMemory:
        """Consolidate, then format the prompt section and tool affinities, all within
        ``load_timeout``; never raises.

        When the consolidation outlives the timeout (it then finishes in the background)
        or fails, the answer is built from the facts at hand before it started, as the
        store keeps them or the peek read them (``stats().load_stale``): only the newest
        observations are missing. Without those, the result is empty. That answer is
        made from :data:`HEDGE_AT` of the timeout on, while the consolidation goes on, so
        that it is ready when the timeout fires; it is dropped if the consolidation ends
        in time. A consolidation that every load waiting for it has given up on makes no
        answer (see ``_load``)."""
        self._loads += 1
        started = time.perf_counter()
        with self._telemetry.span("load_memory") as span:
            try:
                loaded, outcome = await self._answer(identity_id)
            except asyncio.CancelledError:  # the caller gave up (a client went away)
                if span is not None:
                    span.set_attribute("coda_memory.outcome", "cancelled")
                self._telemetry.load_finished(time.perf_counter() - started, "cancelled")
                raise
            if span is not None:
                span.set_attribute("coda_memory.outcome", outcome)
                span.set_attribute("coda_memory.facts", len(loaded.facts))
        self._telemetry.load_finished(time.perf_counter() - started, outcome)
        return loaded

    def _check_open(self) -> None:
        """ServiceClosed once ``close`` began: a closed service's store would otherwise
        open new connections that nothing closes."""
        if self._closed_by_loop_end:
            raise ServiceClosed(
                "the memory service closed itself when its event loop ended without "
                "close() (a service lives on one event loop: make it inside the "
                "asyncio.run() that uses it, and close it there)"
            )
        if self._closed:
            raise ServiceClosed("the memory service is closed")

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind the service to ``loop``, the running one, unless it is bound: the store's
        connections will belong to it. (Left unbound by ``facts`` or ``history``, a
        service used them on the next loop, where they failed with "Event loop is
        closed".)"""
        if self._loop is None:
            self._loop, self._loop_thread = loop, threading.get_ident()
            if self._queue:  # emitted by other threads before any loop was bound
                self._ensure_writer(loop)
                self._signal()
        self._watch_loop_end()

    def _ensure_writer(self, loop: asyncio.AbstractEventLoop) -> None:
        """The writer's, then the watch of the loop's end (the first emit may bind the
        service to its loop). Nothing more once both are there: every emit calls it."""
        if (
            (self._loop_end is not None or self._loop_ending)
            and self._writer is not None
            and not self._writer.done()
        ):
            return
        try:
            super()._ensure_writer(loop)
        finally:  # (a host's task factory that raised: the loop's end still closes it)
            if self._loop is loop:
                self._watch_loop_end()

    def _watch_loop_end(self) -> None:
        """Have the running loop close the service when it ends, unless ``close`` does
        first: an async generator parked on the loop, which the loop's
        ``shutdown_asyncgens()`` closes once every task is cancelled, while the loop still
        runs (``asyncio.run()``, ``asyncio.Runner``, uvicorn and pytest-asyncio call it
        before they close the loop). Its ``finally`` closes the service there.

        Left open when its loop ended, the service left its writer and its connections to
        the garbage collector, which reported them at exit ("Task was destroyed but it is
        pending!", SQLAlchemy's "non-checked-in connection", "Event loop is closed"), and
        lost what was queued."""
        loop = self._loop
        if self._loop_end is not None or self._loop_ending or self._closed or loop is None:
            return
        watch = self._closing_at_loop_end()
        if not _parked(watch, loop):
            # The loop's shutdown of its async generators began (a first call from the
            # ``finally`` of one): it would never close a generator parked now, so none
            # is, and none again on later calls. The host's close() closes the service.
            self._loop_ending = True
            return
        self._loop_end = watch
        # The loop holds its async generators weakly: held by nothing but a host that
        # dropped it unclosed, the service was collected with its writer's task pending
        # ("Task was destroyed but it is pending!"). A timer that never fires makes the
        # loop hold it, for as long as the loop itself is held: a loop closed or dropped
        # without its shutdown (``loop.close()`` alone, a ``run_until_complete`` per job)
        # lets it go with it, where a registry of the module's kept it, its loop and its
        # connections for the life of the process.
        self._held_by_loop = loop.call_later(_HELD_FOR, self._held_on)

    def _held_on(self) -> None:
        """The timer that holds the service fired (a loop whose clock jumped ahead a
        year: a test's fake clock): set it again, unless the service let go of it."""
        if self._held_by_loop is not None and self._loop is not None:
            self._held_by_loop = self._loop.call_later(_HELD_FOR, self._held_on)

    async def _closing_at_loop_end(self) -> AsyncGenerator[None, None]:
        """Parked at its ``yield`` until the loop's ``shutdown_asyncgens()`` (or
        ``close``) closes it; then closes the service unless it is closed."""
        try:
            yield
        finally:
            self._loop_end = None
            self._let_go_by_loop()
            if not self._closed:
                await self._close_as_the_loop_ends()

    def _let_go_by_loop(self) -> None:
        held, self._held_by_loop = self._held_by_loop, None
        if held is not None:
            held.cancel()

    async def _close_as_the_loop_ends(self) -> None:
        """Close the service, its host having not: what is queued is stored (for up to
        CLOSE_AT_LOOP_END), the store released, and one ResourceWarning says so (shown in
        development mode and by pytest, as for a file left open), after the closing: a
        warning made an error (``-W error``) must not keep it from closing, and goes to
        the log instead: raised out of the loop's shutdown, asyncio logged it as an error
        of the shutdown, with its traceback."""
        self._closed_by_loop_end = True
        try:
            try:
                await self.close(CLOSE_AT_LOOP_END)
            finally:
                await self._cancel_openings()
        finally:
            message = (
                "a MemoryService was not closed before its event loop ended; it closed "
                "itself then (call `await memory.close()` at shutdown, or use "
                "`async with memory:`)"
            )
            try:
                warnings.warn(
                    message,
                    ResourceWarning,
                    stacklevel=1,  # (no frame of the host's calls it)
                    source=self,
                )
            except Warning:
                logger.warning("coda-memory: %s", message)

    async def _cancel_openings(self) -> None:
        """Cancel the connections the store is still opening (a database that accepted
        them and never answered), and wait for them up to CLOSE_AT_LOOP_END: the loop
        closes next, and asyncio reported each one left pending as a task destroyed while
        pending."""
        cancel: Callable[[float], Awaitable[None]] | None = getattr(
            self.store, "cancel_openings", None
        )
        if cancel is not None:
            await cancel(CLOSE_AT_LOOP_END)

    async def _stop_watching_loop_end(self) -> None:
        """Close the async generator parked on the loop (``close`` ended first)."""
        watch, self._loop_end = self._loop_end, None
        self._let_go_by_loop()
        if watch is not None:
            await watch.aclose()

    @asynccontextmanager
    async def _using_store(self) -> AsyncIterator[None]:
        """A call of the caller's that uses the store: ServiceClosed once ``close`` began,
        and meanwhile counted, so that ``close`` waits for it (within CLOSE_GRACE of its
        drain's end) before it releases the store. (A connection still checked out when
        its pool is disposed is left open until the garbage collector finds it.)
        RuntimeError on an event loop other than the service's: its connections belong to
        that loop."""
        self._check_open()
        self._bind(self._check_loop())
        self._calls_in_flight += 1
        try:
            yield
        finally:
            self._calls_in_flight -= 1
            if not self._calls_in_flight and self._calls_ended is not None:
                self._calls_ended.set()
                if self._released_under_calls:
                    # close() released the store without this call, which went on using
                    # it (a Redis client connects again on its next command): release
                    # what it opened since. The call's own outcome stands.
                    self._released_under_calls = False
                    try:
                        await self._release_store()
                    except Exception as error:
                        logger.warning(
                            "coda-memory: releasing the store after the last call failed (%s)",
                            short_error(error),
                        )

    async def _calls_end(self, grace: float) -> None:
        """Wait, up to ``grace`` seconds (what is left of close()'s CLOSE_GRACE), for the
        calls in flight to end (see ``_using_store``)."""
        if not self._calls_in_flight:
            return
        self._calls_ended = asyncio.Event()
        try:
            async with asyncio.timeout(grace):
                await self._calls_ended.wait()
        except TimeoutError:
            logger.warning(
                "coda-memory: %d call(s) still used the store %.0f s after close() began "
                "releasing it",
                self._calls_in_flight,
                CLOSE_GRACE,
            )

    async def _answer(self, identity_id: str) -> tuple[LoadedMemory, str]:
        """:meth:`load_memory`'s steps, with the outcome its telemetry records (``ok``,
        ``stale``, ``timeout`` or ``error``; :meth:`load_memory` records ``cancelled``
        when its caller cancels it): the identity checked; one load in flight per
        identity (``_load``, shared by concurrent callers); a wait up to :data:`HEDGE_AT`
        of the timeout, then, with a fallback answer made meanwhile, up to
        :data:`ANSWER_BY` of it; and when that runs out, the fallback (the facts of the
        identity's last consolidation, or empty)."""
        loop = asyncio.get_running_loop()
        if self._closed_by_loop_end:  # (see _check_open)
            return self._refused(
                "closed",
                "load_memory after the service's event loop ended without close(), which "
                "closed it (make one service per event loop)",
            )
        if self._closed:  # its store is closed: asking it would open connections again
            return self._refused("closed", "load_memory after close()")
        if self._loop is not None and self._loop is not loop:
            # Its connections live on the other loop: not one is touched from this one.
            return self._refused(
                "wrong loop",
                "load_memory from an event loop the service does not run on (create one "
                "service per event loop)",
            )
        if not isinstance(identity_id, str):  # a UUID or an int from a host: no store is asked
            return self._refused(
                "identity not a string",
                "load_memory got an identity of type %s, not str",
                type(identity_id).__name__,
            )
        try:  # (a str enum member: its value, as it was stored)
            identity_id = check_identity(identity_id)
        except ObservationRejected as rejected:  # no store could hold it: none is asked
            return self._refused(
                "identity unusable",
                "load_memory got an identity the store cannot hold (%s)",
                rejected.reason,
            )
        started = loop.time()
        task: asyncio.Task[LoadedMemory | None] | None = None
        fallback: asyncio.Task[LoadedMemory | None] | None = None
        answering = next(self._answers)
        self._answering[answering] = (started, identity_id)
        waiting = False
        try:
            task = self._loading.get(identity_id)
            if task is None or task.done():
                task = loop.create_task(self._load(identity_id))
                self._loading[identity_id] = task
                self._background.add(task)
                task.add_done_callback(lambda t: self._finished(identity_id, t))
            self._waiting[identity_id] = self._waiting.get(identity_id, 0) + 1
            waiting = True
            try:
                hedge = self.load_timeout * HEDGE_AT
                return self._given(answering, await _within(task, hedge)), "ok"
            except TimeoutError:
                if task.done() and not task.cancelled():  # finished as the wait gave up
                    return self._given(answering, task.result()), "ok"
            # Still running: the fallback answer is made now, while the consolidation
            # goes on, so that it is ready when the timeout fires. (Made when the load
            # gives up instead, 8 late loads' answers made one after another came up to
            # 40 ms late on a slow machine with a table locked.)
            fallback = loop.create_task(self._stale_answer(identity_id))
            remaining = max(0.0, self.load_timeout * ANSWER_BY - (loop.time() - started))
            return self._given(answering, await _within(task, remaining)), "ok"
        except TimeoutError:
            if task is not None and task.done() and not task.cancelled():
                failure = task.exception()
                if failure is None:
                    # It finished while the wait was giving up on it (the loop ran it
                    # between the timeout and the cancellation of the wait): its answer is
                    # here.
                    return self._given(answering, task.result()), "ok"
                # It failed: with its own TimeoutError (a lock held past the store's lock
                # timeout, a driver's command timeout) that the wait passed on, or with
                # any error as this load's timer fired (the loop ran it between the
                # timer and this). The load's outcome is the consolidation's, known by
                # now: an error, not this load's timeout.
                waiting = self._stop_waiting(identity_id, waiting)
                return await self._failed_load(failure, fallback, identity_id, answering)
            # From here on the consolidation's answer is not read by this load.
            waiting = self._stop_waiting(identity_id, waiting)
            loaded = await self._fallback(fallback, identity_id, answering)
            if loaded is not None:
                self._log.warning(
                    "load stale",
                    "coda-memory: consolidating %s took over %.0f ms; answering with the "
                    "facts of its last consolidation",
                    self._label(identity_id),
                    self.load_timeout * 1000,
                )
                return loaded, "stale"
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
            waiting = self._stop_waiting(identity_id, waiting)
            return await self._failed_load(error, fallback, identity_id, answering)
        finally:
            self._stop_waiting(identity_id, waiting)
            del self._answering[answering]
            self._forgotten_under.discard(answering)
            if fallback is not None and not fallback.done():
                fallback.cancel()  # the consolidation's own answer came (or the caller left)

    def _given(self, answering: int, loaded: LoadedMemory | None) -> LoadedMemory:
        """The consolidation's answer as the load ``answering`` gives it: none when a
        forget of its identity began or ended while the load was in flight. Its facts
        may have been read before the erasure (a load that began while the forget was
        erasing), and the answer then outlived the forget."""
        if answering in self._forgotten_under:
            return LoadedMemory.empty()
        return _answered(loaded)

    async def _failed_load(
        self,
        error: BaseException,
        fallback: asyncio.Task[LoadedMemory | None] | None,
        identity_id: str,
        answering: int,
    ) -> tuple[LoadedMemory, str]:
        """The answer of a load whose consolidation failed with ``error``: counted in
        ``load_errors`` and logged, from the facts at hand, else empty."""
        self._load_errors += 1
        _drop_traceback(error)
        error, peeked = _failure(error)
        loaded = await self._fallback(fallback, identity_id, answering, peeked)
        self._log.warning(
            f"load failed: {type(error).__name__}",
            "coda-memory: load_memory for %s failed (%s); %s",
            self._label(identity_id),
            short_error(error, (identity_id,), show=self.log_identities),
            "returning empty"
            if loaded is None
            else "answering with the facts of its last consolidation",
        )
        _drop_traceback(error)
        if loaded is not None:
            return loaded, "stale"
        return LoadedMemory.empty(), "error"

    def _stop_waiting(self, identity_id: str, waiting: bool) -> bool:
        """Count a load that waited for the identity's consolidation (``waiting``) as
        waiting no more; False, the load's ``waiting`` from then on."""
        if waiting:
            left = self._waiting[identity_id] - 1
            if left:
                self._waiting[identity_id] = left
            else:
                del self._waiting[identity_id]
        return False

    def _may_collect(self) -> bool:
        """A collection of the garbage collector stalls the loop (a full one for tens of
        milliseconds): let one run only while no load in flight is past
        :data:`COLLECTION_BEFORE` of its timeout, so that none is made late by it (see
        :mod:`~coda_memory.core.turns`)."""
        if not self._answering:
            return True
        oldest = min(start for start, _ in self._answering.values())
        now = asyncio.get_running_loop().time()
        return now - oldest < self.load_timeout * COLLECTION_BEFORE

    async def _fallback(
        self,
        fallback: asyncio.Task[LoadedMemory | None] | None,
        identity_id: str,
        answering: int,
        peeked: list[Fact] | None = None,
    ) -> LoadedMemory | None:
        """The answer from the facts at hand: the one started at the hedge, else made now
        (also when none was at hand at the hedge: the peek may have read them since, and
        ``peeked`` holds them when the consolidation failed after it); counted in
        ``load_stale`` when there is one. None when a forget of the identity ran while the
        load (the call ``answering``) was in flight: those facts may have been read before
        the erasure, and the answer, made over turns of the loop, outlived the forget."""
        loaded = None if fallback is None else await fallback
        if loaded is None:
            loaded = await self._stale_answer(identity_id, peeked)
        if loaded is not None and answering in self._forgotten_under:
            loaded = None
        if loaded is not None:
            self._load_stale += 1
        return loaded

    async def _stale_answer(
        self, identity_id: str, peeked: list[Fact] | None = None
    ) -> LoadedMemory | None:
        """The answer of a load that did not get its consolidation's, from the facts at
        hand (None: none, or they could not be had: load_memory never raises)."""
        try:
            with collector_scope(self.hold_gc, self._may_collect):
                return await self._from_facts_at_hand(identity_id, peeked)
        except Exception as error:
            self._log.warning(
                f"stale answer failed: {type(error).__name__}",
                "coda-memory: the facts at hand for %s could not be read (%s)",
                self._label(identity_id),
                short_error(error, (identity_id,), show=self.log_identities),
            )
            return None

    async def _from_facts_at_hand(
        self, identity_id: str, peeked: list[Fact] | None = None
    ) -> LoadedMemory | None:
        """Those the peek read (``peeked``, when the consolidation failed after it), else
        those the store keeps."""
        stale = self._stale.get(identity_id) if peeked is None else peeked
        # The peek's facts are shared (with concurrent loads and the consolidation); the
        # kept ones are read as new models, this answer's own.
        owned = stale is None
        if stale is None:
            # No peek yet (waiting for a connection, or skipped), or the consolidation
            # failed: the kept facts.
            stale = await self._kept_facts(identity_id)
        if not stale:
            return None
        loaded = await self._loaded_as_of_last_consolidation(stale, owned=owned)
        # None when nothing is left to answer with (every fact expired by now, or about a
        # tool the catalog dropped): the load is then empty, not answered "stale".
        return loaded if loaded.facts else None

    async def _load(self, identity_id: str) -> LoadedMemory | None:
        """One consolidation and its prompt section, shared by concurrent loads. The
        facts read for it are gone when it ends (see :func:`collector_scope`).

        When every load that waited for it has answered already (from the facts at hand,
        after its timeout), the consolidation still finishes but makes no answer (None):
        nobody would read it, and on a loop that is too busy to finish consolidations in
        time, making it would only delay the next loads."""
        with collector_scope(self.hold_gc, self._may_collect), taking_turns(self._stepping):
            try:
                reused = await self._reused(identity_id)
                if reused is not None:
                    return reused
                facts, version = await self._consolidated(identity_id)
                made_at = self.clock()
                if identity_id not in self._waiting:
                    return None
                await asyncio.sleep(0)  # as between the consolidation's steps
                loaded = await _offload_steps(len(facts), self._answer_steps(facts))
                if version is not None:  # not after a consolidation (see answers)
                    self._recent.put(identity_id, version, made_at, loaded)
                return loaded
            except Exception as error:
                # The peek's facts, dropped below, go to the loads that waited with the
                # error (the facts at hand they answer from).
                peeked = self._stale.get(identity_id)
                if peeked:
                    raise _FailedAfterPeek(error, peeked) from None
                raise
            finally:
                if asyncio.current_task() not in self._voided:  # (else a later load's)
                    self._stale.pop(identity_id, None)

    async def _reused(self, identity_id: str) -> LoadedMemory | None:
        """The identity's last answer, when it is recent and its facts' version is still
        the stored one with nothing waiting (see :mod:`~coda_memory.core.answers`)."""
        unchanged: Callable[[str, str], Awaitable[bool]] | None = getattr(
            self.store, "unchanged", None
        )
        if unchanged is None or identity_id in self.stored_for:
            return None  # (stored_for: something new waits for sure)
        answer = self._recent.fresh(identity_id, self.clock())
        if answer is None:
            return None
        try:
            async with self._slots:
                same = await unchanged(identity_id, answer.version)
        except Exception as error:
            # A held table, a lost connection: the load goes the usual way, which
            # answers from the facts at hand when it can.
            _drop_traceback(error)
            same = False
        if not same:
            self._recent.discard(identity_id)
            return None
        self._loads_reused += 1
        return self._recent.given(answer)

    async def _peek(self, identity_id: str) -> tuple[list[Fact], bool, str | None]:
        """The store's peek, with the version of the facts when the store tells it (the
        Postgres store: ``peek_versioned``)."""
        versioned: Callable[[str], Awaitable[tuple[list[Fact], bool, str | None]]] | None = getattr(
            self.store, "peek_versioned", None
        )
        if versioned is not None:
            return await versioned(identity_id)
        stored, pending = await self.store.peek(identity_id)
        return stored, pending, None

    async def _loaded_as_of_last_consolidation(
        self, stored: list[Fact], *, owned: bool = False
    ) -> LoadedMemory:
        """The answer from ``stored`` (``owned``: new models that nothing else holds,
        which become their views in place)."""

        def building() -> Steps[LoadedMemory]:
            views = yield from viewing(
                stored, self.decay, self.clock(), self.max_facts, owned=owned
            )
            yield
            return (yield from self._answer_steps(views))

        return await _offload_steps(len(stored), building())

    def _answer_steps(self, facts: list[Fact]) -> Steps[LoadedMemory]:
        """The answer from ``facts`` (views at now) as steps: ranking them, then the
        prompt section of the ranked facts (every SLICE facts a step) and the tool
        affinities. With a ``tool_catalog``, facts about tools outside it (learnt before
        the host dropped the tool) are left out of all three."""
        if self.tool_catalog is not None:
            catalog = self.tool_catalog
            facts = [fact for fact in facts if not outside_catalog(fact, catalog)]
        ranked = ranked_facts(facts)
        yield
        section = yield from section_steps(
            ranked, self.prompt_budget_tokens, token_counter=self._count_tokens
        )
        return LoadedMemory(
            facts=facts,
            prompt_section=section,
            tool_affinities=extract_tool_affinities(facts),
        )

    def _refused(self, cause: str, message: str, *args: object) -> tuple[LoadedMemory, str]:
        """A load answered empty before any store is asked: counted in ``load_errors``,
        with a log line (``message``, then "; returning empty") of cause ``load failed:
        {cause}``."""
        self._load_errors += 1
        line = f"coda-memory: {message}; returning empty"
        self._log.warning(f"load failed: {cause}", line, *args)
        return LoadedMemory.empty(), "error"

    def _finished(self, identity_id: str, task: asyncio.Task[LoadedMemory | None]) -> None:
        self._background.discard(task)
        self._voided.discard(task)
        if self._loading.get(identity_id) is task:
            del self._loading[identity_id]
            self._stale.pop(identity_id, None)
        wrapped = None if task.cancelled() else task.exception()
        if wrapped is not None:
            error, _ = _failure(wrapped)
            # Each load still waiting for the task reports the error itself (their wakeups
            # come after this callback, registered first): a line here too would count
            # every failed load twice in "N more like it". Without one (they gave up, or
            # none came), the line is this one, under the same cause: one outage, one
            # line a second.
            if not self._waiting.get(identity_id):
                self._log.warning(
                    f"load failed: {type(error).__name__}",
                    "coda-memory: background consolidation of %s failed (%s)",
                    self._label(identity_id),
                    short_error(error, (identity_id,), show=self.log_identities),
                )
            _drop_traceback(error)
            _drop_traceback(wrapped)

    # -- administration -----------------------------------------------------------------

    async def forget(self, identity_id: str) -> Forgotten:
        """Delete every observation, fact, fact event and checkpoint of the identity,
        including observations of it still queued in this service; say how many
        observations (stored, and dropped from the queue), facts and fact events."""
        identity_id = _identity_argument(identity_id)
        async with self._using_store():
            queued = self._forget_queued(identity_id)
            try:
                # What this service is storing (some may be the identity's), and a load of
                # the identity under way here (its answer would outlive the forget), not
                # every identity's consolidations as a drain() waits for.
                async with asyncio.timeout(FORGET_WAIT):
                    await self._written(self._check_loop())
                    load = self._loading.get(identity_id)
                    if load is not None:
                        await asyncio.wait([load])
            except TimeoutError as error:
                raise TimeoutError(
                    f"forget waited {FORGET_WAIT:g} s for the observations this service is "
                    "storing (the store unreachable, or a table held): nothing stored was "
                    "erased, run it again"
                ) from error
            try:
                self._forgetting(identity_id)
                forgotten = await self.store.forget(identity_id)
            finally:  # (also when cancelled: the erasure may have committed)
                self._forgetting(identity_id)  # (and those that began meanwhile)
                self.stored_for.discard(identity_id)
                self._recent.discard(identity_id)
        return dataclasses.replace(forgotten, observations=forgotten.observations + queued)

    def _forgetting(self, identity_id: str) -> None:
        """Note the loads of ``identity_id`` in flight as met by its forget: an answer of
        theirs is none, whether from their consolidation (see ``_given``) or from the
        facts at hand (see ``_fallback``)."""
        self._forgotten_under.update(
            call for call, (_, identity) in self._answering.items() if identity == identity_id
        )
        # Its consolidation under way may have read the facts before the erasure: a load
        # that begins from here on starts its own, and answers from none of those facts.
        load = self._loading.pop(identity_id, None)
        if load is not None and not load.done():
            self._voided.add(load)
        # So may a consolidate() call's: its peek stores no facts at hand for the loads.
        self._voided.update(
            call for call, identity in self._consolidating.items() if identity == identity_id
        )
        self._stale.pop(identity_id, None)

    def stats(self) -> MemoryStats:
        """Counts of observations emitted, stored, rejected, dropped and pending."""
        self._lost_with_loop()  # (its loop closed without close(): nothing is pending)
        self._lost_after_close()  # (queued by another thread as close() ended)
        # The store's counts of what its appends, peeks and consolidations did around
        # locks, and of the facts it keeps between requests (Postgres only).
        ingest = getattr(self.store, "ingest_counts", None)
        held_out = getattr(self.store, "held_out", None)
        kept = getattr(self.store, "kept_facts_counts", None)
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
            loads_reused=self._loads_reused,
            facts_capped=self._facts_cap.applied,
            facts_evicted=self._facts_cap.dropped,
            entity_results_capped=emitters.ENTITY_CAP.applied,
            rollups_owed=getattr(ingest, "rollups_owed", 0),
            rollups_folded=getattr(ingest, "rollups_folded", 0),
            keys_spilled=getattr(ingest, "keys_spilled", 0),
            peeks_held_out=getattr(held_out, "peeks", 0),
            consolidations_held_out=getattr(held_out, "consolidations", 0),
            kept_facts_dropped=getattr(kept, "dropped", 0),
            facts_reads=getattr(kept, "reads", 0),
        )

    async def close(self, timeout: float | None = 30.0) -> None:
        """Drain (up to ``timeout`` seconds), stop the writer and, once the calls in flight
        (``consolidate``, ``facts``, …) have ended or 2 seconds more have passed, release
        the store. The writer's stop, the consolidations' and the calls' ends share those
        2 seconds, and the store's close gets up to 2 seconds of its own, so that close()
        returns within ``timeout`` plus 4 seconds even when the database stops answering.
        Observations that could not be stored by then are dropped and counted.
        A second call returns when the first has released the store. Raises RuntimeError,
        and closes nothing, on an event loop other than the one the service ran on: its
        connections can only be released there."""
        # Checked first: a timeout of the wrong type dropped the queue and then raised.
        timeout = seconds_or_none("timeout", timeout)
        if self._closed:
            if self._close_done is not None and not self._close_done.is_set():
                self._check_loop()
                await self._close_done.wait()
            return
        self._check_loop()
        self._closed = True
        self._close_done = asyncio.Event()
        # A task of its own, which a cancelled caller leaves running (a host's shutdown
        # deadline, an anyio cancel scope): cancelled half-way, close released nothing,
        # and a second close() returned at once.
        self._closing = asyncio.ensure_future(self._close(timeout, self._close_done))
        await asyncio.shield(self._closing)

    async def _close(self, timeout: float | None, done: asyncio.Event) -> None:
        try:
            await self.drain(timeout)
        except TimeoutError:
            logger.warning(
                "coda-memory: close timed out with %d observation(s) pending and %d "
                "consolidation(s) running",
                self.stats().pending,
                len(self._background),
            )
        finally:
            # Each wait below is bounded: a connection that never answers (its command
            # timeout not reached yet) can't hold close() up beyond its timeout. The
            # writer's stop, the consolidations and the calls in flight share one grace,
            # counted from here (each waits for what is left of it), and the store's close
            # has its own: close() returns within timeout + 2 * CLOSE_GRACE.
            loop = asyncio.get_running_loop()
            grace_ends = loop.time() + CLOSE_GRACE

            def grace_left() -> float:
                return max(0.0, grace_ends - loop.time())

            try:
                await self._stop_writer(grace_left())
                for task in list(self._background):
                    task.cancel()
                if self._background:
                    await asyncio.wait(list(self._background), timeout=grace_left())
                await self._calls_end(grace_left())
                self._released_under_calls = self._calls_in_flight > 0
            finally:
                try:
                    # Even when this task is cancelled (the loop shutting down).
                    await self._release_store()
                finally:
                    # The counts of lines held back that no later line reported.
                    flush_held()
                    done.set()
                    await self._stop_watching_loop_end()

    async def _release_store(self) -> None:
        """Close the store, waiting at most CLOSE_GRACE."""
        try:
            await asyncio.wait_for(self.store.close(), CLOSE_GRACE)
        except TimeoutError:
            logger.warning("coda-memory: the store did not close within %.0f s", CLOSE_GRACE)

    async def __aenter__(self) -> MemoryService:
        # A closed service entered again (a second lifespan of a module-level service)
        # would run with memory off, saying so only in warnings.
        if self._closed:
            raise ServiceClosed("the memory service is closed; make a new one")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
