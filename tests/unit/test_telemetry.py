"""OpenTelemetry: spans and metrics with ``telemetry=``, nothing at all without it.

The SDK's in-memory span exporter and metric reader receive what a service records.
Global providers can be set once per process, so the tests of the global path run in a
subprocess.
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from opentelemetry.metrics import (
    Histogram,
    Meter,
    NoOpHistogram,
    NoOpMeter,
    NoOpMeterProvider,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coda_memory import MemoryService
from coda_memory.telemetry import LOAD_DURATION_BUCKETS, NoTelemetry, Telemetry
from tests.helpers import FakeClock, tool_ok


def _metrics(reader: InMemoryMetricReader) -> dict[str, Any]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        metric.name: metric.data
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }


def _value(metrics: dict[str, Any], name: str) -> Any:
    (point,) = metrics[name].data_points
    return point.value


async def test_spans_and_metrics_of_a_service_with_telemetry(clock: FakeClock) -> None:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    telemetry = Telemetry(
        tracer_provider=tracer_provider, meter_provider=MeterProvider(metric_readers=[reader])
    )
    service = MemoryService.from_url(
        "memory://", clock=clock, load_timeout=5.0, telemetry=telemetry
    )
    try:
        for tool in ("get_account", "run_sql", "get_contract"):
            service.emit_observation("alice", tool_ok(tool))
        await service.drain()
        loaded = await service.load_memory("alice")
    finally:
        await service.close()

    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {
        "coda_memory.append",
        "coda_memory.load_memory",
        "coda_memory.consolidate",
    }
    assert spans["coda_memory.append"].attributes == {"coda_memory.batch": 3}
    load, consolidate = spans["coda_memory.load_memory"], spans["coda_memory.consolidate"]
    assert load.attributes == {"coda_memory.outcome": "ok", "coda_memory.facts": 3}
    assert consolidate.parent is not None
    assert consolidate.parent.span_id == load.context.span_id
    assert consolidate.attributes == {"coda_memory.facts": len(loaded.facts)}
    assert all("alice" not in str(span.attributes) for span in spans.values())

    metrics = _metrics(reader)
    assert _value(metrics, "coda_memory.observations.emitted") == 3
    assert _value(metrics, "coda_memory.observations.stored") == 3
    assert _value(metrics, "coda_memory.observations.pending") == 0
    assert _value(metrics, "coda_memory.observations.dropped") == 0
    assert _value(metrics, "coda_memory.loads") == 1
    assert _value(metrics, "coda_memory.load_timeouts") == 0
    (latency,) = metrics["coda_memory.load_memory.duration"].data_points
    assert latency.count == 1
    assert dict(latency.attributes) == {"coda_memory.outcome": "ok"}
    assert 0 < latency.sum < 5


class UniqueViolation(Exception):
    """A driver error whose message quotes the row, as asyncpg's DETAIL does."""


