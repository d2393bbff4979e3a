"""OpenTelemetry traces and metrics, off unless a service is given ``telemetry=``.

With the ``otel`` extra installed (``pip install 'coda-memory[otel]'``, the API only; the
host brings the SDK and exporters) and ``MemoryService(..., telemetry=True)`` (the
global providers) or ``telemetry=Telemetry(tracer_provider=..., meter_provider=...)``,
a service records:

- spans ``coda_memory.load_memory``, ``coda_memory.consolidate`` and
  ``coda_memory.append`` (one per attempt of the background writer to store a batch:
  a batch it retries has one for each try);
- a histogram ``coda_memory.load_memory.duration`` (seconds, on the boundaries of
  :data:`LOAD_DURATION_BUCKETS`; attribute ``coda_memory.outcome``: ``ok``, ``stale``,
  ``timeout``, ``error``, or ``cancelled`` when the caller cancelled the load);
- observable counters for the :meth:`~coda_memory.MemoryService.stats` counters, one per
  entry of ``_COUNTERS`` (``coda_memory.observations.emitted``, ``.stored``,
  ``.rejected``, ``.dropped``, ``.discarded``, ``coda_memory.loads``,
  ``coda_memory.load_timeouts``, ``coda_memory.load_errors``, ``coda_memory.load_stale``,
  the rollups owed and folded, the keys spilled, the peeks and consolidations held out)
  and an up-down counter
  ``coda_memory.observations.pending``, read from ``stats()`` when the host's reader
  collects, so the hot path does no metric work. Each service's counts carry the
  attribute ``coda_memory.service``, a number per service in the process (the instruments
  are made once per meter, so that a second service, one per event loop or one made
  again after ``close()``, reports its own counts). A closed service's last counts are
still read (a host's final export comes after it closed) until it is garbage-collected:
the instruments hold it weakly.

The background writer's ``append`` spans are root spans: the writer runs on its own, not
inside the request that happened to start it. Identity ids are never attributes (they may
identify people), and a span that ends in an error records its class only (status
``ERROR`` with the class's name, attribute ``error.type``): a driver's message may quote
an identity or a row (``Key (identity_id, subject)=(…)``, ``Failing row contains (…)``),
which OpenTelemetry's default would put in the span's status and an ``exception`` event.
A span whose task was cancelled is not an error (as OpenTelemetry's own ``use_span`` has
it): its status stays unset.
Without ``telemetry=`` coda-memory imports nothing from OpenTelemetry
and records nothing (a driver may import it on its own: redis-py does when the SDK is
installed).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from coda_memory.core.caps import LogThrottle

if TYPE_CHECKING:
    from coda_memory.stats import MemoryStats

INSTRUMENTATION = "coda_memory"

#: The boundaries of the load duration histogram, in seconds: fine around the default
#: ``load_timeout`` (0.1 s), where a host tells a slow load from one that timed out.
LOAD_DURATION_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.035, 0.05, 0.075, 0.1),
    *(0.125, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0),
)

#: stats() field -> (instrument name, description); all are monotonic counts.
_COUNTERS = {
    "emitted": ("coda_memory.observations.emitted", "Observations passed to emit_observation"),
    "stored": ("coda_memory.observations.stored", "Observations the store accepted"),
    "rejected": ("coda_memory.observations.rejected", "Observations refused as bad input"),
    "dropped": ("coda_memory.observations.dropped", "Observations dropped (queue full, closed)"),
    "discarded": ("coda_memory.observations.discarded", "Observations a null store threw away"),
    "loads": ("coda_memory.loads", "load_memory calls"),
    "load_timeouts": ("coda_memory.load_timeouts", "load_memory calls that timed out"),
    "load_errors": ("coda_memory.load_errors", "load_memory calls that failed"),
    "load_stale": ("coda_memory.load_stale", "load_memory calls answered from facts at hand"),
    "rollups_owed": ("coda_memory.rollups.owed", "Appends that owed their rollup (lock)"),
    "rollups_folded": ("coda_memory.rollups.folded", "Owed rollups folded in by appends"),
    "keys_spilled": ("coda_memory.keys.spilled", "Batch keys recorded in the spill table"),
    "peeks_held_out": ("coda_memory.peeks.held_out", "Peeks a held table stopped"),
    "consolidations_held_out": (
        "coda_memory.consolidations.held_out",
        "Consolidations a lock wait kept out",
    ),
    "kept_facts_dropped": (
        "coda_memory.kept_facts.dropped",
        "Facts kept between requests dropped to make room",
    ),
    "facts_reads": ("coda_memory.facts.reads", "Reads of an identity's facts from the store"),
}


class Telemetry:
    """Where a service's spans and metrics go: the given providers, else the global
    ones. Needs ``opentelemetry-api`` (the ``otel`` extra)."""

    def __init__(self, *, tracer_provider: Any = None, meter_provider: Any = None) -> None:
        try:
            from opentelemetry import metrics, trace
        except ImportError as exc:
            raise ImportError(
                "telemetry needs the otel extra: pip install 'coda-memory[otel]'"
            ) from exc
        from coda_memory import __version__

        self._error_status = functools.partial(trace.Status, trace.StatusCode.ERROR)
        self._log = LogThrottle(logging.getLogger("coda_memory"))
        self._tracer = trace.get_tracer(
            INSTRUMENTATION, __version__, tracer_provider=tracer_provider
        )
        self._meter = (
            _global_meter(__version__)
            if meter_provider is None
            else metrics.get_meter(INSTRUMENTATION, __version__, meter_provider=meter_provider)
        )
        histogram = functools.partial(
            self._meter.create_histogram,
            "coda_memory.load_memory.duration",
            unit="s",
            description="load_memory latency, consolidation included",
        )
        try:
            # In seconds: the SDK's default boundaries (0, 5, 10, 25, ...) are for
            # milliseconds and would put every load in one bucket.
            self._load_duration = histogram(
                explicit_bucket_boundaries_advisory=LOAD_DURATION_BUCKETS
            )
        except TypeError:  # an API before 1.30, which takes no advice: its defaults
            self._load_duration = histogram()

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Any]:
        """A span named ``coda_memory.<name>``; yields it, for attributes set later. An
        error ends it with its class only (see above). An error of the SDK as the span
        starts or ends (the host's span processors are called then, and the SDK lets
        their errors through) leaves the span unrecorded and the call going, with a line
        that names its class: load_memory raised it, and a batch whose append span failed
        was not stored."""
        try:
            started = self._tracer.start_as_current_span(
                f"{INSTRUMENTATION}.{name}",
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            )
            span = started.__enter__()
        except Exception as error:
            self._failed(f"the {INSTRUMENTATION}.{name} span", error)
            started = None
        if started is None:
            yield None
            return
        failure: BaseException | None = None
        try:
            yield span
        except (asyncio.CancelledError, GeneratorExit) as error:
            failure = error
            raise  # the caller gave up: not an error (as OpenTelemetry's use_span)
        except BaseException as error:
            failure = error
            kind = type(error)
            span.set_attribute("error.type", f"{kind.__module__}.{kind.__qualname__}")
            span.set_status(self._error_status(kind.__name__))
            raise
        finally:
            try:
                if failure is None:
                    started.__exit__(None, None, None)
                else:
                    started.__exit__(type(failure), failure, failure.__traceback__)
            except Exception as error:
                if error is not failure:
                    self._failed(f"the {INSTRUMENTATION}.{name} span", error)

    def _failed(self, what: str, error: Exception) -> None:
        """Log (at most once a second) that ``what`` (a span, a measurement) failed,
        naming the error's class only: its message may quote what it holds."""
        self._log.warning(
            f"telemetry failed: {type(error).__name__}",
            "coda-memory: %s failed (%s); not recorded",
            what,
            type(error).__name__,
        )

    def load_finished(self, seconds: float, outcome: str) -> None:
        try:
            self._load_duration.record(seconds, {"coda_memory.outcome": outcome})
        except Exception as error:  # (the SDK calls the host's exemplar filter here)
            self._failed("the coda_memory.load_memory.duration measurement", error)

    def observe(self, stats: Callable[[], MemoryStats]) -> None:
        """Report the counters of ``stats()`` (a service's bound method, held weakly),
        read when the host's reader collects."""
        _readings(self._meter).add(stats)


