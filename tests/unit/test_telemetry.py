"""Tracing set-up and trace-context propagation without Ray.

OpenTelemetry's tracer provider is process-global and settable once; every test here that needs one
installs its own through the ``provider`` / ``fresh_globals`` fixtures, which put the globals (and
this module's ``_configured`` flag) back afterwards, so other tests in the process are unaffected.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.util._once import Once

from stages import telemetry
from tests.otlp_receiver import OTLPReceiver

OTEL_ENV = ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER_ARG", "OTEL_PYTHON_TRACER_PROVIDER")
REMOTE_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
REMOTE_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def fresh_globals(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No global tracer provider, tracing never configured, no OTEL_* variables; restored after."""
    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(trace, "_TRACER_PROVIDER_SET_ONCE", Once())
    monkeypatch.setattr(telemetry, "_configured", False)
    monkeypatch.setattr(telemetry, "_record_content", False)
    yield
    provider = trace._TRACER_PROVIDER
    if provider is not None and hasattr(provider, "shutdown"):
        provider.shutdown()


@pytest.fixture
def exporter(fresh_globals: None) -> InMemorySpanExporter:
    """A recording SDK provider installed as the global one, exporting to memory."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    trace.set_tracer_provider(provider)
    return memory


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    out = {s.name: s for s in spans}
    assert len(out) == len(spans), "span names are not unique"
    return out


# -- configure_tracing --------------------------------------------------------------------------------
def test_tracing_enabled_reads_settings_and_environment(fresh_globals: None, monkeypatch: pytest.MonkeyPatch) -> None:
    class Settings:
        enabled = True

    assert not telemetry.tracing_enabled(None)
    assert not telemetry.tracing_enabled({"enabled": False})
    assert telemetry.tracing_enabled({"enabled": True})
    assert telemetry.tracing_enabled(Settings())
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert telemetry.tracing_enabled(None)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    assert telemetry.tracing_enabled({"enabled": False})
    # The SDK's own kill switch wins over everything.
    monkeypatch.setenv("OTEL_SDK_DISABLED", "TRUE")
    assert not telemetry.tracing_enabled({"enabled": True})


def test_disabled_tracing_installs_nothing_and_records_nothing(fresh_globals: None) -> None:
    assert telemetry.configure_tracing({"enabled": False, "record_content": True}, component="ingress") is False
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert telemetry.record_content() is True
    with telemetry.get_tracer().start_as_current_span("x") as span:
        assert not span.is_recording()
        assert telemetry.inject() == {}
        assert telemetry.current_trace_id() is None
    # Idempotent: a later call with tracing on changes nothing in this process.
    assert telemetry.configure_tracing({"enabled": True}, component="ingress") is False
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


class _CapturingExporter(InMemorySpanExporter):
    """Stands in for the OTLP exporter: remembers the endpoint it was given."""

    endpoints: list[str] = []

    def __init__(self, endpoint: str | None = None, **_: Any) -> None:
        super().__init__()
        type(self).endpoints.append(endpoint)
        type(self).last = self


@pytest.fixture
def capture(fresh_globals: None, monkeypatch: pytest.MonkeyPatch) -> type[_CapturingExporter]:
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    monkeypatch.setattr(trace_exporter, "OTLPSpanExporter", _CapturingExporter)
    monkeypatch.setattr(_CapturingExporter, "endpoints", [])
    return _CapturingExporter


@pytest.mark.parametrize(("settings", "env", "endpoint"), [
    ({"otlp_endpoint": "http://jaeger:4318"}, {}, "http://jaeger:4318/v1/traces"),
    ({"otlp_endpoint": "http://jaeger:4318/v1/traces/"}, {}, "http://jaeger:4318/v1/traces/"),
    ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}, "http://collector:4318/v1/traces"),
    ({}, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, "http://c:4318/v1/traces"),
    ({"otlp_endpoint": "http://mine:4318"}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318"},
     "http://mine:4318/v1/traces"),
], ids=["setting", "setting-full", "env-base", "env-traces", "setting-over-env"])
def test_enabled_tracing_resolves_the_otlp_endpoint(capture: type[_CapturingExporter],
                                                    monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any],
                                                    env: dict[str, str], endpoint: str) -> None:
    for name, val in env.items():
        monkeypatch.setenv(name, val)
    assert telemetry.configure_tracing({"enabled": True, **settings}, component="engine") is True
    assert capture.endpoints == [endpoint]


def test_enabled_tracing_exports_spans_with_the_component(capture: type[_CapturingExporter],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-llm")
    assert telemetry.configure_tracing({"enabled": True, "otlp_endpoint": "http://x:4318"}, component="egress")
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    assert telemetry.record_content() is False
    with telemetry.get_tracer().start_as_current_span("work", attributes={"lifecycle.request_id": "r1"}) as span:
        assert span.is_recording()
        assert telemetry.current_trace_id() == format(span.get_span_context().trace_id, "032x")
    provider.force_flush()
    (exported,) = capture.last.get_finished_spans()
    assert exported.name == "work"
    assert exported.attributes["lifecycle.request_id"] == "r1"
    assert exported.resource.attributes["lifecycle.component"] == "egress"
    assert exported.resource.attributes["service.name"] == "my-llm"
    # Idempotent: configuring again keeps the first provider and says tracing is on.
    assert telemetry.configure_tracing({"enabled": True}, component="other") is True
    assert trace.get_tracer_provider() is provider
    assert len(capture.endpoints) == 1


def test_sampling_ratio_zero_still_follows_a_sampled_parent(capture: type[_CapturingExporter]) -> None:
    telemetry.configure_tracing({"enabled": True, "otlp_endpoint": "http://x:4318", "sampling_ratio": 0.0},
                                component="ingress")
    tracer = telemetry.get_tracer()
    with tracer.start_as_current_span("root") as root:
        assert not root.is_recording()  # ratio 0: a new trace is dropped
    sampled = {"traceparent": f"00-{REMOTE_TRACE}-{REMOTE_SPAN}-01"}
    with telemetry.span_from_context(tracer, "child", sampled) as child:
        assert child.is_recording()  # the caller sampled it: parent-based
    unsampled = {"traceparent": f"00-{REMOTE_TRACE}-{REMOTE_SPAN}-00"}
    with telemetry.span_from_context(tracer, "child2", unsampled) as child2:
        assert not child2.is_recording()


def test_enabled_tracing_reaches_a_real_otlp_receiver(fresh_globals: None) -> None:
    receiver = OTLPReceiver()
    try:
        assert telemetry.configure_tracing({"enabled": True, "otlp_endpoint": receiver.endpoint},
                                           component="preprocess")
        tracer = telemetry.get_tracer()
        with tracer.start_as_current_span("parent") as parent:
            carrier = telemetry.inject()
        with telemetry.span_from_context(tracer, "child", carrier, {"k": "v"}):
            pass
        assert trace.get_tracer_provider().force_flush(10_000)
        trace_id = format(parent.get_span_context().trace_id, "032x")
        deadline = time.monotonic() + 10
        while len(receiver.trace(trace_id)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        spans = {s.name: s for s in receiver.trace(trace_id)}
        assert set(spans) == {"parent", "child"}
        assert spans["child"].parent_span_id == spans["parent"].span_id
        assert spans["child"].attributes == {"k": "v"}
        assert spans["child"].resource["lifecycle.component"] == "preprocess"
    finally:
        receiver.close()


# -- propagation --------------------------------------------------------------------------------------
def test_inject_extract_round_trip(exporter: InMemorySpanExporter) -> None:
    tracer = telemetry.get_tracer()
    with tracer.start_as_current_span("ingress") as span:
        ctx = span.get_span_context()
        carrier = telemetry.inject()
    assert carrier == {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"}
    assert ctx.trace_flags.sampled
    remote = trace.get_current_span(telemetry.extract(carrier)).get_span_context()
    assert (remote.trace_id, remote.span_id, remote.is_remote) == (ctx.trace_id, ctx.span_id, True)
    assert remote.trace_flags.sampled


def test_inject_an_explicit_span_that_is_not_current(exporter: InMemorySpanExporter) -> None:
    tracer = telemetry.get_tracer()
    span = tracer.start_span("detached")
    try:
        assert telemetry.inject() == {}  # nothing current
        ctx = span.get_span_context()
        assert telemetry.inject(span) == {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"}
    finally:
        span.end()


@pytest.mark.parametrize("carrier", [None, {}, {"traceparent": "garbage"}, {"traceparent": "00-" + "0" * 32
                                                                             + "-" + "0" * 16 + "-01"}])
def test_extract_of_nothing_or_garbage_is_an_empty_context(carrier: dict[str, str] | None) -> None:
    assert not trace.get_current_span(telemetry.extract(carrier)).get_span_context().is_valid


def test_span_from_context_parents_on_the_carrier(exporter: InMemorySpanExporter) -> None:
    tracer = telemetry.get_tracer()
    carrier = {"traceparent": f"00-{REMOTE_TRACE}-{REMOTE_SPAN}-01"}
    with telemetry.span_from_context(tracer, "preprocess", carrier, {"lifecycle.request_id": "r1"},
                                     kind=SpanKind.SERVER) as span:
        assert trace.get_current_span() is span
        assert telemetry.current_trace_id() == REMOTE_TRACE
        # What this stage passes on names this span as the parent.
        assert telemetry.inject()["traceparent"] == f"00-{REMOTE_TRACE}-{span.get_span_context().span_id:016x}-01"
    assert trace.get_current_span() is not span
    (done,) = exporter.get_finished_spans()
    assert done.name == "preprocess"
    assert format(done.context.trace_id, "032x") == REMOTE_TRACE
    assert format(done.parent.span_id, "016x") == REMOTE_SPAN
    assert done.parent.is_remote
    assert done.kind == SpanKind.SERVER
    assert done.attributes["lifecycle.request_id"] == "r1"


def test_span_from_an_empty_carrier_starts_a_new_trace(exporter: InMemorySpanExporter) -> None:
    tracer = telemetry.get_tracer()
    with tracer.start_as_current_span("unrelated-current"):
        # The carrier, not whatever happens to be current, decides the parent.
        with telemetry.span_from_context(tracer, "root", {}):
            pass
    spans = by_name(exporter.get_finished_spans())
    assert spans["root"].parent is None
    assert spans["root"].context.trace_id != spans["unrelated-current"].context.trace_id


def test_span_from_context_ends_the_span_on_error(exporter: InMemorySpanExporter) -> None:
    with pytest.raises(RuntimeError):
        with telemetry.span_from_context(telemetry.get_tracer(), "boom", {}):
            raise RuntimeError("x")
    (done,) = exporter.get_finished_spans()
    assert done.end_time is not None
    assert not done.status.is_ok
    assert [e.name for e in done.events] == ["exception"]


# -- timing -------------------------------------------------------------------------------------------
def test_mono_to_ns_converts_through_the_given_clocks() -> None:
    now_ns = 1_700_000_000_000_000_000
    assert telemetry.mono_to_ns(100.0, now_mono=102.5, now_ns=now_ns) == now_ns - 2_500_000_000
    assert telemetry.mono_to_ns(102.5, now_mono=102.5, now_ns=now_ns) == now_ns
    assert telemetry.mono_to_ns(103.0, now_mono=102.5, now_ns=now_ns) == now_ns + 500_000_000
    # Earlier stamps map to earlier wall times.
    stamps = [telemetry.mono_to_ns(m, now_mono=10.0, now_ns=now_ns) for m in (1.0, 2.0, 9.999)]
    assert stamps == sorted(stamps)


def test_mono_to_ns_defaults_to_the_process_clocks() -> None:
    mono, wall = time.monotonic(), time.time_ns()
    assert abs(telemetry.mono_to_ns(mono) - wall) < 50_000_000
    assert abs(telemetry.mono_to_ns(mono - 2.0) - (wall - 2_000_000_000)) < 50_000_000


def test_emit_timed_children_back_to_back_ending_at_end(exporter: InMemorySpanExporter) -> None:
    tracer = telemetry.get_tracer()
    end_ns = 1_700_000_000_000_000_000
    with tracer.start_as_current_span("preprocess") as parent:
        telemetry.emit_timed_children(parent, [("chat_template", 0.002), ("skipped", None), ("tokenize", 0.003)],
                                      end_ns=end_ns)
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"preprocess", "chat_template", "tokenize"}
    template, tokenize = spans["chat_template"], spans["tokenize"]
    parent_id = spans["preprocess"].context.span_id
    assert template.parent.span_id == tokenize.parent.span_id == parent_id
    assert template.context.trace_id == spans["preprocess"].context.trace_id
    assert (template.start_time, template.end_time) == (end_ns - 5_000_000, end_ns - 3_000_000)
    assert (tokenize.start_time, tokenize.end_time) == (end_ns - 3_000_000, end_ns)


def test_emit_timed_children_default_end_is_now(exporter: InMemorySpanExporter) -> None:
    with telemetry.get_tracer().start_as_current_span("p") as parent:
        before = time.time_ns()
        telemetry.emit_timed_children(parent, [("a", 0.01), ("b", 0.02)])
        after = time.time_ns()
    spans = by_name(exporter.get_finished_spans())
    assert before <= spans["b"].end_time <= after
    assert spans["a"].end_time == spans["b"].start_time
    assert spans["b"].end_time - spans["a"].start_time == 30_000_000


def test_emit_timed_children_emits_nothing_without_parts_or_recording(exporter: InMemorySpanExporter) -> None:
    tracer = telemetry.get_tracer()
    with tracer.start_as_current_span("p") as parent:
        telemetry.emit_timed_children(parent, [("a", None), ("b", None)])
        telemetry.emit_timed_children(parent, [])
    telemetry.emit_timed_children(trace.INVALID_SPAN, [("a", 0.1)])
    assert [s.name for s in exporter.get_finished_spans()] == ["p"]
