"""Prometheus metrics: request histograms observed in Ingress, engine gauges and counters at scrape.

Names follow vLLM's after the prefix (``lifecycle:time_to_first_token_seconds`` is
``vllm:time_to_first_token_seconds``) so existing dashboards port by changing the prefix. The
engine's gauges and counters live in each engine replica. Every replica (Ingress and Engine)
reports its series to the app's Directory; ``/metrics`` renders all of them with a ``replica``
label (:func:`render_app`), so any Ingress replica answers for the whole app.

TTFT is decomposed into the parts the server measures (see ``LiveRequest.ttft_parts``): ``prep``
(parse + template + tokenise, and the hop to Preprocess), ``hops`` (Ingress→Egress→Engine and the
first token's way back), ``queue`` and ``prefill`` (engine clock), and ``first_flush`` (framing and
the ASGI send). A non-streamed request has no first flush; there ``first_flush`` is the remainder.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "lifecycle:"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

STAGES = ("prep", "queue", "prefill", "decode", "egress")


@dataclass
class RequestRecord:
    """What Ingress knows when a request completes."""

    kind: str
    prompt_tokens: int
    completion_tokens: int
    finish_reasons: list[str]
    #: Stage durations in milliseconds, as returned to the client.
    timings_ms: dict[str, float]
    ttft_s: float | None
    itls_s: list[float] = field(default_factory=list)
    stream: bool = False
    #: Prompt tokens the engine found cached, and how many the router expected there (``None``:
    #: the request was not routed to an engine, or carried no note).
    cached_tokens: int = 0
    expected_cached_tokens: int | None = None


#: Router's error on cached prompt tokens (actual - expected): 0 is exact; negative, the router
#: expected blocks that were gone (evicted since its last summary); positive, it missed some.
_ROUTE_ERROR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096)
#: Grammar compile times: ~10 us for a cache hit, ~1-10 ms for typical schemas, up to the timeout.
_GRAMMAR_BUCKETS = (1e-5, 1e-4, 1e-3, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class IngressMetrics:
    """Metrics owned by one Ingress replica plus rendering of engine snapshots."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...], extra: list[str] | None = None) -> Histogram:
            return Histogram(PREFIX + name, doc, labels + (extra or []), buckets=buckets, registry=reg)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token, server side.", _LATENCY_BUCKETS)
        self.ttft_part = hist("time_to_first_token_part_seconds",
                              "TTFT decomposed: prep, hops, queue, prefill, first_flush.", _LATENCY_BUCKETS, ["part"])
        self.itl = hist("inter_token_latency_seconds", "Gap between streamed tokens.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency, server side.",
                        _LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time waiting in the engine queue.", _LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Time in prefill.", _LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Time in decode.", _LATENCY_BUCKETS)
        self.stage = hist("request_stage_time_seconds", "Per-stage duration of each request.",
                          _LATENCY_BUCKETS, ["stage"])
        self.prompt_len = hist("request_prompt_tokens", "Prompt length in tokens.", _TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS)
        self.success = Counter(PREFIX + "request_success_total", "Finished requests by finish reason.",
                               labels + ["finished_reason"], registry=reg)
        self.errors = Counter(PREFIX + "request_errors_total", "Requests answered with an HTTP error.",
                              labels + ["status"], registry=reg)
        self.aborts = Counter(PREFIX + "request_aborted_total", "Requests aborted before completing, by why.",
                              labels + ["reason"], registry=reg)
        self.slow_readers = Counter(PREFIX + "slow_reader_aborts_total",
                                    "Streams aborted because the client stopped reading (stream buffer full).",
                                    labels, registry=reg)
        self.egress_moves = Counter(PREFIX + "egress_moves_total",
                                    "Requests moved to another Egress replica after theirs was lost.",
                                    labels, registry=reg)
        self.prepared = Counter(PREFIX + "preprocess_requests_total",
                                "Requests templated and tokenised, by where: the Ingress itself or the Preprocess stage.",
                                labels + ["where"], registry=reg)
        self.grammar_compile = hist("grammar_compile_seconds",
                                    "Structured-output grammar compilation in Preprocess, by cache hit or miss.",
                                    _GRAMMAR_BUCKETS, ["cache"])
        self.route_error = hist("route_cached_tokens_error",
                                "Engine router's prediction of cached prompt tokens: actual minus expected.",
                                _ROUTE_ERROR_BUCKETS)
        self.route_expected = Counter(PREFIX + "route_expected_cached_tokens_total",
                                      "Prompt tokens the engine router expected cached where it sent requests.",
                                      labels, registry=reg)
        self.route_actual = Counter(PREFIX + "route_actual_cached_tokens_total",
                                    "Prompt tokens the engines found cached, for the requests the router placed.",
                                    labels, registry=reg)

    def observe_prep(self, where: str) -> None:
        """Count a prepared request by where it was templated and tokenised (``ingress``/``stage``)."""
        self.prepared.labels(self.model_name, where).inc()

    def observe_grammar(self, upstream_timings: dict[str, float]) -> None:
        """Record a request's grammar compilation (Preprocess put its time in the timings)."""
        seconds = upstream_timings.get("grammar_compile")
        if seconds is not None:
            hit = "hit" if upstream_timings.get("grammar_cache_hit") else "miss"
            self.grammar_compile.labels(self.model_name, hit).observe(seconds)

    def observe_request(self, rec: RequestRecord) -> None:
        m = self.model_name
        t = {k: v / 1000.0 for k, v in rec.timings_ms.items()}
        if rec.ttft_s is not None or not rec.stream:
            ttft = t.get("ttft", rec.ttft_s if rec.ttft_s is not None else t["prep"] + t["queue"] + t["prefill"])
            self.ttft.labels(m).observe(ttft)
            parts = {"prep": t["prep"], "queue": t["queue"], "prefill": t["prefill"]}
            if "hops" in t and "first_flush" in t:  # measured, streamed
                parts.update(hops=t["hops"], first_flush=t["first_flush"])
            else:
                parts["first_flush"] = max(ttft - sum(parts.values()), 0.0)
            for name, value in parts.items():
                self.ttft_part.labels(m, name).observe(value)
        for gap in rec.itls_s:
            self.itl.labels(m).observe(gap)
        self.e2e.labels(m).observe(t["total"])
        self.queue.labels(m).observe(t["queue"])
        self.prefill.labels(m).observe(t["prefill"])
        self.decode.labels(m).observe(t["decode"])
        for stage in STAGES:
            self.stage.labels(m, stage).observe(t[stage])
        self.prompt_len.labels(m).observe(rec.prompt_tokens)
        self.gen_len.labels(m).observe(rec.completion_tokens)
        for reason in rec.finish_reasons:
            self.success.labels(m, reason).inc()
        if rec.expected_cached_tokens is not None:
            self.route_error.labels(m).observe(rec.cached_tokens - rec.expected_cached_tokens)
            self.route_expected.labels(m).inc(rec.expected_cached_tokens)
            self.route_actual.labels(m).inc(rec.cached_tokens)

    def observe_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def observe_slow_reader(self) -> None:
        self.slow_readers.labels(self.model_name).inc()

    def observe_egress_move(self) -> None:
        self.egress_moves.labels(self.model_name).inc()

    def observe_abort(self, reason: str) -> None:
        """A request that ended without its answer; ``reason`` is its outcome (``client_gone``, ...)."""
        self.aborts.labels(self.model_name, reason).inc()
        self.success.labels(self.model_name, "abort").inc()

    def exposition(self) -> str:
        """This replica's own series, Prometheus text (what it reports to the directory)."""
        return generate_latest(self.registry).decode()


def render_app(model_name: str, ingress_texts: dict[str, str], engines: list[Any]) -> tuple[str, str]:
    """The whole app's ``/metrics``: every Ingress replica's series and every engine replica's
    gauges and counters, each labelled with its ``replica``.

    All values come from the directory's latest reports, which only move forward, so a counter
    never goes backwards between two scrapes, whichever Ingress replica answers them.
    """
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_LabelledTexts(ingress_texts))
    for report in engines:
        reg.register(_EngineCollector(model_name, report.replica, report.stats))
    return generate_latest(reg).decode(), CONTENT_TYPE_LATEST