#: The services whose counters each meter reports, by meter (held weakly: a meter lives
#: as long as its provider).
_BY_METER: weakref.WeakKeyDictionary[Any, _Readings] = weakref.WeakKeyDictionary()
_BY_METER_LOCK = threading.Lock()
_SERVICE_NUMBERS = itertools.count(1)


def _readings(meter: Any) -> _Readings:
    with _BY_METER_LOCK:
        readings = _BY_METER.get(meter)
        if readings is None:
            readings = _BY_METER[meter] = _Readings(meter)
        return readings


@functools.cache
def _global_meter(version: str) -> Any:
    """The meter of the global provider, one per process: before the host sets its
    provider, each ``get_meter`` gives a new proxy, whose instruments would all become
    the same instruments of the real meter later, and only the first set reports."""
    from opentelemetry import metrics

    return metrics.get_meter(INSTRUMENTATION, version)


class _Readings:
    """The ``stats()`` of every live service that reports to one meter, behind one
    instrument per counter (an SDK gives back the first instrument of a name, and
    never calls the callbacks of a second one)."""

    def __init__(self, meter: Any) -> None:
        self._services: dict[int, weakref.WeakMethod[Callable[[], MemoryStats]]] = {}
        for field, (name, description) in _COUNTERS.items():
            meter.create_observable_counter(
                name, callbacks=[self._reading(field)], description=description
            )
        meter.create_observable_up_down_counter(
            "coda_memory.observations.pending",
            callbacks=[self._reading("pending")],
            description="Observations emitted and not yet stored, rejected or dropped",
        )

    def add(self, stats: Callable[[], MemoryStats]) -> None:
        self._services[next(_SERVICE_NUMBERS)] = weakref.WeakMethod(stats)

    def _reading(self, field: str) -> Callable[[Any], Iterator[Any]]:
        from opentelemetry.metrics import Observation

        def callback(options: Any) -> Iterator[Any]:
            for number, method in list(self._services.items()):
                stats = method()
                if stats is None:  # the service was garbage-collected
                    self._services.pop(number, None)
                    continue
                yield Observation(getattr(stats(), field), {"coda_memory.service": number})

        return callback


class NoTelemetry:
    """The default: every hook does nothing, and OpenTelemetry is never imported."""

    def span(self, name: str, **attributes: Any) -> AbstractContextManager[Any]:
        return nullcontext()

    def load_finished(self, seconds: float, outcome: str) -> None:
        return None

    def observe(self, stats: Callable[[], MemoryStats]) -> None:
        return None


def telemetry_for(option: bool | Telemetry | NoTelemetry | None) -> Telemetry | NoTelemetry:
    """The hooks a service uses for its ``telemetry=`` option (None and False: off)."""
    if option is True:
        return Telemetry()
    if option is None or option is False:
        return NoTelemetry()
    if not isinstance(option, Telemetry | NoTelemetry):
        raise TypeError(
            "telemetry must be True, False, None or a coda_memory.telemetry.Telemetry, "
            f"not {type(option).__name__}"
        )
    return option