async def test_a_span_that_ends_in_an_error_records_its_class_only(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    service = MemoryService.from_url(
        "memory://",
        clock=clock,
        load_timeout=5.0,
        telemetry=Telemetry(tracer_provider=tracer_provider),
    )
    quoted = "Key (identity_id, subject)=(alice@example.com, tool_affinity:x) already exists."

    def failing(identity_id: str) -> Any:
        raise UniqueViolation(f"duplicate key value\nDETAIL:  {quoted}")

    try:
        service.emit_observation("alice@example.com", tool_ok("get_account"))
        await service.drain()
        monkeypatch.setattr(service.store, "consolidation", failing)
        with pytest.raises(UniqueViolation):
            await service.consolidate("alice@example.com")
    finally:
        await service.close()

    (span,) = [s for s in exporter.get_finished_spans() if s.name == "coda_memory.consolidate"]
    assert (span.status.status_code.name, span.status.description) == (
        "ERROR",
        "UniqueViolation",
    )
    assert span.attributes is not None
    assert span.attributes["error.type"] == f"{__name__}.UniqueViolation"
    assert span.events == ()  # no exception event, whose message would quote the row
    assert "alice" not in str(span.to_json())


GLOBAL_PROVIDERS = """
import asyncio
import sys

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coda_memory import MemoryService, NewObservation, ObservationType

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))


def names():
    data = reader.get_metrics_data()
    return sorted(
        m.name for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics
    ) if data else []


kept = []  # a service's counters are read while it is alive (held weakly)


async def use(**options):
    service = MemoryService.from_url("memory://", load_timeout=5.0, **options)
    kept.append(service)
    obs = NewObservation(
        type=ObservationType.TOOL_SUCCESS, content="ok", metadata={"toolName": "get_account"}
    )
    service.emit_observation("alice", obs)
    await service.drain()
    await service.load_memory("alice")
    await service.close()


asyncio.run(use())
print("off:", len(exporter.get_finished_spans()), names())
asyncio.run(use(telemetry=True))
print("on:", len(exporter.get_finished_spans()), len(names()))
"""

WITHOUT_OTEL = """
import asyncio
import sys

from coda_memory import MemoryService


async def use():
    async with MemoryService.from_url("memory://") as service:
        await service.load_memory("alice")


asyncio.run(use())
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""


def _python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_without_telemetry_nothing_is_recorded_even_with_global_providers() -> None:
    out = _python(GLOBAL_PROVIDERS).splitlines()

    assert out[0] == "off: 0 []"
    spans, instruments = out[1].removeprefix("on: ").split()
    assert int(spans) == 3  # append, load_memory, consolidate: telemetry=True uses them
    assert int(instruments) == 18


def test_without_telemetry_opentelemetry_is_never_imported() -> None:
    assert _python(WITHOUT_OTEL).strip() == "[]"


def _providers() -> tuple[InMemorySpanExporter, InMemoryMetricReader, Telemetry]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    telemetry = Telemetry(
        tracer_provider=tracer_provider, meter_provider=MeterProvider(metric_readers=[reader])
    )
    return exporter, reader, telemetry


async def test_the_writer_does_not_run_in_the_request_that_started_it(clock: FakeClock) -> None:
    """The writer started inside the first request's span and kept its context: every
    append span of the service's life was a child of that request (and none was recorded
    when that request was not sampled)."""
    exporter, _, telemetry = _providers()
    tracer = TracerProvider().get_tracer("host")
    service = MemoryService.from_url("memory://", clock=clock, telemetry=telemetry)
    try:
        for request in range(3):
            with tracer.start_as_current_span(f"request-{request}"):
                service.emit_observation("alice", tool_ok("get_account"))
            await service.drain()
    finally:
        await service.close()
    appends = [s for s in exporter.get_finished_spans() if s.name == "coda_memory.append"]
    assert len(appends) == 3
    assert all(span.parent is None for span in appends)


async def test_every_service_reports_its_own_counts(clock: FakeClock) -> None:
    """Two services on one meter (one per event loop, or one made again after close()):
    the second one's counts were never read, the first's reported in their place."""
    _, reader, telemetry = _providers()
    first = MemoryService.from_url("memory://", clock=clock, telemetry=telemetry)
    second = MemoryService.from_url("memory://", clock=clock, telemetry=telemetry)
    try:
        for _ in range(5):
            first.emit_observation("alice", tool_ok("get_account"))
        second.emit_observation("bob", tool_ok("get_account"))
        await first.drain()
        await second.drain()
    finally:
        await first.close()
        await second.close()
    points = _metrics(reader)["coda_memory.observations.stored"].data_points
    by_service = {point.attributes["coda_memory.service"]: point.value for point in points}
    assert sorted(by_service.values()) == [1, 5]


def test_telemetry_none_is_off_and_a_wrong_value_is_named() -> None:
    service = MemoryService.from_url("memory://", telemetry=None)
    assert isinstance(service._telemetry, NoTelemetry)
    with pytest.raises(TypeError, match="telemetry must be True, False, None"):
        MemoryService.from_url("memory://", telemetry="yes")


async def test_the_writer_starts_under_a_task_factory_of_the_older_form(
    clock: FakeClock,
) -> None:
    """A host's task factory that takes (loop, coro) only refused the writer's
    create_task(..., context=...): nothing was stored."""
    loop = asyncio.get_running_loop()
    loop.set_task_factory(lambda loop, coro: asyncio.Task(coro, loop=loop))
    try:
        service = MemoryService.from_url("memory://", clock=clock)
        try:
            service.emit_observation("alice", tool_ok("get_account"))
            await service.drain()
            assert (service.stats().stored, service.stats().rejected) == (1, 0)
        finally:
            await service.close()
    finally:
        loop.set_task_factory(None)


BEFORE_THE_PROVIDER = """
import asyncio

