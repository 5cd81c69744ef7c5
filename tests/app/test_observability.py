"""Observability against the real app: one trace per request across processes, metrics that match
what was sent, and client-visible timings whose parts add up."""

from __future__ import annotations

import json
import re
import time
import uuid

import httpx
import pytest

from tests.conftest import MODEL_NAME, ServeApp

REQUIRED_SPANS = {"POST /v1/chat/completions", "preprocess", "chat_template", "tokenize", "egress.complete",
                  "engine", "queue", "prefill", "decode"}


def _chat(app: ServeApp, rid: str, *, stream: bool = False, headers: dict[str, str] | None = None,
          content: str = "Name a colour.", max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
    return httpx.post(app.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"X-Request-Id": rid, **(headers or {})})


def _wait_for_trace(app: ServeApp, rid: str, names: set[str], timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        roots = [s for s in app.otlp.spans if s.attributes.get("lifecycle.client_request_id") == rid
                 and s.name.startswith("POST ")]
        if roots:
            spans = app.otlp.trace(roots[0].trace_id)
            if names <= {s.name for s in spans} or time.monotonic() > deadline:
                return roots[0], spans
        elif time.monotonic() > deadline:
            raise AssertionError(f"no HTTP span for {rid}")
        time.sleep(0.2)


def test_one_trace_per_request_across_processes(serve_app: ServeApp):
    rids = [f"trace-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    for rid in rids:
        assert _chat(serve_app, rid).status_code == 200
    trace_ids = set()
    for rid in rids:
        root, spans = _wait_for_trace(serve_app, rid, REQUIRED_SPANS)
        trace_ids.add(root.trace_id)
        names = {s.name for s in spans}
        assert REQUIRED_SPANS <= names, REQUIRED_SPANS - names
        by_id = {s.span_id: s for s in spans}
        # One tree rooted at the HTTP span.
        assert root.parent_span_id == ""
        for s in spans:
            if s is root:
                continue
            assert s.parent_span_id in by_id, f"{s.name} has a parent outside the trace"
            node = s
            while node.parent_span_id:
                node = by_id[node.parent_span_id]
            assert node is root
            parent = by_id[s.parent_span_id]
            # Children inside their parent's time window (1 ms slack for clock conversion of the
            # engine's retroactive spans from monotonic stamps).
            slack = 1_000_000
            assert parent.start_ns - slack <= s.start_ns <= s.end_ns <= parent.end_ns + slack, (s.name, parent.name)
        pids = {(s.resource.get("lifecycle.component"), s.resource.get("process.pid")) for s in spans}
        assert len({pid for _, pid in pids}) >= 3, pids
        engine = next(s for s in spans if s.name == "engine")
        assert engine.attributes["gen_ai.usage.output_tokens"] == 8
        assert engine.attributes["gen_ai.response.finish_reasons"] == ["length"]
        assert root.attributes["gen_ai.request.model"] == MODEL_NAME
        assert root.attributes["gen_ai.usage.input_tokens"] > 0
        prefill = next(s for s in spans if s.name == "prefill")
        assert any(name == "chunk" for name, _ in prefill.events)
        decode = next(s for s in spans if s.name == "decode")
        assert decode.attributes["lifecycle.decode_steps"] == 7
        # Where the router sent it and what it expected cached there, beside the actual hit, on
        # both the engine's span and the request's.
        for span in (engine, root):
            assert span.attributes["lifecycle.route.policy"] == "cache_aware"
            assert span.attributes["lifecycle.route.replica"]
            assert span.attributes["lifecycle.route.expected_cached_tokens"] >= 0
            assert "lifecycle.route.alternative" not in span.attributes  # one engine replica
            assert span.attributes["lifecycle.cached_tokens"] >= 0
    assert len(trace_ids) == len(rids)


def test_prompt_text_is_not_recorded(serve_app: ServeApp):
    secret = "pineapple-secret-" + uuid.uuid4().hex[:6]
    rid = f"secret-{uuid.uuid4().hex[:8]}"
    assert _chat(serve_app, rid, content=secret).status_code == 200
    _, spans = _wait_for_trace(serve_app, rid, REQUIRED_SPANS)
    for s in spans:
        assert secret not in json.dumps(s.attributes, default=str)
        assert secret not in json.dumps(s.events, default=str)


def test_incoming_traceparent_is_the_parent(serve_app: ServeApp):
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    rid = f"parent-{uuid.uuid4().hex[:8]}"
    resp = _chat(serve_app, rid, headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    assert resp.status_code == 200
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        spans = serve_app.otlp.trace(trace_id)
        if {"POST /v1/chat/completions", "engine"} <= {s.name for s in spans}:
            break
        time.sleep(0.2)
    root = next(s for s in spans if s.name == "POST /v1/chat/completions")
    assert root.parent_span_id == parent_id
    assert {s.name for s in spans} >= {"preprocess", "engine", "decode"}


def test_stop_string_abort_is_on_the_trace(serve_app: ServeApp):
    rid = f"stopabort-{uuid.uuid4().hex[:8]}"
    # Greedy output of this prompt starts with a number list; "3" appears early.
    resp = _chat(serve_app, rid, content="Count from 1 to 20 separated by commas.", max_tokens=60,
                 stop=["3"], ignore_eos=True)
    assert resp.status_code == 200
    body = resp.json()
    if body["choices"][0]["finish_reason"] != "stop":
        pytest.skip("the model did not produce the stop string")
    _, spans = _wait_for_trace(serve_app, rid, REQUIRED_SPANS)
    egress = next(s for s in spans if s.name == "egress.complete")
    assert ("abort", {"reason": "stop_string"}) in egress.events
    engine = next(s for s in spans if s.name == "engine")
    assert engine.attributes["gen_ai.response.finish_reasons"] == ["abort"]


def _metrics(app: ServeApp) -> str:
    """A scrape once the engine is idle and its latest report is in (engine series come from
    reports at most ``engine.report_interval_s`` old)."""
    settle = 2 * app.args["engine"].get("report_interval_s", 1.0) + 0.1
    previous = None
    for _ in range(100):
        text = httpx.get(app.url + "/metrics", timeout=30).text
        key = (_value(text, "lifecycle:generation_tokens_total"), _value(text, "lifecycle:num_requests_running"))
        if key == previous and key[1] == 0:
            return text
        previous = key
        time.sleep(settle)
    raise AssertionError("engine metrics did not settle")


def _value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_match_what_was_sent(serve_app: ServeApp):
    before = _metrics(serve_app)
    k, m = 4, 6
    prompt_tokens = 0
    for i in range(k):
        r = httpx.post(serve_app.url + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": f"Metrics check {i}:", "max_tokens": m, "ignore_eos": True,
            "temperature": 0, "stream": i % 2 == 0, "stream_options": {"include_usage": True}})
        assert r.status_code == 200
        if i % 2:
            prompt_tokens += r.json()["usage"]["prompt_tokens"]
        else:
            final = [json.loads(line[6:]) for line in r.text.splitlines()
                     if line.startswith("data: {") and '"usage":{' in line][-1]
            prompt_tokens += final["usage"]["prompt_tokens"]
    after = _metrics(serve_app)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("lifecycle:request_success_total", finished_reason="length") == k
    assert delta("lifecycle:e2e_request_latency_seconds_count") == k
    assert delta("lifecycle:time_to_first_token_seconds_count") == k
    assert delta("lifecycle:time_to_first_token_part_seconds_count", part="queue") == k
    assert delta("lifecycle:request_generation_tokens_sum") == k * m
    assert delta("lifecycle:request_prompt_tokens_sum") == prompt_tokens
    assert delta("lifecycle:generation_tokens_total") == k * m
    assert delta("lifecycle:prompt_tokens_total") == prompt_tokens
    assert delta("lifecycle:engine_request_finished_total", finished_reason="length") == k
    # Streamed requests observe one ITL per token after the first item; the first item carries one
    # token unless the engine outran the stream (then two), so allow that much slack.
    assert (k // 2) * (m - 2) <= delta("lifecycle:inter_token_latency_seconds_count") <= (k // 2) * (m - 1)
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_free_kv_blocks"):
        assert re.search(rf"^lifecycle:{gauge}\{{", after, re.M), gauge
    assert _value(after, "lifecycle:num_requests_running") == 0


def test_timings_add_up_and_reach_the_client(serve_app: ServeApp):
    r = _chat(serve_app, f"timing-{uuid.uuid4().hex[:8]}", max_tokens=24, ignore_eos=True)
    timing = r.json()["server_timing"]
    header = dict(part.split(";dur=") for part in r.headers["server-timing"].split(", "))
    assert {k: float(v) for k, v in header.items()} == pytest.approx(timing, abs=0.01)
    parts = sum(timing[k] for k in ("prep", "queue", "prefill", "decode", "egress"))
    assert abs(parts - timing["total"]) <= 0.05 * timing["total"], timing

    # Streamed: the final chunk carries the same breakdown.
    s = _chat(serve_app, f"timing-s-{uuid.uuid4().hex[:8]}", stream=True, max_tokens=24, ignore_eos=True)
    chunks = [json.loads(line[6:]) for line in s.text.splitlines() if line.startswith("data: {")]
    final = chunks[-1]
    assert final["choices"] == [] and "server_timing" in final
    t = final["server_timing"]
    parts = sum(t[k] for k in ("prep", "queue", "prefill", "decode", "egress"))
    assert abs(parts - t["total"]) <= 0.05 * t["total"], t
    # Its TTFT is measured parts that add up to it (what is left between them is plain Python
    # between two clock reads in Ingress: well under a millisecond, plus rounding).
    ttft_parts = sum(t[k] for k in ("prep", "hops", "queue", "prefill", "first_flush"))
    assert t["hops"] > 0 and t["first_flush"] > 0, t
    assert ttft_parts <= t["ttft"] + 0.05 and t["ttft"] - ttft_parts < 2.0, t


def test_one_structured_log_line_per_request(serve_app: ServeApp):
    rid = f"logline-{uuid.uuid4().hex[:8]}"
    secret = "do-not-log-" + uuid.uuid4().hex[:6]
    assert _chat(serve_app, rid, content=secret, max_tokens=5).status_code == 200
    deadline = time.monotonic() + 20
    lines: list[str] = []
    while not lines and time.monotonic() < deadline:
        with open(serve_app.request_log) as f:
            lines = [line for line in f if f'"x_request_id":"{rid}"' in line]
        time.sleep(0.2)
    assert len(lines) == 1, lines
    record = json.loads(lines[0])
    assert record["event"] == "request_finished"
    assert re.fullmatch(r"[0-9a-f]{32}", record["trace_id"])
    assert set(record["timings_ms"]) == {"prep", "queue", "prefill", "decode", "egress", "total"}
    assert record["completion_tokens"] == 5 and record["prompt_tokens"] > 0
    assert record["finish_reasons"] == ["length"] and record["outcome"] == "ok"
    assert secret not in lines[0] and "prompt" not in record  # prompts are not logged unless enabled
    assert re.fullmatch(r"[0-9a-f]{32}", record["request_id"])  # the server-minted id, not the label
    assert record["route"]["policy"] == "cache_aware" and record["route"]["replica"]
    assert record["route"]["expected_cached_tokens"] >= 0 and "cached_tokens" in record


def _log_records(app: ServeApp, rid: str, timeout: float = 20) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        with open(app.request_log) as f:
            records = [json.loads(line) for line in f if f'"x_request_id":"{rid}"' in line]
        if records or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def test_log_line_for_error_and_client_gone_outcomes(serve_app: ServeApp):
    bad = f"bad-{uuid.uuid4().hex[:8]}"
    r = httpx.post(serve_app.url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": "nope"},
                   headers={"X-Request-Id": bad}, timeout=30)
    assert r.status_code == 400
    gone = f"gone-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", serve_app.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": gone},
                      timeout=60) as resp:
        for line in resp.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # leave after the first token
    [bad_record] = _log_records(serve_app, bad)
    assert bad_record["outcome"] == "error" and bad_record["status"] == 400
    [gone_record] = _log_records(serve_app, gone)
    assert gone_record["outcome"] == "client_gone"


def test_short_requests_are_prepared_in_the_ingress_long_ones_in_the_stage(serve_app: ServeApp):
    """The ``preprocess`` span says where a request was templated and tokenised, and its process
    agrees: a short chat in the Ingress, one over ``preprocess.inline_max_chars`` in Preprocess.
    The counter by ``where`` moves the same way."""
    before = _metrics(serve_app)
    seen = {}
    for where, content in (("ingress", "Name a colour."), ("stage", "colour " * 400)):
        rid = f"where-{where}-{uuid.uuid4().hex[:8]}"
        assert _chat(serve_app, rid, content=content, max_tokens=2).status_code == 200
        _, spans = _wait_for_trace(serve_app, rid, REQUIRED_SPANS)
        prep = next(s for s in spans if s.name == "preprocess")
        seen[where] = (prep.attributes.get("lifecycle.preprocess.where"), prep.resource.get("lifecycle.component"))
        assert {"chat_template", "tokenize"} <= {s.name for s in spans if s.parent_span_id == prep.span_id}
    assert seen == {"ingress": ("ingress", "ingress"), "stage": ("stage", "preprocess")}
    after = _metrics(serve_app)
    for where in ("ingress", "stage"):
        assert (_value(after, "lifecycle:preprocess_requests_total", where=where)
                - _value(before, "lifecycle:preprocess_requests_total", where=where)) == 1, where


def test_a_resumed_stream_is_one_trace_with_its_disconnect_and_reconnect(serve_app: ServeApp):
    from tests.sse_events import Events

    rid = f"resume-trace-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Count to twenty."}],
            "max_tokens": 24, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", serve_app.url + "/v1/chat/completions", json=body,
                           headers={"X-Request-Id": rid, "X-Resumable": "30"}) as resp:
            first = Events().read(resp, stop=3)
        with client.stream("GET", f"{serve_app.url}/v1/requests/{rid}/events",
                           headers={"Last-Event-ID": str(first.last_id)}) as resp:
            rest = Events().read(resp)
    assert rest.events[-1][1] == "[DONE]"
    root, spans = _wait_for_trace(serve_app, rid, {"GET /v1/requests/{id}/events", "engine", "decode"})
    assert ("client_disconnected", {"lifecycle.resumable": True}) in root.events
    (reconnect,) = [s for s in spans if s.name == "GET /v1/requests/{id}/events"]
    assert reconnect.trace_id == root.trace_id and reconnect.parent_span_id == root.span_id
    (event,) = [attrs for name, attrs in reconnect.events if name == "reconnect"]
    assert event["lifecycle.last_event_id"] == first.last_id and event["lifecycle.reconnects"] == 1
    assert event["lifecycle.replayed_events"] >= 0
