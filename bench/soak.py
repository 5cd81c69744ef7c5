"""Disconnect soak: churn for a fixed time, then check that nothing leaked.

``make soak`` (``python -m bench.soak --duration 600``) starts the app in a private Ray session and
runs a bounded request loop against it: ``--concurrency`` (32) clients back to back, each request
one of

- ~30% dropped by the client at a random point: before the response headers, after the headers
  (during prefill), or after a random number of decode events;
- ~8% cancelled by id (``POST /v1/requests/{id}/cancel`` after the first token), read to the end;
- the rest normal, streamed or not, with random ``n`` (1-3), random stop strings and lengths,
  checked for a complete, well-formed answer (a 429 from a full queue is allowed and counted).

At the end (after the clients stop): 0 requests running and waiting in the engine, KV usage 0,
no open engine streams, and no live-request entry left in the Directory (``num_live``); and every
actor's RSS (from ``/proc``, PIDs from Ray's GCS actor table) flat after warm-up: the median of the
last three samples within ``--rss-tolerance`` (10%) of the median of the first three after warm-up.

The 12-second version runs in the tests (tests/app/test_soak.py) against the fault tests' app.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fault_harness import replica_actors, rss_bytes  # noqa: E402

MODEL_NAME = "SmolLM2-135M-Instruct"
PROMPTS = ["Tell me a story about a fox.", "List some fruits:", "Write a haiku about the sea.",
           "Explain how rain forms.", "Once upon a time", "The capital of France is"]
STOPS = [".", "\n", " the", ",", "and", "!"]

#: The soak's own app for ``make soak``: small engine limits so the queue, the batch and the KV
#: cache all fill under 32 clients.
SOAK_ARGS: dict[str, Any] = {
    "model": "embedded:smollm2-135m-instruct",
    "engine": {"max_num_seqs": 16, "max_waiting_requests": 32, "max_num_batched_tokens": 256,
               "kv_cache_memory_gb": 0.25, "report_interval_s": 0.5},
    "http": {"keepalive_interval_s": 1.0},
}


@dataclass
class SoakReport:
    duration_s: float
    concurrency: int
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    rss: dict[str, dict[str, float]] = field(default_factory=dict)
    leaks: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())

    def to_dict(self) -> dict[str, Any]:
        return {"duration_s": self.duration_s, "concurrency": self.concurrency, "requests": self.requests,
                "outcomes": dict(self.outcomes), "failures": self.failures[:20], "num_failures": len(self.failures),
                "final": self.final, "rss": self.rss, "leaks": self.leaks}


def _body(rng: random.Random, stream: bool) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": rng.randint(8, 48), "stream": stream,
                            "temperature": rng.choice([0.0, 0.8]), "n": rng.choice([1, 1, 1, 2, 3])}
    if rng.random() < 0.5:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
    return "/v1/completions", {**body, "prompt": rng.choice(PROMPTS)}


def _check_stream(events: list[str], n: int) -> str | None:
    """Why a complete stream is malformed, or None."""
    if not events or events[-1] != "[DONE]":
        return "no [DONE]"
    finished: set[int] = set()
    for data in events[:-1]:
        event = json.loads(data)
        if "error" in event:
            return f"error event: {event['error']}"
        for choice in event.get("choices", []):
            if choice.get("finish_reason"):
                finished.add(choice["index"])
    return None if finished == set(range(n)) else f"finished choices {sorted(finished)} of {n}"


async def _drop(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], rng: random.Random,
                where: str) -> str:
    """Send a streamed request and leave at ``where``: early (likely before the headers), right
    after the headers (prefill), or after some decode events."""
    async def go() -> None:
        async with client.stream("POST", url + path, json=body) as resp:
            if where == "headers" or resp.status_code != 200:
                return
            seen, wanted = 0, rng.randint(1, 12)
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= wanted:
                        return

    if where == "early":
        task = asyncio.ensure_future(go())
        await asyncio.sleep(rng.uniform(0.0, 0.03))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    else:
        await go()
    return f"drop_{where}"


async def _cancel_by_id(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> tuple[str, str | None]:
    body = {**body, "stream": True, "max_tokens": 200, "ignore_eos": True}
    body.pop("stop", None)
    events: list[str] = []
    async with client.stream("POST", url + path, json=body) as resp:
        if resp.status_code == 429:
            return "queue_full", None
        if resp.status_code != 200:
            return "failed", f"cancel stream status {resp.status_code}"
        cancelled = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if not cancelled and line[6:] != "[DONE]":
                rid = json.loads(line[6:]).get("id")
                r = await client.post(f"{url}/v1/requests/{rid}/cancel")
                if r.status_code not in (200, 404):
                    return "failed", f"cancel answered {r.status_code}: {r.text[:200]}"
                cancelled = True
    problem = _check_stream(events, body["n"])
    return ("cancelled", None) if problem is None else ("failed", f"cancelled stream: {problem}")


async def _normal(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> tuple[str, str | None]:
    if not body["stream"]:
        r = await client.post(url + path, json=body)
        if r.status_code == 429:
            return "queue_full", None
        if r.status_code != 200 or len(r.json().get("choices", [])) != body["n"]:
            return "failed", f"status {r.status_code}: {r.text[:200]}"
        return "ok", None
    events: list[str] = []
    async with client.stream("POST", url + path, json=body) as resp:
        if resp.status_code == 429:
            return "queue_full", None
        if resp.status_code != 200:
            return "failed", f"status {resp.status_code}"
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    problem = _check_stream(events, body["n"])
    return ("ok", None) if problem is None else ("failed", problem)


async def _client(url: str, deadline: float, seed: int, report: SoakReport) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        while time.monotonic() < deadline:
            roll = rng.random()
            path, body = _body(rng, stream=rng.random() < 0.85)
            try:
                if roll < 0.30:
                    outcome, problem = await _drop(client, url, path, {**body, "stream": True}, rng,
                                                   rng.choice(["early", "headers", "decode"])), None
                elif roll < 0.38:
                    outcome, problem = await _cancel_by_id(client, url, path, body)
                else:
                    outcome, problem = await _normal(client, url, path, body)
            except httpx.HTTPError as exc:
                outcome, problem = "failed", f"{type(exc).__name__}: {exc}"
            report.outcomes[outcome] += 1
            if problem is not None:
                report.failures.append(problem)


class RssSampler:
    """RSS of every actor of the app (and Serve's proxy and controller) every ``period_s``."""

    def __init__(self, app: str, period_s: float) -> None:
        self.app, self.period_s = app, period_s
        self.samples: dict[str, list[tuple[float, int]]] = {}
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _pids(self) -> dict[str, int]:
        import ray._private.state as ray_state

        pids = {r["name"]: r["pid"] for rs in replica_actors(self.app).values() for r in rs}
        for actor in ray_state.actors().values():
            name = actor.get("Name") or ""
            if actor.get("State") == "ALIVE" and name.startswith(("SERVE_PROXY_ACTOR", "SERVE_CONTROLLER_ACTOR")):
                pids[name.split("-")[0]] = actor["Pid"]
        return pids

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                now = time.monotonic() - self.t0
                for name, pid in self._pids().items():
                    rss = rss_bytes(pid)
                    if rss:
                        self.samples.setdefault(name, []).append((now, rss))
            except Exception:  # noqa: BLE001 - a sample missed while the GCS is busy
                pass
            self._stop.wait(self.period_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def drift(self, warmup_s: float) -> dict[str, dict[str, float]]:
        """Per actor: MiB at the start and end of the measured window and the relative drift."""
        out = {}
        for name, samples in self.samples.items():
            kept = [rss for t, rss in samples if t >= warmup_s]
            if len(kept) < 6:
                continue
            first, last = statistics.median(kept[:3]), statistics.median(kept[-3:])
            out[name.replace("SERVE_REPLICA::", "")] = {"start_mib": round(first / 2**20, 1),
                                                         "end_mib": round(last / 2**20, 1),
                                                         "max_mib": round(max(kept) / 2**20, 1),
                                                         "drift": round((last - first) / first, 4)}
        return out


def run_soak(url: str, app: str, call: Callable[[str, str], Any], duration_s: float, *, concurrency: int = 32,
             warmup_s: float | None = None, rss_tolerance: float = 0.10, settle_s: float = 30.0,
             seed: int = 0) -> SoakReport:
    """Run the churn loop for ``duration_s``, then check the end state (see the module docstring).
    ``call(deployment, method)`` calls a method of one of the app's deployments."""
    warmup_s = duration_s * 0.2 if warmup_s is None else warmup_s
    report = SoakReport(duration_s, concurrency)
    sampler = RssSampler(app, period_s=max(1.0, duration_s / 60))

    async def clients() -> None:
        deadline = time.monotonic() + duration_s
        await asyncio.gather(*(_client(url, deadline, seed * 1000 + i, report) for i in range(concurrency)))

    try:
        asyncio.run(clients())
    finally:
        sampler.close()
    report.rss = sampler.drift(warmup_s)
    # Nothing may be left once the clients are gone (aborts land within a step; the directory's
    # removals are batched), so allow a short settling time, then record what is left.
    deadline = time.monotonic() + settle_s
    while True:
        stats, live = call("Engine", "stats"), call("Directory", "num_live")
        report.final = {"num_running": stats["num_running"], "num_waiting": stats["num_waiting"],
                        "kv_cache_usage": stats["kv_cache_usage"], "num_streams": stats["num_streams"],
                        "num_live": live, "tokens_after_gone": stats.get("tokens_after_gone"),
                        "finished_total": stats.get("finished_total")}
        clean = not (stats["num_running"] or stats["num_waiting"] or stats["kv_cache_usage"]
                     or stats["num_streams"] or live)
        if clean or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if not clean:
        report.leaks.append(f"not idle {settle_s:.0f} s after the clients stopped: {report.final}")
    for name, r in report.rss.items():
        if r["drift"] > rss_tolerance:
            report.leaks.append(f"{name} RSS grew {r['drift']:.1%} after warm-up ({r['start_mib']} -> {r['end_mib']} MiB)")
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of churn (default 600)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--warmup", type=float, default=None, help="seconds excluded from the RSS check (20%%)")
    ap.add_argument("--rss-tolerance", type=float, default=0.10)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    args = ap.parse_args()

    from bench.common import machine
    from tests.conftest import ServeApp
    from tests.serve_harness import deploy_app, start_ray, stop_app

    start_ray(num_cpus=8)
    url = deploy_app(SOAK_ARGS, name="soak", route_prefix="/soak")
    app = ServeApp(url=url, otlp=None, args=SOAK_ARGS, name="soak")
    try:
        t0 = time.monotonic()
        report = run_soak(url, "soak", app.call, args.duration, concurrency=args.concurrency,
                          warmup_s=args.warmup, rss_tolerance=args.rss_tolerance)
        result = {**report.to_dict(), "wall_s": round(time.monotonic() - t0, 1), "machine": machine(),
                  "config": SOAK_ARGS}
    finally:
        stop_app()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    ok = not report.failures and not report.leaks
    print(f"\nsoak {'PASSED' if ok else 'FAILED'}: {report.requests} requests in {args.duration:.0f} s, "
          f"{len(report.failures)} failures, {len(report.leaks)} leaks; written to {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
