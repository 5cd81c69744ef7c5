"""Requests that move off a killed engine replica (the app with every stage at 2 replicas): the
clients see one uninterrupted stream with the full token count and the text of a run that never
moved, greedy or seeded. (With no other engine left the client gets the old error event:
``tests/app/test_faults.py::test_engine_replica_killed_mid_stream``, on a one-engine app.)

The engine killed here is replaced by Serve; the last test waits for both engines again, since
other tests share this app."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.fault_harness import busiest_egress, replica_actors
from tests.sse_events import Events

pytestmark = pytest.mark.serve

CHAT = "/v1/chat/completions"
TOKENS = 64
STREAMS = 8


def _body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0, **extra}


def _run(url: str, body: dict[str, Any], started: list[int] | None = None) -> Events:
    with httpx.Client(timeout=180) as client, client.stream("POST", url + CHAT, json=body) as resp:
        events = Events().read(resp, stop=3)
        if started is not None:
            started.append(1)
        return events.read(resp)


def _engines(app: Any) -> list[Any]:
    return [r for r in app.engine_reports() if r.healthy]


def _kill_busiest_engine(app: Any) -> str:
    """SIGKILL the engine replica running the most requests (as its latest report says); returns
    its name."""
    deadline = time.monotonic() + 5
    while True:
        reports = sorted(_engines(app), key=lambda r: r.stats["num_running"], reverse=True)
        if reports and reports[0].stats["num_running"] > 0:
            break
        assert time.monotonic() < deadline, [r.stats["num_running"] for r in reports]
        time.sleep(0.05)
    victim = reports[0].replica
    (actor,) = [a for a in replica_actors(app.name)["Engine"] if a["name"].endswith(victim)]
    os.kill(actor["pid"], signal.SIGKILL)
    return victim


def _kill(app: Any, stage: str) -> None:
    """SIGKILL the replica of ``stage`` ("Engine" or "Egress") running the streams."""
    if stage == "Engine":
        _kill_busiest_engine(app)
    else:
        os.kill(busiest_egress(app.name)["pid"], signal.SIGKILL)


def _run_killing(app: Any, body: dict[str, Any], streams: int, stage: str) -> list[Events]:
    """``streams`` copies of ``body`` at once; once each has 3 content events, kill the ``stage``
    replica running them; every stream, read to its end."""
    started: list[int] = []
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(_run, app.url, body, started) for _ in range(streams)]
        deadline = time.monotonic() + 60
        while len(started) < streams and time.monotonic() < deadline:
            time.sleep(0.02)
        _kill(app, stage)
        return [f.result(timeout=180) for f in futures]


def _wait_replaced(app: Any, stage: str) -> None:
    """Until Serve has replaced the killed replica and both engines are idle (others share this app)."""
    deadline = time.monotonic() + 90
    while len(replica_actors(app.name).get(stage, [])) < 2:
        assert time.monotonic() < deadline, f"Serve never replaced the {stage} replica"
        time.sleep(0.5)
    app.wait_engines_idle(2, 180)


def _metric(app: Any, name: str) -> float:
    text = httpx.get(app.url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _check(run: Events, clean: Events) -> None:
    assert run.events[-1][1] == "[DONE]" and all('"error"' not in d for _, d in run.events), run.events[-3:]
    assert run.ids() == list(range(len(run.events)))
    assert run.usage()["completion_tokens"] == clean.usage()["completion_tokens"] and run.finish_reason() == "length"
    assert run.text() == clean.text()


@pytest.fixture(scope="module")
def app(serve_app_replicas: Any) -> Any:
    serve_app_replicas.wait_engines_idle(2, 180)
    return serve_app_replicas


def test_greedy_streams_move_off_a_killed_engine_without_a_seam(app: Any) -> None:
    body = _body("Describe a walk along a river in spring.")
    clean = _run(app.url, body)
    for run in _run_killing(app, body, STREAMS, "Engine"):
        _check(run, clean)
    assert _metric(app, "lifecycle:migrations_total") >= 1, "the Egress replicas counted no migration"


def test_greedy_streams_move_off_a_killed_egress_without_a_seam(app: Any) -> None:
    """SIGKILL an Egress replica under 8 streams: each stream it ran goes on through the other one
    (stages/ingress/egress_moves.py), rebuilt from what its client received."""
    app.wait_engines_idle(2, 180)
    # Long enough that the streams still run when the replica holding them has been found and killed.
    body = _body("Describe a harbour at dawn.", max_tokens=2 * TOKENS)
    clean = _run(app.url, body)
    before = _metric(app, "lifecycle:egress_moves_total")
    for run in _run_killing(app, body, STREAMS, "Egress"):
        _check(run, clean)
    deadline = time.monotonic() + 15  # each Ingress replica's counters reach /metrics within seconds
    while _metric(app, "lifecycle:egress_moves_total") <= before:
        assert time.monotonic() < deadline, "no stream was counted as moved"
        time.sleep(0.5)
    _wait_replaced(app, "Egress")


@pytest.mark.parametrize("stage", ["Engine", "Egress"])
def test_a_moved_stream_is_still_cancelled_by_id(app: Any, stage: str) -> None:
    """After a move off either stage, a cancel by the response id reaches where the stream runs
    now: it ends with ``finish_reason: abort``, its usage, and no error event."""
    app.wait_engines_idle(2, 180)
    body = _body("Tell a long story about a lighthouse keeper.", max_tokens=400)
    with httpx.Client(timeout=180) as client, client.stream("POST", app.url + CHAT, json=body) as resp:
        events = Events().read(resp, stop=3)
        _kill(app, stage)
        events.read(resp, stop=5)  # tokens from where it runs now
        answer = client.post(f"{app.url}/v1/requests/{events.response_id}/cancel")
        assert answer.status_code == 200, answer.text
        events.read(resp)
    assert all('"error"' not in d for _, d in events.events), events.events[-3:]
    assert events.finish_reason() == "abort" and events.usage()["completion_tokens"] < 400
    assert events.ids() == list(range(len(events.events)))
    _wait_replaced(app, stage)


def test_a_seeded_request_with_two_choices_moved_draws_what_it_would_have(app: Any) -> None:
    """n = 2: both choices move together, each with its own tokens and its own random stream. (One
    seeded choice moved is the core's: ``tests/unit/engine/core/test_migration.py``; its transport
    is the greedy test's.)"""
    app.wait_engines_idle(2, 180)
    body = _body("Name three rivers and a mountain.", temperature=1.0, seed=77, n=2)
    clean = _run(app.url, body)  # alone: batch 2, as the moved run's choices
    (run,) = _run_killing(app, body, 1, "Engine")
    assert run.events[-1][1] == "[DONE]" and all('"error"' not in d for _, d in run.events), run.events[-3:]
    assert run.ids() == list(range(len(run.events)))
    assert run.usage()["completion_tokens"] == 2 * TOKENS
    assert [run.text(0), run.text(1)] == [clean.text(0), clean.text(1)]
    assert clean.text(0) != clean.text(1)  # two random streams, not one twice
    app.wait_engines_idle(2, 180)  # others share this app
