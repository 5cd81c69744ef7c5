"""Tracing set-up (OpenTelemetry over OTLP/HTTP) and trace-context propagation between stages.

Every stage calls :func:`configure_tracing` once per process. With tracing off the global tracer
provider stays OpenTelemetry's no-op one, so spans cost a function call and nothing is exported.
Configuration follows the standard variables (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER_ARG``) and
can be overridden from ``serve_config.yaml``.

Context crosses deployments as a W3C ``traceparent`` carrier dict inside the request message (only
plain data crosses a boundary). Stages that learn their timings after the fact (the engine) emit
spans retroactively with explicit start and end times converted from monotonic stamps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_configured = False
_record_content = False
TRACER_NAME = "lifecycle-serve"


def _setting(settings: Any, name: str, default: Any = None) -> Any:
    if settings is None:
        return default
    if isinstance(settings, Mapping):
        return settings.get(name, default)
    return getattr(settings, name, default)


def tracing_enabled(settings: Any) -> bool:
    """Tracing is on when the config says so or an OTLP endpoint is set in the environment."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return bool(_setting(settings, "enabled", False)) or bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure_logging(level: int = logging.INFO) -> None:
    """Send this project's ``lifecycle.*`` records to stderr, whatever level Ray Serve's own logger
    runs at (throughput-optimised Serve keeps replica logs quiet). Ray writes each replica's stderr
    to ``logs/worker-*.err`` and ``serve run`` shows it. Idempotent."""
    root = logging.getLogger("lifecycle")
    root.setLevel(level)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        root.addHandler(handler)
        root.propagate = False


def configure_tracing(settings: Any, component: str) -> bool:
    """Install an OTLP-exporting tracer provider in this process if tracing is enabled.

    Idempotent. Returns whether tracing is on. ``component`` becomes a resource attribute so a
    trace shows which stage (process) each span came from.
    """
    global _configured, _record_content
    if _configured:
        return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    _configured = True
    _record_content = bool(_setting(settings, "record_content", False))
    if not tracing_enabled(settings):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    endpoint = _setting(settings, "otlp_endpoint") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if endpoint is None and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        endpoint = os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    elif endpoint is not None and not endpoint.rstrip("/").endswith("/v1/traces"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    ratio = _setting(settings, "sampling_ratio", None)
    if ratio is None:
        ratio = float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
    service = os.environ.get("OTEL_SERVICE_NAME") or _setting(settings, "service_name", "lifecycle-serve")
    resource = Resource.create({"service.name": service, "lifecycle.component": component,
                                "process.pid": os.getpid()})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(float(ratio))))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint),
                                                   schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    logger.info("tracing on: component=%s endpoint=%s ratio=%s", component, endpoint, ratio)
    return True


def record_content() -> bool:
    """Whether prompt/completion text may be put on spans (off unless explicitly enabled)."""
    return _record_content


def get_tracer() -> Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject(span: Span | None = None) -> dict[str, str]:
    """A ``traceparent`` carrier for ``span`` (or the current context); empty when not recording."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> otel_context.Context:
    return _PROPAGATOR.extract(dict(carrier or {}))


@contextlib.contextmanager
def span_from_context(tracer: Tracer, name: str, carrier: Mapping[str, str] | None,
                      attributes: dict[str, Any] | None = None,
                      kind: SpanKind = SpanKind.INTERNAL) -> Iterator[Span]:
    """Start ``name`` as a child of the context in ``carrier`` and make it current."""
    ctx = extract(carrier)
    with tracer.start_as_current_span(name, context=ctx, kind=kind, attributes=attributes) as span:
        yield span


def mono_to_ns(mono: float, now_mono: float | None = None, now_ns: int | None = None) -> int:
    """Convert a ``time.monotonic()`` stamp of this process into epoch nanoseconds."""
    now_mono = time.monotonic() if now_mono is None else now_mono
    now_ns = time.time_ns() if now_ns is None else now_ns
    return now_ns - int((now_mono - mono) * 1e9)


def emit_timed_children(parent: Span, parts: list[tuple[str, float | None]], end_ns: int | None = None) -> None:
    """Emit back-to-back child spans of ``parent`` with the given durations, ending at ``end_ns``."""
    parts = [(n, d) for n, d in parts if d is not None]
    if not parts or not parent.is_recording():
        return
    end = time.time_ns() if end_ns is None else end_ns
    start = end - int(sum(d for _, d in parts) * 1e9)
    ctx = trace.set_span_in_context(parent)
    tracer = get_tracer()
    for name, duration in parts:
        stop = start + int(duration * 1e9)
        tracer.start_span(name, context=ctx, start_time=start).end(end_time=stop)
        start = stop


def current_trace_id() -> str | None:
    """Hex trace id of the current span, if one is recording."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
