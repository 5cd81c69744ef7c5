"""What a move off a killed engine (or Egress) replica costs the client: the time from the kill
to the next token, against a fresh request's TTFT for a prompt as long as what the move recomputes.

    .venv/bin/python bench/experiments/migration_gap.py --rounds 3 --out bench/results/migration_gap.json
    .venv/bin/python bench/experiments/migration_gap.py --kill egress --rounds 3 --out ...

Serves ``serve_config.yaml``'s app args with the Engine (``--kill engine``) or the Egress
(``--kill egress``) at 2 fixed replicas (its own private Ray; the other stages at one replica
each). Each round: one greedy stream (``--prompt-tokens`` of prompt, ``--max-tokens`` out,
ignore_eos) is read until ``--kill-after`` tokens, then the replica running it is killed with
SIGKILL (the Egress replica that is using CPU: the other is idle); the client clocks the gap from
the kill to its next token and
checks the stream ends normally with every token. Then, on the surviving engine, a fresh request
with an uncached prompt of ``prompt + kill_after`` tokens gives the TTFT to compare with. The
killed replica's replacement is awaited before the next round.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _prompt(tokens: int) -> str:
    """About ``tokens`` tokens of text no other request shares (one word is about one token)."""
    tag = uuid.uuid4().hex[:8]
    return f"[{tag}] Summarise: " + " ".join(f"w{tag}{i % 97}" for i in range(max(1, tokens - 40)))


MODEL = {"name": ""}


def _body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL["name"], "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


def ttft(url: str, prompt: str) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=_body(prompt, 4), timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):  # the first chunk may carry only the role
                    return time.perf_counter() - t0
    raise RuntimeError("no token")


def complete(url: str, prompt: str, max_tokens: int) -> str:
    """The same greedy request, run without a move (its text, to compare)."""
    body = {**_body(prompt, max_tokens), "stream": False}
    body.pop("stream_options")
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    return r.json()["choices"][0]["message"]["content"]


def engines(app_name: str) -> dict[str, int]:
    from tests.fault_harness import replica_actors

    return {a["name"].rsplit("#", 1)[-1]: a["pid"] for a in replica_actors(app_name).get("Engine", [])}


def egresses(app_name: str) -> dict[str, int]:
    from tests.fault_harness import replica_actors

    return {a["name"].rsplit("#", 1)[-1]: a["pid"] for a in replica_actors(app_name).get("Egress", [])}


def busy_egress(app_name: str) -> str:
    """The Egress replica running the stream: the one holding the most jobs."""
    from tests.fault_harness import busiest_egress

    return busiest_egress(app_name)["name"].rsplit("#", 1)[-1]


def busy_engine(url: str) -> str:
    text = httpx.get(url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("lifecycle:num_requests_running{") and not line.endswith(" 0.0"):
            return line.split('replica="', 1)[1].split('"', 1)[0]
    raise RuntimeError("no engine reports a running request")


def trace_parts(otlp: Any, response_id: str | None, timeout: float = 10.0) -> dict[str, Any]:
    """Where the moved request's time went, from its trace: the ``migration`` span (the loss to
    the first token from the new replica) and the new replica's ``queue`` and ``prefill``."""
    rid = (response_id or "").split("-", 1)[-1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        roots = [sp for sp in otlp.spans if sp.attributes.get("lifecycle.request_id") == rid]
        if roots:
            spans = otlp.trace(roots[0].trace_id)
            moves = [sp for sp in spans if sp.name == "migration"]
            if moves and moves[0].attributes.get("lifecycle.migration.time_lost_ms") is not None:
                ms = lambda sp: (sp.end_ns - sp.start_ns) / 1e6  # noqa: E731
                queues = sorted((sp for sp in spans if sp.name == "queue"), key=lambda sp: sp.start_ns)
                prefills = sorted((sp for sp in spans if sp.name == "prefill"), key=lambda sp: sp.start_ns)
                return {"migration_ms": ms(moves[0]), **{k.rsplit(".", 1)[-1]: v for k, v in moves[0].attributes.items()},
                        "new_queue_ms": ms(queues[-1]) if len(queues) > 1 else None,
                        "new_prefill_ms": ms(prefills[-1]) if len(prefills) > 1 else None}
        time.sleep(0.5)
    return {}


def one_round(url: str, app_name: str, a: argparse.Namespace, otlp: Any = None) -> dict[str, Any]:
    times: list[float] = []
    tokens: list[int] = []
    text: list[str] = []
    done: dict[str, Any] = {}
    reached = threading.Event()
    prompt = _prompt(a.prompt_tokens)

    def client() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=_body(prompt, a.max_tokens),
                          timeout=300) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                done.setdefault("id", chunk.get("id"))
                if "error" in chunk:
                    done["error"] = chunk["error"]
                if chunk.get("usage"):
                    done["usage"] = chunk["usage"]
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    text.append(chunk["choices"][0]["delta"]["content"])
                    times.append(time.perf_counter())
                    tokens.append(len(times))
                    if len(times) >= a.kill_after:
                        reached.set()

    steady = ttft(url, _prompt(a.prompt_tokens + a.kill_after))  # both engines up, nothing else running
    t = threading.Thread(target=client)
    t.start()
    reached.wait(300)
    time.sleep(0.3)  # the metrics report catches up (engines report every second)
    if a.kill == "egress":
        victim = busy_egress(app_name)
        pids = egresses(app_name)
    else:
        victim = busy_engine(url)
        pids = engines(app_name)
    killed_at = time.perf_counter()
    os.kill(pids[victim], signal.SIGKILL)
    t.join(300)
    after = [x for x in times if x > killed_at]
    before_gaps = [b - a_ for a_, b in zip(times, times[1:], strict=False) if b < killed_at]
    fresh = ttft(url, _prompt(a.prompt_tokens + a.kill_after))  # while the replacement starts
    deadline = time.monotonic() + 300
    while len((egresses if a.kill == "egress" else engines)(app_name)) < 2 and time.monotonic() < deadline:
        time.sleep(1)
    time.sleep(15)  # the replacement loads its model and starts reporting
    moved = "".join(text)
    again = [complete(url, prompt, a.max_tokens) for _ in range(2)]  # the same prompt, unmoved, twice

    def diverge(x: str, y: str) -> int:
        return next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))

    out = {"gap_kill_to_next_token_s": after[0] - killed_at if after else None,
           "chars_before_kill": len("".join(text[:len(times) - len(after)])),
           "moved_vs_unmoved_diverge_at_char": diverge(moved, again[0]),
           "unmoved_twice_diverge_at_char": diverge(again[0], again[1]), "chars": len(moved),
           "steady_ttft_s": steady,
           "trace": trace_parts(otlp, done.get("id")) if otlp is not None and a.kill == "engine" else None,
           "itl_before_p50_s": statistics.median(before_gaps) if before_gaps else None,
           "fresh_ttft_s": fresh, "completion_tokens": (done.get("usage") or {}).get("completion_tokens"),
           "error": done.get("error"), "same_text_as_unmoved": moved == again[0],
           "unmoved_runs_agree": again[0] == again[1]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--kill-after", type=int, default=24)
    p.add_argument("--kill", choices=["engine", "egress"], default="engine")
    p.add_argument("--out", default="bench/results/migration_gap.json")
    a = p.parse_args()
    os.environ["RAY_ADDRESS"] = "local"
    from tests.otlp_receiver import OTLPReceiver
    from tests.serve_harness import start_app, stop_app

    otlp = OTLPReceiver()
    args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    args["tracing"] = {"enabled": True, "sampling_ratio": 1.0, "otlp_endpoint": otlp.endpoint}
    stage = "Engine" if a.kill == "engine" else "Egress"
    options = {stage: {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5 if a.kill == "engine" else 0.1}}}
    url, _ = start_app(args, options=options)
    MODEL["name"] = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    try:
        rounds = []
        for _ in range(a.rounds):
            r = one_round(url, "lifecycle", a, otlp)
            print(json.dumps(r), flush=True)
            rounds.append(r)
        gaps = [r["gap_kill_to_next_token_s"] for r in rounds if r["gap_kill_to_next_token_s"] is not None]
        fresh = [r["fresh_ttft_s"] for r in rounds]
        summary = {"gap_p50_s": statistics.median(gaps) if gaps else None, "fresh_ttft_p50_s": statistics.median(fresh),
                   "steady_ttft_p50_s": statistics.median(r["steady_ttft_s"] for r in rounds),
                   "unmoved_runs_agree": sum(r["unmoved_runs_agree"] for r in rounds),
                   "ratio": statistics.median(gaps) / statistics.median(fresh) if gaps else None,
                   "all_complete": all(r["completion_tokens"] == a.max_tokens and r["error"] is None for r in rounds),
                   "same_text": sum(r["same_text_as_unmoved"] for r in rounds)}
        print(json.dumps(summary), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "rounds": rounds, "summary": summary}, indent=1))
    finally:
        stop_app()
        otlp.close()


if __name__ == "__main__":
    main()
