"""Faults against the real app: replica processes killed mid-stream (SIGKILL, as the OOM killer
would), an exception inside the engine step, and a client that stops reading.

Every client must end promptly (a client still waiting fails the test), with an SSE error event in
the OpenAI shape followed by ``[DONE]``; Serve replaces the replica; ``/health`` says 503 while the
app cannot serve and 200 again afterwards; new requests succeed; and no KV block stays taken.

The app is this file's own (``fault_app``: name ``faults``, route ``/faults``), since its replicas
get killed. Each test leaves it healthy again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL_NAME, ServeApp
from tests.fault_harness import (
    ERROR_KEYS,
    RawStream,
    StreamResult,
    Streams,
    core_pid,
    direct_ingress_url,
    replica_actors,
    rss_bytes,
    sse_events,
    wait_for,
)
from tests.sse_events import Events

pytestmark = pytest.mark.serve

APP = "faults"
#: The issue's bound: every affected client has its answer within this long after the fault.
END_WITHIN_S = 5.0
RECOVERY_S = 120.0


def _health(app: ServeApp) -> int:
    try:
        return httpx.get(app.url + "/health", timeout=10).status_code
    except httpx.HTTPError:
        return 0


def _completion(app: ServeApp, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(app.url + "/v1/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0})


def _engine_idle(app: ServeApp) -> dict[str, Any] | None:
    try:
        stats = app.engine_stats()
    except Exception:  # noqa: BLE001 - the engine is restarting
        return None
    idle = stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0
    return stats if idle else None


def _ready(app: ServeApp) -> None:
    """Healthy, answering, and with an idle engine (the state every test starts from)."""
    wait_for(lambda: _health(app) == 200, RECOVERY_S, "the app to be healthy")
    wait_for(lambda: _completion(app).status_code == 200, RECOVERY_S, "a request to succeed", period=1)
    wait_for(lambda: _engine_idle(app), 30, "the engine to be idle")


def _assert_error_events(results: list[StreamResult], since: float) -> None:
    for r in results:
        assert r.ended_at is not None and r.ended_at - since <= END_WITHIN_S, (r.ended_at - since, r)
        if r.status == 503:  # nothing was sent yet: a plain error response
            assert set(json.loads(r.body)["error"]) == ERROR_KEYS, r
            continue
        assert r.status == 200 and r.exception is None, r
        assert r.error is not None and set(r.error) == ERROR_KEYS, r
        assert r.error["type"] == "service_unavailable", r
        assert r.after_error == "[DONE]" and r.done, r


def _recovers(app: ServeApp) -> bool:
    """Poll /health until it says 503 and then 200 again. A dead engine's last report counts for
    up to the directory's report TTL (3 s here), so /health may still say 200 that long; False
    when no 503 came within 15 s (the app never said it could not serve)."""
    seen_503, started = False, time.monotonic()

    def back() -> bool:
        nonlocal seen_503
        status = _health(app)
        seen_503 = seen_503 or status == 503
        if not seen_503 and time.monotonic() - started > 15:
            return True
        return seen_503 and status == 200

    wait_for(back, RECOVERY_S, "/health to be 503 and then 200 again", period=0.2)
    return seen_503


def _kill(app: str, deployment: str) -> tuple[int, float]:
    (replica,) = replica_actors(app)[deployment]
    os.kill(replica["pid"], signal.SIGKILL)
    return replica["pid"], time.monotonic()


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_engine_replica_killed_mid_stream(fault_app: ServeApp) -> None:
    _ready(fault_app)
    streams = Streams(fault_app.url, 8, max_tokens=400)
    streams.wait_started()
    (replica,) = replica_actors(APP)["Engine"]
    core = core_pid(replica["pid"])
    pid, killed_at = _kill(APP, "Engine")
    results = streams.join(30)
    _assert_error_events(results, killed_at)
    print(f"\nengine killed: all 8 clients ended {max(r.ended_at for r in results) - killed_at:.2f} s later")
    # Its core process saw its socket close: it stops after its step, and holds no model memory.
    wait_for(lambda: not _running(core), 15, "the killed replica's engine core process to exit")
    assert _recovers(fault_app), "/health never said 503 while no engine was alive"
    assert [r["pid"] for r in replica_actors(APP)["Engine"]] != [pid]
    assert _completion(fault_app).status_code == 200
    wait_for(lambda: _engine_idle(fault_app), 30, "the new engine to be idle")


def test_engine_core_process_killed_mid_stream(fault_app: ServeApp) -> None:
    """The model's own process dies (the OOM killer picks the biggest): its streams end with an
    error event at once, and the replica, now unhealthy, is replaced."""
    _ready(fault_app)
    streams = Streams(fault_app.url, 8, max_tokens=400)
    streams.wait_started()
    (replica,) = replica_actors(APP)["Engine"]
    os.kill(core_pid(replica["pid"]), signal.SIGKILL)
    killed_at = time.monotonic()
    results = streams.join(30)
    _assert_error_events(results, killed_at)
    print(f"\nengine core killed: all 8 clients ended {max(r.ended_at for r in results) - killed_at:.2f} s later")
    assert _recovers(fault_app), "/health never said 503 while the engine was dead"
    wait_for(lambda: [r["pid"] for r in replica_actors(APP).get("Engine", [])] not in ([], [replica["pid"]]), RECOVERY_S,
             "Serve to replace the replica")
    assert _completion(fault_app).status_code == 200
    wait_for(lambda: _engine_idle(fault_app), 30, "the new engine to be idle")


def test_egress_replica_killed_mid_stream_frees_the_engine(fault_app: ServeApp) -> None:
    """Also the zombie case: the engine must stop decoding for a reader that died (before the
    fix it decoded all 8 orphans to the end, ~50 s, holding every batch slot)."""
    _ready(fault_app)
    streams = Streams(fault_app.url, 8, max_tokens=400)
    streams.wait_started()
    _, killed_at = _kill(APP, "Egress")
    results = streams.join(30)
    _assert_error_events(results, killed_at)
    stats = wait_for(lambda: _engine_idle(fault_app), 15, "the engine to abort the dead Egress's requests")
    print(f"\negress killed: clients ended in {max(r.ended_at for r in results) - killed_at:.2f} s, "
          f"engine idle {time.monotonic() - killed_at:.1f} s after the kill; "
          f"{stats['consumer_gone_aborts']} aborted by the liveness watch, {stats['finished_total']}")
    wait_for(lambda: _health(fault_app) == 200, RECOVERY_S, "/health to be 200 again")
    wait_for(lambda: _completion(fault_app).status_code == 200, RECOVERY_S, "a request to succeed", period=1)


def test_exception_in_the_engine_step(fault_app: ServeApp) -> None:
    _ready(fault_app)
    streams = Streams(fault_app.url, 8, max_tokens=400)
    streams.wait_started()
    fault_app.call("Engine", "inject_fault", "step_exception")
    injected_at = time.monotonic()
    results = streams.join(30)
    _assert_error_events(results, injected_at)
    assert all("step loop died" in r.error["message"] for r in results if r.error), results[0]
    # The dead loop answers new requests with 503 at once, until Serve has replaced the replica.
    assert _recovers(fault_app), "/health never said 503 while the engine's step loop was dead"
    wait_for(lambda: _completion(fault_app).status_code == 200, RECOVERY_S, "a request to succeed", period=1)
    wait_for(lambda: _engine_idle(fault_app), 30, "the new engine to be idle")


def test_a_hung_engine_step_does_not_keep_streams_open_on_heartbeats(fault_app: ServeApp) -> None:
    """The engine's step blocks: nothing fails, the streams just go silent and Ingress sends
    heartbeats. The heartbeat's liveness check must end them once the engine reports itself stalled
    (``engine.stall_timeout_s``, 5 s here), with the error event; Serve then replaces the replica."""
    _ready(fault_app)
    streams = Streams(fault_app.url, 8, max_tokens=400)
    streams.wait_started()
    fault_app.call("Engine", "inject_fault", "step_hang")
    hung_at = time.monotonic()
    stall = fault_app.args["engine"]["stall_timeout_s"]
    results = streams.join(stall + 30)
    for r in results:
        assert r.status == 200 and r.error is not None and set(r.error) == ERROR_KEYS, r
        assert r.error["type"] == "service_unavailable" and r.after_error == "[DONE]", r
        # Stall detection, a report, the directory's view (1 s cache) and a 1 s grace, generously.
        assert r.ended_at - hung_at <= stall + END_WITHIN_S, (r.ended_at - hung_at, r)
    print(f"\nstep hung: clients ended {max(r.ended_at for r in results) - hung_at:.1f} s later")
    wait_for(lambda: _health(fault_app) == 200 and _completion(fault_app).status_code == 200, RECOVERY_S,
             "the hung engine to be replaced", period=1)
    wait_for(lambda: _engine_idle(fault_app), 30, "the new engine to be idle")


def test_ingress_replica_killed_mid_stream(fault_app: ServeApp) -> None:
    """Nobody is left to send an error event: every connection must close at once, the work of
    its streams must stop in Egress and the engine, and new requests succeed."""
    _ready(fault_app)
    streams = Streams(fault_app.url, 8, max_tokens=400)
    streams.wait_started()
    _, killed_at = _kill(APP, "Ingress")
    results = streams.join(30)
    for r in results:
        assert r.ended_at - killed_at <= END_WITHIN_S and not r.done, r
        assert r.exception is not None or r.error is not None, r
    wait_for(lambda: _engine_idle(fault_app), 15, "the engine to abort the dead Ingress's requests")
    print(f"\ningress killed: connections closed {max(r.ended_at for r in results) - killed_at:.2f} s later, "
          f"engine idle {time.monotonic() - killed_at:.1f} s after the kill")
    wait_for(lambda: _completion(fault_app).status_code == 200, RECOVERY_S, "a request to succeed", period=1)


def test_preprocess_replica_killed_under_load(fault_app: ServeApp) -> None:
    """Requests arriving while Preprocess dies get 200 or a 503 in the OpenAI shape (never a hang
    or another status); running streams, past Preprocess already, finish normally."""
    import concurrent.futures

    _ready(fault_app)
    running = Streams(fault_app.url, 4, max_tokens=48)
    running.wait_started()

    def small(_: int) -> tuple[int, dict[str, Any]]:
        r = _completion(fault_app, max_tokens=2)
        return r.status_code, r.json()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(small, i) for i in range(8)]
        _kill(APP, "Preprocess")
        futures += [pool.submit(small, i) for i in range(8)]
        answers = [f.result(timeout=RECOVERY_S) for f in futures]
    for status, body in answers:
        assert status in (200, 503), (status, body)
        if status == 503:
            assert set(body["error"]) == ERROR_KEYS and body["error"]["type"] == "service_unavailable", body
    for r in running.join(60):
        assert r.status == 200 and r.done and r.error is None and r.finish_reasons == ["length"], r
    print(f"\npreprocess killed: {sorted(s for s, _ in answers)}")
    wait_for(lambda: _completion(fault_app).status_code == 200, RECOVERY_S, "a request to succeed", period=1)


def _metric(app: ServeApp, name: str) -> float:
    text = httpx.get(app.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


def test_slow_reader_is_aborted_and_memory_stays_bounded(fault_app: ServeApp) -> None:
    """One client that stops reading beside 8 normal streams. It talks to the Ingress replica's
    own HTTP server (direct ingress), where a full socket makes the ASGI send wait; behind Serve's
    proxy the backlog sits in the proxy instead (docs/operations.md, "Slow readers")."""
    _ready(fault_app)
    before = _metric(fault_app, "lifecycle:slow_reader_aborts_total")
    ingress_pid = replica_actors(APP)["Ingress"][0]["pid"]
    rss_before = rss_bytes(ingress_pid)
    # The kernel takes up to tcp_wmem's max (4 MiB here) before the server's send waits, so the
    # slow stream is made heavy: 8 choices with 20 top logprobs each, ~17 KB per engine step.
    slow = RawStream(direct_ingress_url(APP, "/faults"),
                     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a long story."}],
                      "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True, "n": 8,
                      "logprobs": True, "top_logprobs": 20}, path="/v1/chat/completions")
    try:
        normal = Streams(fault_app.url, 8, max_tokens=64)
        wait_for(lambda: _metric(fault_app, "lifecycle:slow_reader_aborts_total") > before, 120,
                 "the slow reader to be aborted", period=1)
        for r in normal.join(120):
            assert r.status == 200 and r.done and r.error is None and r.finish_reasons == ["length"], r
        # The slow client still has not read a byte more, yet its blocks are free.
        stats = wait_for(lambda: _engine_idle(fault_app), 15, "the slow reader's blocks to be freed")
        assert stats["num_streams"] == 0, stats
        rss_after = rss_bytes(ingress_pid)
        events = sse_events(slow.read_all())
    finally:
        slow.close()
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "slow_reader", error
    assert error["code"] == "stream_buffer_exceeded", error
    growth = rss_after - rss_before
    print(f"\nslow reader: {len(events)} events reached it; Ingress RSS {rss_before >> 20} -> {rss_after >> 20} MiB")
    assert growth < 64 << 20, f"the Ingress replica grew by {growth >> 20} MiB"


def test_engine_aborts_a_stream_whose_reader_no_longer_exists(fault_app: ServeApp) -> None:
    """The liveness watch itself, in the real replica: an engine request naming a consumer that
    does not exist (as when its Egress replica was killed and nothing cancelled its requests) is
    aborted within a couple of watch periods, though nothing here aborts it."""
    import asyncio

    from ray import serve

    from stages.transport.messages import AdmissionBatch, EngineRequest, SamplingParams
    from tests.conftest import _handle_loop

    _ready(fault_app)
    before = fault_app.engine_stats()

    async def submit() -> Any:
        handle = serve.get_deployment_handle("Engine", app_name=APP)
        request = EngineRequest("liveness-probe-0", [1, 2, 3, 4],
                                SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0.0),
                                consumer=f"SERVE_REPLICA::{APP}#Egress#gone")
        return (await handle.submit.remote(AdmissionBatch([request])))[0]

    t0 = time.monotonic()
    answer = asyncio.run_coroutine_threadsafe(submit(), _handle_loop()).result(timeout=60)
    assert answer.error is None, answer.error
    wait_for(lambda: fault_app.engine_stats()["consumer_gone_aborts"] > before["consumer_gone_aborts"], 10,
             "the liveness watch to end the probe")
    wait_for(lambda: _engine_idle(fault_app), 10, "the engine to abort the probe")
    assert time.monotonic() - t0 < 10
    after = fault_app.engine_stats()
    assert after["finished_total"]["abort"] == before["finished_total"]["abort"] + 1, after["finished_total"]


def test_egress_ends_a_stream_whose_reader_no_longer_exists(fault_app: ServeApp) -> None:
    """The same watch in Egress: a job naming an Ingress replica that does not exist (as when it
    was killed and nothing cancelled its jobs) has its engine call closed, which aborts the
    request in the engine, though nothing here aborts it."""
    import asyncio

    from ray import serve

    from stages.transport.messages import AdmissionBatch, EngineRequest, GenerationJob, SamplingParams
    from tests.conftest import _handle_loop

    async def submit() -> Any:
        handle = serve.get_deployment_handle("Egress", app_name=APP)
        request = EngineRequest("liveness-probe-1", [1, 2, 3, 4],
                                SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0.0))
        job = GenerationJob(request, "completion", MODEL_NAME, "cmpl-liveness-probe-1", 0, stream=True,
                            consumer=f"SERVE_REPLICA::{APP}#Ingress#gone")
        return (await handle.submit.remote(AdmissionBatch([job])))[0]

    _ready(fault_app)
    t0 = time.monotonic()
    answer = asyncio.run_coroutine_threadsafe(submit(), _handle_loop()).result(timeout=60)
    assert answer.error is None, answer.error
    wait_for(lambda: _engine_idle(fault_app), 10, "the engine to abort the probe")
    assert time.monotonic() - t0 < 10


def test_a_resumable_stream_survives_its_ingress_replica(fault_app: ServeApp) -> None:
    """Its events live in Egress, not in the Ingress that held the connection: after that Ingress
    is killed, the client reconnects to its replacement and gets exactly what it missed."""
    _ready(fault_app)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Name some rivers."}],
            "temperature": 0, "max_tokens": 48, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", fault_app.url + "/v1/chat/completions", json=body) as resp:
            clean = Events().read(resp)
        first = Events()
        with client.stream("POST", fault_app.url + "/v1/chat/completions", json=body,
                           headers={"X-Resumable": "120"}) as resp:
            with pytest.raises(httpx.HTTPError):
                first.read(resp, stop=3)
                _kill(APP, "Ingress")
                first.read(resp)  # the connection closes under it
        assert first.events and first.events[-1][1] != "[DONE]"
        wait_for(lambda: _health(fault_app) == 200, RECOVERY_S, "a new Ingress replica")
        with client.stream("GET", f"{fault_app.url}/v1/requests/{first.response_id}/events",
                           headers={"Last-Event-ID": str(first.last_id)}) as resp:
            rest = Events().read(resp)
    ids = first.ids() + rest.ids()
    assert ids == list(range(len(ids))), ids
    assert first.text() + rest.text() == clean.text()
    wait_for(lambda: _engine_idle(fault_app), 15, "the engine to be idle")
