"""Engine spans, built after the fact from a request's own monotonic timestamps.

When a request leaves the engine, one ``engine`` span (child of the trace context the request
carried in) is emitted with children ``queue`` (arrival to first scheduling), ``prefill`` (first
scheduling to first token, an event per chunk) and ``decode`` (first token to finish, with step
and token counts and events for preemption and resumption), plus an ``abort`` event when aborted.
Nothing here runs per step, so tracing costs the step loop nothing.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace

from stages.engine.core.request import EventType, Request, RequestStatus
from stages.telemetry import extract, get_tracer, mono_to_ns


class EngineTracer:
    """``LLMEngine.on_finish`` hook that emits the request's engine spans."""

    def __init__(self) -> None:
        self.num_traced = 0

    def on_finish(self, req: Request) -> None:
        carrier = req.trace
        if not carrier:
            return
        tracer = get_tracer()
        now_mono, now_ns = time.monotonic(), time.time_ns()

        def ns(mono: float) -> int:
            return mono_to_ns(mono, now_mono, now_ns)

        finished = req.last_event(EventType.FINISHED) or now_mono
        attrs: dict[str, Any] = {"lifecycle.request_id": req.request_id,
                 "gen_ai.request.max_tokens": req.params.max_tokens,
                 "gen_ai.usage.input_tokens": req.num_prompt_tokens,
                 "gen_ai.usage.output_tokens": req.num_output_tokens,
                 "gen_ai.response.finish_reasons": [req.finish_reason or "abort"],
                 "lifecycle.cached_tokens": max(req.num_cached_tokens, 0),
                 "lifecycle.preemptions": req.num_preemptions}
        if req.grammar is not None:
            attrs["lifecycle.structured_output"] = req.grammar.kind
        if req.route is not None:
            attrs.update({f"lifecycle.route.{k}": v for k, v in req.route.attributes().items()})
        root = tracer.start_span("engine", context=extract(carrier), start_time=ns(req.arrival_time),
                                 attributes=attrs)
        if not root.is_recording():
            root.end(end_time=ns(finished))
            return
        ctx = trace.set_span_in_context(root)
        scheduled = req.first_event(EventType.SCHEDULED)
        first = req.first_event(EventType.FIRST_TOKEN)
        tracer.start_span("queue", context=ctx, start_time=ns(req.arrival_time)).end(
            end_time=ns(scheduled if scheduled is not None else finished))
        if scheduled is not None:
            prefill = tracer.start_span("prefill", context=ctx, start_time=ns(scheduled))
            for ev in req.events:
                if ev.type is EventType.PREFILL_CHUNK and (first is None or ev.timestamp <= first):
                    prefill.add_event("chunk", dict(ev.data or {}), timestamp=ns(ev.timestamp))
            prefill.set_attribute("lifecycle.cached_tokens", max(req.num_cached_tokens, 0))
            prefill.end(end_time=ns(first if first is not None else finished))
        if first is not None:
            steps = sum(1 for e in req.events if e.type is EventType.DECODE_STEP)
            decode = tracer.start_span("decode", context=ctx, start_time=ns(first),
                                       attributes={"lifecycle.decode_steps": steps,
                                                   "gen_ai.usage.output_tokens": req.num_output_tokens})
            for ev in req.events:
                if ev.type in (EventType.PREEMPTED, EventType.RESUMED) and ev.timestamp >= first:
                    decode.add_event(ev.type.value, timestamp=ns(ev.timestamp))
            decode.end(end_time=ns(finished))
        if req.status is RequestStatus.FINISHED_ABORTED:
            root.add_event("abort", {"reason": "stream_cancelled"}, timestamp=ns(finished))
        root.end(end_time=ns(finished))
        self.num_traced += 1
