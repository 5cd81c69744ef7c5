"""Resumable streams against the real app with every stage at 2 replicas: a client that drops its
connection reconnects with ``Last-Event-ID`` (on either Ingress replica) and gets exactly the
events it missed, then the rest live; a stream nobody reconnects to is aborted when its grace
period ends; unknown and attached streams get 404 and 409; a stream that did not ask to be
resumable is still aborted at once."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.sse_events import Events

pytestmark = pytest.mark.serve

CHAT = "/v1/chat/completions"
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
TOKENS = 40


def _body(max_tokens: int = TOKENS) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": PROMPT, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}


def _start(client: httpx.Client, url: str, stop: int, *, grace: str | None = "30", max_tokens: int = TOKENS,
           headers: dict[str, str] | None = None) -> Events:
    h = {**({"X-Resumable": grace} if grace is not None else {}), **(headers or {})}
    with client.stream("POST", url + CHAT, json=_body(max_tokens), headers=h) as resp:
        return Events().read(resp, stop)


def _resume(client: httpx.Client, url: str, key: str, after: int, stop: int | None = None,
            query: bool = False) -> Events:
    path = f"{url}/v1/requests/{key}/events"
    if query:
        with client.stream("GET", path, params={"starting_after": after}) as resp:
            return Events().read(resp, stop)
    with client.stream("GET", path, headers={"Last-Event-ID": str(after)}) as resp:
        return Events().read(resp, stop)


@pytest.fixture(scope="module")
def app(serve_app_replicas: Any) -> Any:
    return serve_app_replicas


@pytest.fixture(scope="module")
def clean(app: Any) -> Events:
    """The uninterrupted run, alone: what every resumed stream must join up to."""
    with httpx.Client(timeout=120) as client:
        run = _start(client, app.url, stop=None, grace=None)
    assert run.events[-1][1] == "[DONE]" and run.usage()["completion_tokens"] == TOKENS
    assert run.ids() == list(range(len(run.events)))
    return run


def _check_joined(parts: list[Events], clean: Events) -> None:
    """No gap, no duplicate: the ids run on from part to part, and the text is the clean run's."""
    ids = [i for p in parts for i in p.ids()]
    assert ids == list(range(len(ids))), ids
    assert "".join(p.text() for p in parts) == clean.text()
    last = parts[-1]
    assert last.events[-1][1] == "[DONE]"
    assert last.usage()["completion_tokens"] == TOKENS and last.finish_reason() == "length"


def test_resume_after_five_events_joins_to_the_uninterrupted_text(app: Any, clean: Events) -> None:
    with httpx.Client(timeout=120) as client:
        first = _start(client, app.url, stop=5)
        assert first.last_id == 4
        rest = _resume(client, app.url, first.response_id, first.last_id)
    _check_joined([first, rest], clean)


def test_resume_twice_by_header_then_by_query(app: Any, clean: Events) -> None:
    with httpx.Client(timeout=120) as client:
        first = _start(client, app.url, stop=3)
        second = _resume(client, app.url, first.response_id, first.last_id, stop=3)
        third = _resume(client, app.url, first.response_id, second.last_id, query=True)
    _check_joined([first, second, third], clean)


def test_resume_through_the_other_ingress_replica(app: Any, ingress_ports: dict[str, int], clean: Events) -> None:
    prefix = app.url.rsplit("/", 1)[-1]
    (_, port_a), (_, port_b) = sorted(ingress_ports.items())
    label = f"resume-other-{time.time_ns()}"
    with httpx.Client(timeout=120) as client:
        first = _start(client, f"http://127.0.0.1:{port_a}/{prefix}", stop=4, headers={"X-Request-Id": label})
        # By the client's label this time: exactly one live request carries it.
        rest = _resume(client, f"http://127.0.0.1:{port_b}/{prefix}", label, first.last_id)
    _check_joined([first, rest], clean)
    lines = _log_lines(app.request_log, label)
    assert [line["outcome"] for line in lines] == ["detached", "ok"], lines
    assert lines[-1]["reconnects"] == 1 and lines[0]["request_id"] == lines[1]["request_id"]


