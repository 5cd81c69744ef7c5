"""Observability benchmarks (issue 4).

``ttft``: the source material's first experiment. The same request's TTFT measured by the client
alone and under 32 concurrent background streams, next to the server's own decomposition of that
request (prep, queue, prefill, from the final chunk's ``server_timing``). The engine admits at most
``--max-num-seqs`` requests per step, so background load builds a real waiting queue.

``tracing``: output tokens/s at 32 streams with tracing on (sampling 1.0, exported over OTLP to a
receiver in this process) versus off, alternating app starts (off, on, off, on) in one run.

    .venv/bin/python bench/experiments/bench_observability.py ttft
    .venv/bin/python bench/experiments/bench_observability.py tracing
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import MODEL_NAME, ServeApp, machine, stream_completion  # noqa: E402


async def _probe(client: httpx.AsyncClient, url: str, prompt_words: int, max_tokens: int) -> dict[str, float]:
    r = await stream_completion(client, url, {"model": MODEL_NAME, "prompt": "word " * prompt_words,
                                              "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    st = (r.final or {}).get("server_timing", {})
    return {"client_ttft_ms": r.ttft * 1e3, "prep_ms": st.get("prep", 0.0), "queue_ms": st.get("queue", 0.0),
            "prefill_ms": st.get("prefill", 0.0)}


async def ttft_experiment(url: str, a: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        await _probe(client, url, 8, 2)  # warm-up
        idle = [await _probe(client, url, a.prompt_words, a.max_tokens) for _ in range(a.reps)]
        stop = asyncio.Event()

        async def noise(i: int) -> None:
            while not stop.is_set():
                await stream_completion(client, url, {"model": MODEL_NAME, "max_tokens": a.noise_tokens,
                                                      "prompt": f"Write a long essay about memory {i}.",
                                                      "temperature": 0.8, "ignore_eos": True})

        bg = [asyncio.create_task(noise(i)) for i in range(a.streams)]
        await asyncio.sleep(a.settle)  # let the queue build
        loaded = [await _probe(client, url, a.prompt_words, a.max_tokens) for _ in range(a.reps)]
        stop.set()
        for t in bg:
            t.cancel()
        await asyncio.gather(*bg, return_exceptions=True)

    def med(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.median(r[k] for r in rows) for k in rows[0]}

    mi, ml = med(idle), med(loaded)
    diff = ml["client_ttft_ms"] - mi["client_ttft_ms"]
    return {"idle": mi, "loaded": ml, "ttft_increase_ms": diff,
            "queue_increase_ms": ml["queue_ms"] - mi["queue_ms"],
            "prefill_increase_ms": ml["prefill_ms"] - mi["prefill_ms"],
            "queue_share_of_increase": (ml["queue_ms"] - mi["queue_ms"]) / diff if diff else float("nan"),
            "raw": {"idle": idle, "loaded": loaded}}


async def throughput(url: str, streams: int, tokens: int) -> float:
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        await stream_completion(client, url, {"model": MODEL_NAME, "prompt": "warm", "max_tokens": 4})
        t0 = time.perf_counter()
        rs = await asyncio.gather(*[stream_completion(client, url, {
            "model": MODEL_NAME, "prompt": f"Tell a story about lighthouse {i}.", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True}) for i in range(streams)])
        return sum(r.num_tokens for r in rs) / (time.perf_counter() - t0)


def tracing_experiment(a: argparse.Namespace) -> dict[str, Any]:
    from tests.otlp_receiver import OTLPReceiver

    receiver = OTLPReceiver()
    results: dict[str, list[float]] = {"off": [], "on": []}
    for mode in ["off", "on"] * a.rounds:
        tracing = ({"enabled": True, "sampling_ratio": 1.0, "otlp_endpoint": receiver.endpoint}
                   if mode == "on" else {"enabled": False})
        app = ServeApp({"engine": {"max_num_seqs": 64}, "tracing": tracing})
        try:
            results[mode].append(asyncio.run(throughput(app.url, a.streams, a.tokens)))
        finally:
            app.close()
        print(mode, results[mode][-1], flush=True)
    spans = len(receiver.spans)
    receiver.close()
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    return {"tok_s": results, "median_off": off, "median_on": on, "on_over_off": on / off, "spans_received": spans}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("experiment", choices=["ttft", "tracing"])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--noise-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--settle", type=float, default=5.0)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    env = machine()
    print("machine:", env, flush=True)
    if a.experiment == "ttft":
        app = ServeApp({"engine": {"max_num_seqs": a.max_num_seqs}})
        try:
            result = asyncio.run(ttft_experiment(app.url, a))
        finally:
            app.close()
    else:
        result = tracing_experiment(a)
    out = Path(f"bench/results/{a.experiment}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "machine": env, "result": result}, indent=1))
    printable = {k: v for k, v in result.items() if k != "raw"}
    print(json.dumps(printable, indent=1))


if __name__ == "__main__":
    main()
