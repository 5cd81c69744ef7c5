"""Every stage at 2 replicas (one real Serve app, started once per session): request identity,
cancel by id across Ingress replicas, ``n > 1`` on one engine, and whole-app views.

Specific Ingress replicas are reached through Serve's direct-ingress ports (on under
``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``): each Ingress replica also serves HTTP on its own port, and
its ``/health`` names the replica.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.serve

CHAT = "/v1/chat/completions"
PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]


def _chat(url: str, *, headers: dict[str, str] | None = None, timeout: float = 120, **body: Any) -> httpx.Response:
    payload = {"model": MODEL_NAME, "messages": PROMPT, "temperature": 0, "max_tokens": 30, **body}
    return httpx.post(url + CHAT, json=payload, headers=headers or {}, timeout=timeout)


def _reports(app: Any) -> list[Any]:
    return app.engine_reports()


def _wait_idle(app: Any, timeout: float = 120.0) -> list[Any]:
    """Both engines idle with every block free, and no live request left in the directory."""
    return app.wait_engines_idle(2, timeout, directory_empty=True)


@pytest.fixture(scope="module")
def app(serve_app_replicas: Any) -> Any:
    return serve_app_replicas


@pytest.fixture(scope="module")
def clean_text(app: Any) -> str:
    r = _chat(app.url)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 30
    return r.json()["choices"][0]["message"]["content"]


def test_concurrent_duplicate_client_ids_never_5xx_and_never_mix(app: Any, clean_text: str) -> None:
    rid = f"dup-{time.time_ns()}"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_chat, app.url, headers={"X-Request-Id": rid}, **extra)
                   for extra in ({}, {}, {"n": 2}, {"stream": False})]
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    bodies = [r.json() for r in responses]
    assert len({b["id"] for b in bodies}) == 4  # server-minted, distinct
    for b in bodies:
        assert rid not in b["id"]
        assert b["usage"]["completion_tokens"] == 30 * len(b["choices"])
        for choice in b["choices"]:
            assert choice["message"]["content"] == clean_text  # greedy: nobody got another's tokens
    # The client's id is a label: echoed, never the engine's key.
    assert all(r.headers.get_list("x-request-id") == [rid] for r in responses)
    assert len({r.headers["x-server-request-id"] for r in responses}) == 4


def test_sequential_duplicate_ids_are_independent(app: Any, clean_text: str) -> None:
    rid = f"seq-{time.time_ns()}"
    for _ in range(2):
        r = _chat(app.url, headers={"X-Request-Id": rid})
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == clean_text


def test_disconnect_then_immediate_retry_gets_exactly_a_clean_run(app: Any, clean_text: str) -> None:
    rid = f"retry-{time.time_ns()}"
    with httpx.Client(timeout=120) as client:
        body = {"model": MODEL_NAME, "messages": PROMPT, "temperature": 0, "max_tokens": 30, "stream": True}
        with client.stream("POST", app.url + CHAT, json=body, headers={"X-Request-Id": rid}) as resp:
            seen = 0
            for line in resp.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    seen += 1
                if seen >= 4:
                    break  # leaving the block drops the connection mid-stream
    retry = _chat(app.url, headers={"X-Request-Id": rid})
    assert retry.status_code == 200
    assert retry.json()["usage"]["completion_tokens"] == 30
    assert retry.json()["choices"][0]["message"]["content"] == clean_text


def _stream_lines(url: str, body: dict[str, Any], out: list[str], headers: dict[str, str] | None = None) -> int:
    with httpx.stream("POST", url + CHAT, json=body, headers=headers or {}, timeout=180) as resp:
        for line in resp.iter_lines():
            out.append(line)
        return resp.status_code


def test_cancel_by_id_on_another_ingress_replica(app: Any, ingress_ports: dict[str, int]) -> None:
    (holder, holder_port), (other, other_port) = sorted(ingress_ports.items())
    assert holder != other
    prefix = "/" + app.url.rsplit("/", 1)[-1]
    holder_url, other_url = f"http://127.0.0.1:{holder_port}{prefix}", f"http://127.0.0.1:{other_port}{prefix}"
    body = {"model": MODEL_NAME, "messages": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    lines: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_stream_lines, holder_url, body, lines)
        deadline = time.monotonic() + 120
        while not any('"content":"' in line and '"content":""' not in line for line in lines):
            assert time.monotonic() < deadline and not fut.done(), lines[:5]
            time.sleep(0.05)
        response_id = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])["id"]
        t0 = time.perf_counter()
        answer = httpx.post(f"{other_url}/v1/requests/{response_id}/cancel", timeout=30)
        assert answer.status_code == 200, answer.text
        assert [c["id"] for c in answer.json()["cancelled"]] == [response_id]
        assert fut.result(timeout=60) == 200
        ended_in = time.perf_counter() - t0
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["abort"], finishes
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    usage = events[-1]["usage"]
    assert 0 < usage["completion_tokens"] < 400
    print(f"cancel via the other Ingress replica ended the stream in {ended_in * 1000:.0f} ms")
    # Finished: once the holder's removal has reached the Directory (one sync round trip after the
    # end; a cancel racing it still finds the entry), a second cancel is a 404 in the OpenAI shape.
    deadline = time.monotonic() + 5
    while (gone := httpx.post(f"{other_url}/v1/requests/{response_id}/cancel", timeout=30)).status_code == 200:
        assert time.monotonic() < deadline, "the finished request stayed in the Directory"
        time.sleep(0.05)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "request_not_found"
    _wait_idle(app)


def test_cancel_by_client_label_cancels_every_request_carrying_it(app: Any) -> None:
    label = f"batch-{time.time_ns()}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_chat, app.url, headers={"X-Request-Id": label}, timeout=180, max_tokens=400,
                               ignore_eos=True) for _ in range(2)]
        # Cancel once both are live (each registers when its Ingress replica syncs): a label
        # cancels every live request carrying it at that moment.
        deadline = time.monotonic() + 60
        while sum(e.client_request_id == label for e in app.call("Directory", "live_entries")) < 2:
            assert time.monotonic() < deadline, "the two labelled requests never both went live"
            time.sleep(0.1)
        answer = httpx.post(f"{app.url}/v1/requests/{label}/cancel", timeout=30)
        assert answer.status_code == 200 and len(answer.json()["cancelled"]) == 2, answer.text
        results = [f.result(timeout=120) for f in futures]
    for r in results:  # a cancelled non-streamed request answers with what it has, finish "abort"
        assert r.status_code == 200
        assert r.json()["choices"][0]["finish_reason"] == "abort"
        assert r.json()["usage"]["completion_tokens"] < 400
    _wait_idle(app)


def test_n_choices_run_on_one_engine_replica(app: Any) -> None:
    for attempt in range(4):  # with 2 engines, 4 splits in a row would be 1 in 16 by chance
        before = {r.replica: r.stats["finished_total"]["length"] for r in _wait_idle(app)}
        r = _chat(app.url, n=2, max_tokens=8, temperature=0.8, seed=attempt)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        deadline = time.monotonic() + 30
        while True:
            after = {rep.replica: rep.stats["finished_total"]["length"] for rep in _reports(app)}
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            if sum(delta.values()) == 2:
                break
            assert time.monotonic() < deadline, delta
            time.sleep(0.2)
        assert sorted(delta.values()) == [0, 2], delta


def _metric_total(text: str, name: str) -> float:
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", re.M)
    return sum(float(m.group(2)) for m in pattern.finditer(text))


def test_metrics_totals_cover_both_engines_and_never_go_backwards(app: Any) -> None:
    _wait_idle(app)
    before = httpx.get(app.url + "/metrics", timeout=30).text
    sent = 0
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for r in pool.map(lambda i: _chat(app.url, max_tokens=5 + i), range(6)):
            assert r.status_code == 200
            sent += r.json()["usage"]["completion_tokens"]
    name = "lifecycle:generation_tokens_total"
    deadline = time.monotonic() + 30
    previous = _metric_total(before, name)
    while True:
        text = httpx.get(app.url + "/metrics", timeout=30).text
        total = _metric_total(text, name)
        assert total >= previous, "a counter went backwards between scrapes"
        previous = total
        if total - _metric_total(before, name) == sent:
            break
        assert time.monotonic() < deadline, (total, _metric_total(before, name), sent)
        time.sleep(0.3)
    replicas = set(re.findall(r'^lifecycle:generation_tokens_total\{[^}]*replica="([^"]+)"', text, re.M))
    assert len(replicas) == 2, replicas  # one series per engine replica


def test_health_is_for_the_whole_app(app: Any) -> None:
    r = httpx.get(app.url + "/health", timeout=30)
    assert r.status_code == 200
    assert len(_reports(app)) == 2 and all(rep.healthy for rep in _reports(app))


# -- aborts for a draining replica: routed elsewhere, forwarded through the directory -------------------
class _LongStream:
    """A streamed chat of up to 4,000 tokens read on a thread: its server request id, its lines."""

    def __init__(self, url: str) -> None:
        self.lines: list[str] = []
        self.rid = ""
        self.status = 0
        self._client = httpx.Client(timeout=180)
        body = {"model": MODEL_NAME, "messages": PROMPT, "temperature": 0, "max_tokens": 4000, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while sum(1 for line in self.lines if line.startswith("data: {")) < 3:
            assert time.monotonic() < deadline and self._thread.is_alive(), self.lines
            time.sleep(0.05)

    def _read(self, url: str, body: dict[str, Any]) -> None:
        try:
            with self._client.stream("POST", url + CHAT, json=body) as resp:
                self.status, self.rid = resp.status_code, resp.headers["x-server-request-id"]
                for line in resp.iter_lines():
                    self.lines.append(line)
        except httpx.HTTPError:
            pass  # closed by the test

    def ended_within(self, seconds: float) -> bool:
        self._thread.join(seconds)
        return not self._thread.is_alive()

    def close(self) -> None:
        self._client.close()
        self._thread.join(10)


def _egress_replicas(app: Any) -> set[str]:
    """The Egress replicas' ids, from their actor names (``SERVE_REPLICA::<app>#Egress#<id>``):
    asking the replicas themselves goes through a router that may answer from one replica only."""
    import ray

    prefix = f"SERVE_REPLICA::{app.name}#Egress#"
    names = {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(prefix)}
    assert len(names) == 2, names
    return names


def test_an_abort_routed_past_its_draining_replica_is_forwarded_and_taken_there(app: Any) -> None:
    """A replica being scaled down is no routing candidate, so an abort or cancel naming it lands
    elsewhere. That replica forwards it to the directory; the named one takes it from there (an
    engine with its next report, Egress by asking each second)."""
    from stages.transport.messages import AbortRequest

    # Named replicas no router knows: the call lands on some live replica, which forwards it.
    app.call("Engine", "abort", AbortRequest("engine-draining", ["e1"]))
    app.call("Egress", "abort", AbortRequest("egress-draining", ["j1"]))
    assert app.call("Directory", "take_aborts", "engine-draining") == ["e1"]
    assert app.call("Directory", "take_aborts", "egress-draining") == ["j1"]

    # The engine holding a request takes an abort forwarded to it: the request ends early, as
    # an abort does, and the client gets what was generated so far.
    stream = _LongStream(app.url)
    try:
        for report in _reports(app):
            app.call("Directory", "forward_abort", AbortRequest(report.replica, [stream.rid]))
        assert stream.ended_within(30), "the engine never took the forwarded abort"
        assert stream.status == 200 and [line for line in stream.lines if line][-1] == "data: [DONE]"
        usage = [json.loads(line[6:]) for line in stream.lines if line.startswith("data: {")][-1]["usage"]
        assert usage["completion_tokens"] < 4000
    finally:
        stream.close()

    # An Egress replica takes a cancel forwarded to it: the job ends there, and so its engine
    # request (the client is still connected here, so the test lets it go afterwards).
    stream = _LongStream(app.url)
    try:
        for replica in _egress_replicas(app):
            app.call("Directory", "forward_abort", AbortRequest(replica, [stream.rid]))
        deadline = time.monotonic() + 30
        while any(r.stats["num_running"] for r in _reports(app)):
            assert time.monotonic() < deadline, "the Egress replica never took the forwarded cancel"
            time.sleep(0.25)
    finally:
        stream.close()
    _wait_idle(app)
    # The replicas that did not hold the request take theirs too (a no-op there), each within its
    # report or poll interval, which may end after the holder has gone idle.
    deadline = time.monotonic() + 15
    while app.call("Directory", "num_forwarded_aborts"):
        assert time.monotonic() < deadline, (
            f"forwarded aborts were never taken: {app.directory_each('forwarded_aborts')}; engines "
            f"{[r.replica for r in _reports(app)]}, Egress {_egress_replicas(app)}")
        time.sleep(0.25)


def test_everything_is_free_afterwards(app: Any) -> None:
    reports = _wait_idle(app)
    assert len(reports) == 2


# -- the Directory at 2 replicas ----------------------------------------------------------------------
def _stream_then_cancel(url: str, cancel_url: str, key: str, label: str) -> tuple[int, list[str], int]:
    """Stream a long greedy completion labelled ``label``; three events in, cancel it through
    ``cancel_url`` by ``key`` ("label" or "id"). Returns the cancel's status, the finish reasons
    and the completion tokens the stream reported."""
    payload = {"model": MODEL_NAME, "messages": PROMPT, "temperature": 0, "max_tokens": 400, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}}
    events: list[dict[str, Any]] = []
    status = 0
    with httpx.stream("POST", url + CHAT, json=payload, headers={"X-Request-Id": label}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 3:
                name = label if key == "label" else events[0]["id"]
                status = httpx.post(f"{cancel_url}/v1/requests/{name}/cancel", timeout=30).status_code
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    return status, finishes, events[-1]["usage"]["completion_tokens"]


def test_a_cancel_by_id_through_either_ingress_cancels_with_two_directory_replicas(
        app: Any, ingress_ports: dict[str, int]) -> None:
    """With every deployment at 2 replicas, the Directory included: ten streams, each cancelled
    three events in, by its ``X-Request-Id`` or its response id, through either Ingress replica.
    A 200 must mean the stream was cancelled."""
    prefix = app.url.rsplit("/", 1)[-1]
    urls = [f"http://127.0.0.1:{port}/{prefix}" for port in sorted(ingress_ports.values())]
    results = []
    for i in range(10):
        label = f"dir2-{i}-{time.time_ns()}"
        results.append(_stream_then_cancel(urls[i % 2], urls[(i // 2) % 2], ("label", "id")[i % 2], label))
    assert [(status, finishes) for status, finishes, _ in results] == [(200, ["abort"])] * 10, results
    assert all(tokens < 400 for _, _, tokens in results), results
    _wait_idle(app)


def _directory_replicas(app: Any) -> dict[str, str]:
    """The Directory replicas' ids → actor names."""
    import ray

    prefix = f"SERVE_REPLICA::{app.name}#Directory#"
    return {a["name"][len(prefix):]: a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def test_a_lost_directory_replica_is_replaced_and_the_live_requests_register_again(app: Any) -> None:
    """SIGKILL one Directory replica while a stream runs: a cancel still works through the other,
    and the replacement learns every live request from their owners (no request restarts)."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    _wait_idle(app)
    before = _directory_replicas(app)
    assert len(before) == 2, before
    label = f"dir-kill-{time.time_ns()}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_chat, app.url, headers={"X-Request-Id": label}, timeout=180, max_tokens=400,
                          ignore_eos=True)
        deadline = time.monotonic() + 60
        while not any(e.client_request_id == label for e in app.call("Directory", "live_entries")):
            assert time.monotonic() < deadline, "the request never went live"
            time.sleep(0.1)
        lost = sorted(before)[0]
        ray.kill(ray.get_actor(before[lost], namespace=SERVE_NAMESPACE), no_restart=True)
        # Until Serve replaces it, the other replica answers (a read that reached the dead one
        # is asked again elsewhere).
        other = _stream_then_cancel(app.url, app.url, "label", f"dir-gap-{time.time_ns()}")
        assert other[:2] == (200, ["abort"]), other
        deadline = time.monotonic() + 90
        while True:
            now = _directory_replicas(app)
            if len(now) == 2 and lost not in now:
                lists = app.directory_each("live_entries")
                if set(lists) == set(now) and all(
                        not isinstance(v, BaseException) and any(e.client_request_id == label for e in v)
                        for v in lists.values()):
                    break
            assert time.monotonic() < deadline, f"the replacement never learnt the live request: {now}"
            time.sleep(0.25)
        answer = httpx.post(f"{app.url}/v1/requests/{label}/cancel", timeout=30)
        assert answer.status_code == 200 and len(answer.json()["cancelled"]) == 1, answer.text
        r = fut.result(timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort"
    _wait_idle(app)