def _log_lines(path: str, label: str, count: int = 2, timeout: float = 10.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        with open(path) as f:
            found = [json.loads(line) for line in f if f'"x_request_id":"{label}"' in line]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_resume_after_the_request_finished_within_its_grace(app: Any, clean: Events) -> None:
    with httpx.Client(timeout=120) as client:
        first = _start(client, app.url, stop=2)
        app.wait_engines_idle(2, 30)  # it finished with nobody attached: its events are kept
        rest = _resume(client, app.url, first.response_id, first.last_id)
    _check_joined([first, rest], clean)


def test_a_stream_nobody_reconnects_to_is_aborted_when_its_grace_ends(app: Any) -> None:
    with httpx.Client(timeout=120) as client:
        first = _start(client, app.url, stop=2, grace="1", max_tokens=2000)
        time.sleep(0.5)
        busy = app.engine_reports()
        assert any(r.stats["num_running"] for r in busy), "the request should still run, detached"
        app.wait_engines_idle(2, 15)  # aborted at expiry: its blocks are free
        r = client.get(f"{app.url}/v1/requests/{first.response_id}/events")
    assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
    assert app.call("Directory", "num_kept") == 0


def test_unknown_gets_404_and_attached_gets_409(app: Any) -> None:
    with httpx.Client(timeout=120) as client:
        r = client.get(f"{app.url}/v1/requests/chatcmpl-nothing/events")
        assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
        bad = client.get(f"{app.url}/v1/requests/chatcmpl-nothing/events", headers={"Last-Event-ID": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
        bad = client.post(app.url + CHAT, json=_body(), headers={"X-Resumable": "601"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Resumable"

        # Long enough to stay attached through the reconnect's wait for it to be noticed gone.
        conflict: list[httpx.Response] = []
        with client.stream("POST", app.url + CHAT, json=_body(2000), headers={"X-Resumable": "30"}) as resp:
            events = Events()
            lines = resp.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.events.append((0, line[6:]))
                    break
            deadline = time.monotonic() + 5  # its Ingress registers it in the directory a moment after it starts
            while not any(e.response_id == events.response_id for e in app.call("Directory", "live_entries")):
                assert time.monotonic() < deadline, "the stream never reached the directory"
                time.sleep(0.05)
            t = threading.Thread(target=lambda: conflict.append(
                httpx.get(f"{app.url}/v1/requests/{events.response_id}/events", timeout=30)))
            t.start()
            t.join()
            # Still attached: cancel it by id and read it to the end (finish_reason "abort").
            assert client.post(f"{app.url}/v1/requests/{events.response_id}/cancel").status_code == 200
            rest = list(lines)
        assert conflict[0].status_code == 409, conflict[0].text
        assert "data: [DONE]" in rest
        # Read to the end: nothing is kept, nothing to resume.
        gone = client.get(f"{app.url}/v1/requests/{events.response_id}/events")
        assert gone.status_code == 404


def test_a_stream_that_did_not_ask_is_aborted_at_once(app: Any) -> None:
    with httpx.Client(timeout=120) as client:
        first = _start(client, app.url, stop=2, grace=None, max_tokens=2000)
        t0 = time.monotonic()
        app.wait_engines_idle(2, 5)
        r = client.get(f"{app.url}/v1/requests/{first.response_id}/events")
    assert time.monotonic() - t0 < 5
    assert r.status_code == 404


def test_a_detached_stream_cancelled_by_id_ends_and_is_no_longer_resumable(app: Any) -> None:
    label = f"resume-cancel-{time.time_ns()}"
    with httpx.Client(timeout=120) as client:
        first = _start(client, app.url, stop=2, max_tokens=2000, headers={"X-Request-Id": label})
        deadline = time.monotonic() + 5
        while app.call("Directory", "num_kept") == 0:  # detached: the Egress replica keeps it
            assert time.monotonic() < deadline, "the stream was never detached"
            time.sleep(0.05)
        r = client.post(f"{app.url}/v1/requests/{label}/cancel")
        assert r.status_code == 200 and [c["id"] for c in r.json()["cancelled"]] == [first.response_id], r.text
        app.wait_engines_idle(2, 10)
        gone = client.get(f"{app.url}/v1/requests/{first.response_id}/events")
    assert gone.status_code == 404
    assert app.call("Directory", "num_kept") == 0