from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from coda_memory import MemoryService, NewObservation, ObservationType

OBS = NewObservation(
    type=ObservationType.TOOL_SUCCESS, content="ok", metadata={"toolName": "get_account"}
)


async def main():
    first = MemoryService.from_url("memory://", telemetry=True)  # made at import time
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))  # then at startup
    second = MemoryService.from_url("memory://", telemetry=True)
    first.emit_observation("alice", OBS)
    for _ in range(2):
        second.emit_observation("bob", OBS)
    for service in (first, second):
        await service.drain()
    data = reader.get_metrics_data()
    points = [
        point.value
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "coda_memory.observations.stored"
        for point in metric.data.data_points
    ]
    print(sorted(points))
    for service in (first, second):
        await service.close()


asyncio.run(main())
"""


def test_services_made_before_the_host_sets_its_provider_report_their_own_counts() -> None:
    """Before the global provider is set, every get_meter gave a new proxy meter: each
    service made its own instruments, which became the same instruments once the
    provider was set, and only the first service's counts were read."""
    assert _python(BEFORE_THE_PROVIDER).strip() == "[1, 2]"


async def test_a_cancelled_load_is_recorded_as_cancelled_not_as_an_error(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that goes away cancels its load: the span ends unset (OpenTelemetry's own
    rule: a cancellation is not an error), with the outcome ``cancelled``, and the
    duration histogram records it, so that its count still equals the loads."""
    exporter, reader, telemetry = _providers()
    service = MemoryService.from_url(
        "memory://", clock=clock, load_timeout=5.0, telemetry=telemetry
    )
    entered, released = asyncio.Event(), asyncio.Event()
    peek = service.store.peek

    async def blocked(identity_id: str) -> Any:
        entered.set()
        await released.wait()  # the load behind the caller's goes on after the cancel
        return await peek(identity_id)

    try:
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain()
        await service.load_memory("alice")  # one load that ends ok
        service.emit_observation("alice", tool_ok("run_sql"))
        await service.drain()
        monkeypatch.setattr(service.store, "peek", blocked)
        load = asyncio.ensure_future(service.load_memory("alice"))
        await entered.wait()
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        released.set()
    finally:
        await service.close()

    loads = [s for s in exporter.get_finished_spans() if s.name == "coda_memory.load_memory"]
    assert [s.attributes["coda_memory.outcome"] for s in loads if s.attributes] == [
        "ok",
        "cancelled",
    ]
    assert [s.status.status_code.name for s in loads] == ["UNSET", "UNSET"]
    assert all("error.type" not in (s.attributes or {}) for s in loads)
    histogram = _metrics(reader)["coda_memory.load_memory.duration"]
    counts = {p.attributes["coda_memory.outcome"]: p.count for p in histogram.data_points}
    assert counts == {"ok": 1, "cancelled": 1}
    assert service.stats().loads == 2


async def test_load_durations_fall_in_buckets_of_seconds(clock: FakeClock) -> None:
    """The histogram is in seconds: its boundaries are too, so a load of a few
    milliseconds and one near the timeout land in different buckets (the SDK's default
    boundaries, 0, 5, 10, ... meant for milliseconds, would put both in the first)."""
    _, reader, telemetry = _providers()
    service = MemoryService.from_url(
        "memory://", clock=clock, load_timeout=5.0, telemetry=telemetry
    )
    try:
        await service.load_memory("alice")
    finally:
        await service.close()
    (point,) = _metrics(reader)["coda_memory.load_memory.duration"].data_points
    if (
        "explicit_bucket_boundaries_advisory"
        not in inspect.signature(Meter.create_histogram).parameters
    ):
        # opentelemetry-api before 1.30 (the otel extra's floor is 1.25) takes no advice:
        # the SDK's defaults stay, as the README says.
        assert point.explicit_bounds[:3] == (0.0, 5.0, 10.0)
        return
    assert tuple(point.explicit_bounds) == LOAD_DURATION_BUCKETS
    assert point.explicit_bounds[0] <= 0.001 and 0.1 in point.explicit_bounds
    # The load took well under a second: it sits in a bucket below the 100 ms timeout.
    assert sum(point.bucket_counts[: point.explicit_bounds.index(0.1) + 1]) == 1


class _FailingProcessor(SimpleSpanProcessor):
    """A host's span processor that raises as a span starts or ends (its exporter
    misconfigured)."""

    def __init__(self, when: str) -> None:
        super().__init__(InMemorySpanExporter())
        self.when = when

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.when == "start":
            raise RuntimeError("exporter misconfigured")

    def on_end(self, span: Any) -> None:
        if self.when == "end":
            raise RuntimeError("exporter misconfigured")


@pytest.mark.parametrize("when", ["start", "end"])
async def test_a_span_processor_that_raises_fails_no_call(
    clock: FakeClock, when: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK calls the host's span processors as spans start and end, and lets their
    errors through: load_memory raised one (it never raises), consolidate and the
    writer's appends failed for telemetry. The spans go unrecorded instead, with a line
    that names the error's class."""
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(_FailingProcessor(when))
    telemetry = Telemetry(tracer_provider=tracer_provider)
    service = MemoryService.from_url(
        "memory://", clock=clock, load_timeout=5.0, telemetry=telemetry
    )
    try:
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain()
        loaded = await service.load_memory("alice")
        assert [f.subject for f in await service.consolidate("alice")] == [
            "tool_affinity:get_account"
        ]
    finally:
        await service.close()
    assert [f.subject for f in loaded.facts] == ["tool_affinity:get_account"]
    stats = service.stats()
    assert (stats.stored, stats.load_errors, stats.load_stale) == (1, 0, 0)
    assert "span failed (RuntimeError); not recorded" in caplog.text
    assert "misconfigured" not in caplog.text and "alice" not in caplog.text