class _LabelledTexts:
    """Re-exposes several replicas' Prometheus texts as one, adding a ``replica`` label."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def collect(self) -> Iterable[Any]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for fam in text_string_to_metric_families(text):
                merged = families.get(fam.name)
                if merged is None:
                    merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for sample in fam.samples:
                    merged.samples.append(sample._replace(labels={**sample.labels, "replica": replica}))
        yield from families.values()


class _EngineCollector:
    def __init__(self, model_name: str, replica: str, stats: dict[str, Any]) -> None:
        self.labels = ["model_name", "replica"]
        self.values = [model_name, replica]
        self.stats = stats

    def collect(self) -> Iterable[Any]:
        s, m, names = self.stats, self.values, self.labels

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=names)
            c.add_metric(m, value)
            return c

        yield gauge("num_requests_running", "Requests in the engine's running set.", s["num_running"])
        yield gauge("num_requests_waiting", "Requests in the engine's waiting queue.", s["num_waiting"])
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", s["kv_cache_usage"])
        yield gauge("num_free_kv_blocks", "KV blocks free or reclaimable.", s["num_free_blocks"])
        yield gauge("num_kv_blocks", "KV blocks in the pool.", s["num_kv_blocks"])
        yield gauge("engine_ongoing_streams", "Open request streams in the engine replica.",
                    s.get("num_streams", 0))
        yield counter("prompt_tokens", "Prompt tokens processed.", s["prompt_tokens_total"])
        yield counter("generation_tokens", "Tokens generated.", s["generation_tokens_total"])
        yield counter("num_preemptions", "Preemptions by recompute.", s["num_preemptions"])
        yield counter("prefix_cache_queries", "Prefix-cache lookups, in tokens.", s["prefix_cache_queries"])
        yield counter("prefix_cache_hits", "Prefix-cache hits, in tokens.", s["prefix_cache_hits"])
        yield counter("tokens_after_client_gone", "Tokens generated after the consumer had gone.",
                      s.get("tokens_after_gone", 0))
        yield counter("engine_rejected_overloaded", "Requests this engine refused with a full queue.",
                      s.get("rejected_overloaded", 0))
        yield counter("engine_reader_gone_aborts", "Requests aborted because the replica reading them died.",
                      s.get("consumer_gone_aborts", 0))
        yield counter("engine_sampling_failures", "Requests ended alone because their own sampling raised.",
                      s.get("sampling_failures", 0))
        steps = CounterMetricFamily(PREFIX + "engine_steps_by_threads",
                                    "Engine steps by the intra-op threads they ran on.", labels=[*names, "threads"])
        for threads, count in sorted(s.get("steps_by_threads", {}).items()):
            steps.add_metric([*m, threads], count)
        yield steps
        fin = CounterMetricFamily(PREFIX + "engine_request_finished", "Requests leaving the engine by reason.",
                                  labels=[*names, "finished_reason"])
        for reason, count in s["finished_total"].items():
            fin.add_metric([*m, reason], count)
        yield fin
        if s.get("grammar_mask_buckets"):
            yield gauge("num_requests_running_constrained", "Running requests with a structured-output grammar.",
                        s.get("num_running_constrained", 0))
            yield counter("grammar_mask_rows", "Token masks filled (one per constrained row per step).",
                          s.get("grammar_mask_rows", 0))
            h = HistogramMetricFamily(PREFIX + "grammar_mask_fill_seconds",
                                      "Time per engine step spent filling structured-output token masks.",
                                      labels=names)
            h.add_metric(m, [(str(b), c) for b, c in s["grammar_mask_buckets"]],
                         sum_value=s.get("grammar_mask_seconds", 0.0))
            yield h
        buckets = s.get("abort_latency_buckets")
        if buckets is not None:
            h = HistogramMetricFamily(PREFIX + "abort_latency_seconds",
                                      "Abort asked (stream cancelled in the engine replica) to blocks freed.",
                                      labels=names)
            h.add_metric(m, [(str(b), c) for b, c in buckets], sum_value=s.get("abort_latency_sum", 0.0))
            yield h


def egress_exposition(store: Any, egress: Any) -> str:
    """An Egress replica's own series, Prometheus text: its resumable streams
    (:class:`stages.egress.resume.ResumeStore`) and the requests it moved off lost engine replicas
    (:class:`stages.egress.egress.Egress`). It reports them to the directory as an Ingress replica
    does its own."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_EgressCollector(store, egress))
    return generate_latest(reg).decode()


class _EgressCollector:
    def __init__(self, store: Any, egress: Any) -> None:
        self.store = store
        self.egress = egress

    def collect(self) -> Iterable[Any]:
        e, s = self.egress, self.store
        counters = [
            ("migrations", "Requests moved to another engine replica after theirs was lost.", e.migrations),
            ("migration_recomputed_tokens",
             "Tokens (prompt and carried over) computed again by the replica a request moved to.", e.recomputed_tokens),
            ("resumable_requests", "Streams that asked to be resumable.", s.opened),
            ("resume_reconnects", "Reconnects that took a kept stream.", s.reconnects),
            ("resume_replayed_events", "Kept events sent again on a reconnect.", s.replayed),
            ("resume_expired", "Detached streams nobody reconnected to in time.", s.expired),
            ("resume_dropped", "Streams whose kept events passed the byte cap.", s.dropped),
        ]
        gauges = [
            ("resumable_streams", "Resumable streams whose events are kept.", len(s)),
            ("resumable_streams_detached", "Kept streams with no client attached (within their grace period).",
             s.detached()),
            ("resume_kept_bytes", "Bytes of events kept for reconnects.", s.nbytes),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
