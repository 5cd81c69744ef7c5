"""Prometheus metrics without Ray: what one Ingress replica observes, and the whole app's ``/metrics``
(:func:`stages.metrics.render_app`) merging several Ingress replicas and engine reports, each series
labelled with its replica. The output is read back with Prometheus' own text parser."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stages.engine.driver.async_engine import AsyncEngine
from stages.engine.driver.in_process import InProcessDriver
from stages.metrics import STAGES, IngressMetrics, RequestRecord, render_app
from stages.transport.messages import EngineReport, EngineRequest
from tests.fakes import make_engine, params

MODEL = "tiny-model"
P = "lifecycle:"

#: Stage durations in ms, as the Ingress returns them to the client.
TIMINGS_MS = {"prep": 100.0, "queue": 50.0, "prefill": 150.0, "decode": 200.0, "egress": 5.0, "total": 600.0}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """Every sample keyed by (sample name, labels), and each family's type."""
    samples: Samples = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"duplicate series {key}"
            samples[key] = s.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def select(samples: Samples, name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
    """Samples named ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return {lab: v for (n, lab), v in samples.items() if n == name and want <= lab}


def record(ttft_s: float | None = 0.5, *, stream: bool = True, reasons: tuple[str, ...] = ("stop",),
           prompt: int = 10, completion: int = 5, itls: tuple[float, ...] = (0.01, 0.02),
           timings: dict[str, float] | None = None) -> RequestRecord:
    return RequestRecord(kind="chat", prompt_tokens=prompt, completion_tokens=completion,
                         finish_reasons=list(reasons), timings_ms=dict(timings or TIMINGS_MS), ttft_s=ttft_s,
                         itls_s=list(itls), stream=stream)


def own(metrics: IngressMetrics) -> Samples:
    return parse(metrics.exposition())[0]


def stats(**over: Any) -> dict[str, Any]:
    """An engine snapshot with every key :meth:`AsyncEngine.snapshot` returns."""
    base: dict[str, Any] = {
        "num_running": 3, "num_waiting": 2, "num_kv_blocks": 100, "num_free_blocks": 40, "kv_cache_usage": 0.6,
        "prefix_cache_queries": 500, "prefix_cache_hits": 120, "num_preemptions": 4,
        "prompt_tokens_total": 1000, "generation_tokens_total": 700,
        "finished_total": {"stop": 5, "length": 2, "abort": 1}, "num_steps": 99,
        "num_streams": 5, "tokens_after_gone": 11, "rejected_overloaded": 6, "sampling_failures": 2,
        "abort_latency_buckets": [("0.001", 1), ("0.01", 3), ("+Inf", 4)], "abort_latency_sum": 0.5,
        "max_num_seqs": 8, "block_size": 16, "max_waiting": 8, "stalled_s": 0.0,
    }
    return {**base, **over}


def report(replica: str, **over: Any) -> EngineReport:
    return EngineReport(replica=replica, node_id="node-1", max_model_len=2048, healthy=True, stats=stats(**over))


# -- one Ingress replica ------------------------------------------------------------------------------
def test_streamed_request_observes_ttft_and_its_parts() -> None:
    m = IngressMetrics(MODEL)
    m.observe_request(record(0.5))
    s = own(m)
    assert value(s, P + "time_to_first_token_seconds_count", model_name=MODEL) == 1
    assert value(s, P + "time_to_first_token_seconds_sum", model_name=MODEL) == pytest.approx(0.5)
    parts = {dict(lab)["part"]: v for lab, v in select(s, P + "time_to_first_token_part_seconds_sum").items()}
    # first_flush is what the server measured in TTFT beyond prep + queue + prefill.
    assert parts == pytest.approx({"prep": 0.1, "queue": 0.05, "prefill": 0.15, "first_flush": 0.2})
    # The parts sit in the right buckets too (prep 0.1 s is in le=0.1, not in le=0.08).
    bucket = P + "time_to_first_token_part_seconds_bucket"
    assert value(s, bucket, model_name=MODEL, part="prep", le="0.1") == 1
    assert value(s, bucket, model_name=MODEL, part="prep", le="0.08") == 0



def test_measured_hops_and_first_flush_are_the_parts_when_the_request_streamed() -> None:
    m = IngressMetrics(MODEL)
    timings = {**TIMINGS_MS, "hops": 12.0, "first_flush": 3.0, "ttft": 315.0}
    m.observe_request(RequestRecord(kind="chat", prompt_tokens=3, completion_tokens=2, finish_reasons=["stop"],
                                    timings_ms=timings, ttft_s=0.312, itls_s=[], stream=True))
    s = own(m)
    assert value(s, P + "time_to_first_token_seconds_sum", model_name=MODEL) == pytest.approx(0.315)
    parts = {dict(lab)["part"]: v for lab, v in select(s, P + "time_to_first_token_part_seconds_sum").items()}
    assert parts == pytest.approx({"prep": 0.1, "hops": 0.012, "queue": 0.05, "prefill": 0.15, "first_flush": 0.003})

def test_request_histograms_and_success_counter() -> None:
    m = IngressMetrics(MODEL)
    m.observe_request(record(0.5, reasons=("stop", "length"), prompt=12, completion=7, itls=(0.01, 0.02, 0.03)))
    s = own(m)
    assert value(s, P + "inter_token_latency_seconds_count", model_name=MODEL) == 3
    assert value(s, P + "inter_token_latency_seconds_sum", model_name=MODEL) == pytest.approx(0.06)
    assert value(s, P + "e2e_request_latency_seconds_sum", model_name=MODEL) == pytest.approx(0.6)
    assert value(s, P + "request_queue_time_seconds_sum", model_name=MODEL) == pytest.approx(0.05)
    assert value(s, P + "request_prefill_time_seconds_sum", model_name=MODEL) == pytest.approx(0.15)
    assert value(s, P + "request_decode_time_seconds_sum", model_name=MODEL) == pytest.approx(0.2)
    stage = {dict(lab)["stage"]: v for lab, v in select(s, P + "request_stage_time_seconds_sum").items()}
    assert stage == pytest.approx({k: TIMINGS_MS[k] / 1000 for k in STAGES})
    assert value(s, P + "request_prompt_tokens_sum", model_name=MODEL) == 12
    assert value(s, P + "request_generation_tokens_sum", model_name=MODEL) == 7
    # One success per choice, by its own finish reason.
    success = P + "request_success_total"
    assert value(s, success, model_name=MODEL, finished_reason="stop") == 1
    assert value(s, success, model_name=MODEL, finished_reason="length") == 1


def test_non_streamed_ttft_is_prep_queue_prefill() -> None:
    m = IngressMetrics(MODEL)
    m.observe_request(record(None, stream=False, itls=()))
    s = own(m)
    assert value(s, P + "time_to_first_token_seconds_sum", model_name=MODEL) == pytest.approx(0.3)
    assert value(s, P + "time_to_first_token_part_seconds_sum", model_name=MODEL, part="first_flush") == 0
    assert not select(s, P + "inter_token_latency_seconds_count")  # no stream, no gaps


def test_streamed_request_without_a_first_token_has_no_ttft() -> None:
    m = IngressMetrics(MODEL)
    m.observe_request(record(None, stream=True, itls=()))
    s = own(m)
    assert not select(s, P + "time_to_first_token_seconds_count")
    assert not select(s, P + "time_to_first_token_part_seconds_count")
    assert value(s, P + "e2e_request_latency_seconds_count", model_name=MODEL) == 1


def test_first_flush_never_goes_negative() -> None:
    m = IngressMetrics(MODEL)
    m.observe_request(record(0.25))  # less than prep + queue + prefill (0.3 s)
    s = own(m)
    assert value(s, P + "time_to_first_token_part_seconds_sum", model_name=MODEL, part="first_flush") == 0


def test_errors_and_aborts() -> None:
    m = IngressMetrics(MODEL)
    m.observe_error(429)
    m.observe_error(429)
    m.observe_error(400)
    m.observe_abort("client_gone")
    m.observe_abort("cancelled")
    s = own(m)
    assert value(s, P + "request_errors_total", model_name=MODEL, status="429") == 2
    assert value(s, P + "request_errors_total", model_name=MODEL, status="400") == 1
    assert value(s, P + "request_aborted_total", model_name=MODEL, reason="client_gone") == 1
    assert value(s, P + "request_aborted_total", model_name=MODEL, reason="cancelled") == 1
    # An aborted request also counts as finished with reason "abort".
    assert value(s, P + "request_success_total", model_name=MODEL, finished_reason="abort") == 2


# -- the whole app ------------------------------------------------------------------------------------
def _two_ingress() -> dict[str, str]:
    a, b = IngressMetrics(MODEL), IngressMetrics(MODEL)
    for _ in range(3):
        a.observe_request(record(0.5, reasons=("stop",)))
    b.observe_request(record(0.4, reasons=("stop", "length")))
    b.observe_error(429)
    b.observe_abort("client_gone")
    return {"ingress-a": a.exposition(), "ingress-b": b.exposition()}


def test_render_app_labels_each_ingress_replica_and_keeps_types() -> None:
    text, content_type = render_app(MODEL, _two_ingress(), [])
    assert content_type.startswith("text/plain")
    s, types = parse(text)
    assert types[P + "time_to_first_token_seconds"] == "histogram"
    assert types[P + "request_success"] == "counter"
    # Every Ingress series names its replica; nothing is left unlabelled.
    ingress_series = [lab for (name, lab) in s if not name.endswith("_created")]
    assert ingress_series and all(dict(lab).get("replica") in {"ingress-a", "ingress-b"} for lab in ingress_series)
    ttft = P + "time_to_first_token_seconds_count"
    assert value(s, ttft, model_name=MODEL, replica="ingress-a") == 3
    assert value(s, ttft, model_name=MODEL, replica="ingress-b") == 1
    # Per-replica labels are kept beside the replica label.
    assert value(s, P + "time_to_first_token_part_seconds_sum", model_name=MODEL, part="first_flush",
                 replica="ingress-b") == pytest.approx(0.1)
    assert value(s, P + "request_errors_total", model_name=MODEL, status="429", replica="ingress-b") == 1
    assert not select(s, P + "request_errors_total", replica="ingress-a")


def test_render_app_counters_sum_to_what_was_observed() -> None:
    s, _ = parse(render_app(MODEL, _two_ingress(), [])[0])
    success = select(s, P + "request_success_total")
    assert sum(success.values()) == 3 + 2 + 1  # three stops, a stop and a length, one abort
    by_reason: dict[str, float] = {}
    for lab, v in success.items():
        by_reason[dict(lab)["finished_reason"]] = by_reason.get(dict(lab)["finished_reason"], 0) + v
    assert by_reason == {"stop": 4, "length": 1, "abort": 1}
    assert sum(select(s, P + "e2e_request_latency_seconds_count").values()) == 4
    # Cumulative buckets stay per replica: the +Inf bucket equals each replica's count.
    for replica, count in (("ingress-a", 3), ("ingress-b", 1)):
        assert value(s, P + "e2e_request_latency_seconds_bucket", model_name=MODEL, replica=replica,
                     le="+Inf") == count


def test_render_app_labels_every_engine_replica() -> None:
    engines = [report("engine-0", steps_by_threads={"1": 40, "2": 9}),
               report("engine-1", num_running=0, num_waiting=7, kv_cache_usage=0.25,
                      generation_tokens_total=300, finished_total={"stop": 9, "length": 0})]
    s, types = parse(render_app(MODEL, {}, engines)[0])
    assert types[P + "num_requests_running"] == "gauge"
    assert types[P + "generation_tokens"] == "counter"

    def v(name: str, replica: str, **labels: str) -> float:
        return value(s, P + name, model_name=MODEL, replica=replica, **labels)

    expected_gauges = {"num_requests_running": ("num_running", 3, 0),
                       "num_requests_waiting": ("num_waiting", 2, 7),
                       "kv_cache_usage_perc": ("kv_cache_usage", 0.6, 0.25),
                       "num_free_kv_blocks": ("num_free_blocks", 40, 40),
                       "num_kv_blocks": ("num_kv_blocks", 100, 100),
                       "engine_ongoing_streams": ("num_streams", 5, 5)}
    for name, (_, first, second) in expected_gauges.items():
        assert (v(name, "engine-0"), v(name, "engine-1")) == (first, second), name
    counters = {"prompt_tokens_total": 1000, "num_preemptions_total": 4, "prefix_cache_queries_total": 500,
                "prefix_cache_hits_total": 120, "tokens_after_client_gone_total": 11,
                "engine_rejected_overloaded_total": 6, "engine_sampling_failures_total": 2}
    for name, expected in counters.items():
        assert v(name, "engine-0") == v(name, "engine-1") == expected, name
    assert (v("generation_tokens_total", "engine-0"), v("generation_tokens_total", "engine-1")) == (700, 300)
    finished = P + "engine_request_finished_total"
    assert {(dict(lab)["replica"], dict(lab)["finished_reason"]): x for lab, x in select(s, finished).items()} == {
        ("engine-0", "stop"): 5, ("engine-0", "length"): 2, ("engine-0", "abort"): 1,
        ("engine-1", "stop"): 9, ("engine-1", "length"): 0}
    assert sum(select(s, P + "generation_tokens_total").values()) == 1000
    steps = P + "engine_steps_by_threads_total"
    assert {(dict(lab)["replica"], dict(lab)["threads"]): x for lab, x in select(s, steps).items()} == {
        ("engine-0", "1"): 40, ("engine-0", "2"): 9}


def test_render_app_abort_latency_histogram() -> None:
    s, types = parse(render_app(MODEL, {}, [report("engine-0")])[0])
    assert types[P + "abort_latency_seconds"] == "histogram"
    buckets = {dict(lab)["le"]: x for lab, x in select(s, P + "abort_latency_seconds_bucket", replica="engine-0").items()}
    assert buckets == {"0.001": 1, "0.01": 3, "+Inf": 4}
    assert value(s, P + "abort_latency_seconds_count", model_name=MODEL, replica="engine-0") == 4
    assert value(s, P + "abort_latency_seconds_sum", model_name=MODEL, replica="engine-0") == 0.5


def test_render_app_tolerates_reports_without_the_optional_keys() -> None:
    minimal = {k: v for k, v in stats().items()
               if k not in {"num_streams", "tokens_after_gone", "rejected_overloaded", "abort_latency_buckets",
                            "abort_latency_sum"}}
    old = EngineReport(replica="engine-old", node_id="n", max_model_len=2048, healthy=True, stats=minimal)
    s, types = parse(render_app(MODEL, {}, [old])[0])
    assert value(s, P + "engine_ongoing_streams", model_name=MODEL, replica="engine-old") == 0
    assert value(s, P + "tokens_after_client_gone_total", model_name=MODEL, replica="engine-old") == 0
    assert P + "abort_latency_seconds" not in types


def test_render_app_with_real_engine_snapshots() -> None:
    """Render what :meth:`AsyncEngine.snapshot` really returns after real (fake-model) requests."""

    async def run(replica: str, max_tokens: int) -> dict[str, Any]:
        eng = AsyncEngine(InProcessDriver(make_engine(), replica=replica))
        eng.start()
        try:
            req = EngineRequest(f"{replica}-req", [5, 6, 7, 8, 9], params(max_tokens=max_tokens))
            async for _ in eng.generate(req):
                pass
            return eng.snapshot()
        finally:
            eng.shutdown()

    snaps = {"engine-0": asyncio.run(run("engine-0", 6)), "engine-1": asyncio.run(run("engine-1", 3))}
    reports = [EngineReport(replica=r, node_id="n", max_model_len=64, healthy=True, stats=st)
               for r, st in snaps.items()]
    s, _ = parse(render_app(MODEL, _two_ingress(), reports)[0])
    for replica, generated in (("engine-0", 6), ("engine-1", 3)):
        assert value(s, P + "generation_tokens_total", model_name=MODEL, replica=replica) == generated
        assert value(s, P + "prompt_tokens_total", model_name=MODEL, replica=replica) == 5
        assert value(s, P + "engine_request_finished_total", model_name=MODEL, replica=replica,
                     finished_reason="length") == 1
        assert value(s, P + "num_requests_running", model_name=MODEL, replica=replica) == 0
    assert sum(select(s, P + "generation_tokens_total").values()) == 9
    # The Ingress replicas' series are still there beside the engines'.
    assert value(s, P + "time_to_first_token_seconds_count", model_name=MODEL, replica="ingress-a") == 3
