"""Does a client that stops reading slow the others down?

Runs, in one Ray session and interleaved (A B A B ...), 8 normal streamed completions
(``--max-tokens`` tokens each, ``ignore_eos``) either alone (A) or beside one slow reader (B): a
streamed chat request with 20 top logprobs (~2 KB per token) on a socket that is never read, sent
to the Ingress replica's own HTTP server (direct ingress, where the ASGI send waits for the socket). Reports the normal streams' decode tok/s per stream and in aggregate
(medians over rounds) and the ratio B/A; whether the slow reader was aborted (``slow_reader``) and
the Ingress replica's RSS.

``--via-proxy`` also runs the slow reader through Serve's HTTP proxy instead (C), where the Ingress
never sees backpressure: it reports whether it was aborted and how the proxy's RSS moved.

    python bench/experiments/bench_slow_reader.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import MODEL_NAME, machine  # noqa: E402
from tests.fault_harness import RawStream, direct_ingress_url, replica_actors, rss_bytes  # noqa: E402

ARGS: dict[str, Any] = {
    "model": "embedded:smollm2-135m-instruct",
    "engine": {"max_num_seqs": 16, "max_waiting_requests": 16, "max_num_batched_tokens": 256,
               "kv_cache_memory_gb": 0.25, "report_interval_s": 0.5, "weights": "float32"},
    "http": {"keepalive_interval_s": 1.0, "max_stream_buffer_bytes": 65536, "slow_reader_grace_s": 5.0},
}
#: The slow reader: one choice, 20 top logprobs (~2 KB per token) on a socket never read. It is one
#: more sequence in the batch, which is the cost a reading client would have too.
SLOW_BODY = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a long story."}],
             "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True,
             "logprobs": True, "top_logprobs": 20}
#: For the proxy run: heavy enough (8 choices, ~17 KB per step) that the bound would trip quickly.
HEAVY_BODY = {**SLOW_BODY, "max_tokens": 400, "n": 8}


async def _one(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[int, float]:
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story about the sea:", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and '"text":"' in line and '"text":""' not in line:
                last = time.perf_counter()
                first = first or last
                tokens += 1
    return tokens, (last - first) if first and last else 0.0


async def _normal_streams(url: str, n: int, max_tokens: int) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, max_tokens) for _ in range(n)))
        wall = time.perf_counter() - t0
    per_stream = [tok / span for tok, span in results if span > 0]
    return {"per_stream_tok_s": statistics.median(per_stream), "aggregate_tok_s": sum(t for t, _ in results) / wall}


def _aborts(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^lifecycle:slow_reader_aborts_total\{[^}]*\} (\S+)$", text, re.M))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--via-proxy", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "slow_reader.json")
    args = ap.parse_args()

    from tests.serve_harness import deploy_app, start_ray, stop_app

    start_ray(num_cpus=8)
    url = deploy_app(ARGS, name="slow", route_prefix="/slow")
    direct = direct_ingress_url("slow", "/slow")
    ingress_pid = replica_actors("slow")["Ingress"][0]["pid"]
    rows: list[dict[str, Any]] = []
    try:
        asyncio.run(_normal_streams(url, args.streams, 16))  # warm-up
        for r in range(args.rounds):
            for mode in ("alone", "beside_slow_reader"):
                slow = None
                before = _aborts(url)
                if mode != "alone":
                    slow = RawStream(direct, SLOW_BODY, path="/v1/chat/completions")
                    time.sleep(1.0)
                res = asyncio.run(_normal_streams(url, args.streams, args.max_tokens))
                if slow is not None:
                    res["slow_reader_aborted"] = _aborts(url) > before
                    slow.close()
                    time.sleep(1.0)
                res.update(round=r, mode=mode, ingress_rss_mib=rss_bytes(ingress_pid) >> 20)
                rows.append(res)
                print(json.dumps(res), flush=True)
        proxy = None
        if args.via_proxy:
            import ray._private.state as ray_state

            proxy_pid = next(a["Pid"] for a in ray_state.actors().values()
                             if (a.get("Name") or "").startswith("SERVE_PROXY_ACTOR") and a["State"] == "ALIVE")
            before, rss0 = _aborts(url), rss_bytes(proxy_pid)
            slow = RawStream(url, HEAVY_BODY, path="/v1/chat/completions")
            peak = rss0
            for _ in range(90):
                time.sleep(1)
                peak = max(peak, rss_bytes(proxy_pid))
                if _aborts(url) > before:
                    break
            proxy = {"aborted": _aborts(url) > before, "proxy_rss_before_mib": rss0 >> 20,
                     "proxy_rss_peak_mib": peak >> 20}
            slow.close()
            print(json.dumps({"via_proxy": proxy}), flush=True)
    finally:
        stop_app()

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    summary = {key: {"alone": round(med("alone", key), 2), "beside_slow_reader": round(med("beside_slow_reader", key), 2),
                     "ratio": round(med("beside_slow_reader", key) / med("alone", key), 3)}
               for key in ("per_stream_tok_s", "aggregate_tok_s")}
    result = {"summary": summary, "rows": rows, "via_proxy": proxy, "args": vars(args) | {"out": str(args.out)},
              "config": ARGS, "machine": machine()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