class _FailingHistogram(NoOpHistogram):
    """A host's histogram whose recording raises (an SDK's exemplar filter that raises, a
    misconfigured exporter's hook): the SDK lets such an error through to the caller."""

    def record(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("filter misconfigured")


class _FailingMeter(NoOpMeter):
    def create_histogram(self, name: str, *args: Any, **kwargs: Any) -> Histogram:
        return _FailingHistogram(name)


class _FailingMeterProvider(NoOpMeterProvider):
    def get_meter(self, name: str, *args: Any, **kwargs: Any) -> Meter:
        return _FailingMeter(name)


async def test_a_measurement_that_fails_fails_no_load(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """load_memory recorded its duration after its answer was made, and raised the
    meter's error (it never raises)."""
    meter_provider = _FailingMeterProvider()
    telemetry = Telemetry(tracer_provider=TracerProvider(), meter_provider=meter_provider)
    service = MemoryService.from_url(
        "memory://", clock=clock, load_timeout=5.0, telemetry=telemetry
    )
    try:
        service.emit_observation("alice", tool_ok("get_account"))
        await service.drain()
        loaded = await service.load_memory("alice")
    finally:
        await service.close()
    assert [f.subject for f in loaded.facts] == ["tool_affinity:get_account"]
    assert service.stats().load_errors == 0
    assert "measurement failed (RuntimeError); not recorded" in caplog.text
    assert "misconfigured" not in caplog.text
