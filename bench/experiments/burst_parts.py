"""A burst of N streamed chats at once, and where each one's TTFT went by the server's own parts
(``prep``, ``hops``, ``queue``, ``prefill``, ``first_flush`` of the closing chunk's
``server_timing``), for one app or two side by side (bursts alternate between them, and so does
which goes first).

    .venv/bin/python bench/experiments/serve_local.py --variant preprocess.inline_max_chars=0 --url-file /tmp/url &
    .venv/bin/python bench/experiments/burst_parts.py --url "$(cat /tmp/url)" --variant-url "$(cat /tmp/url)/variant"

Each part's p50 and p95 is taken within a burst; the table gives the median of those over the
bursts (machines here are noisy: one burst's prefill step can be 40% off the next), and
``beyond_engine`` is each request's client TTFT less the engine's own queue and prefill: what the
path around the engine added.
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

from bench.common import MODEL_NAME, machine, pct  # noqa: E402
from bench.target import chat_body, stream_chat  # noqa: E402

PARTS = ("prep", "hops", "queue", "prefill", "first_flush", "ttft")
TOPICS = ["rivers", "volcanoes", "bridges", "bees", "libraries", "glaciers", "trains", "forests"]


async def burst(url: str, n: int, max_tokens: int, tag: int) -> dict[str, float]:
    """One burst of ``n`` streams; the p50 and p95 of each part and of the client's TTFT, in ms."""
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        recs = await asyncio.gather(*[stream_chat(client, chat_body(
            MODEL_NAME, f"Write a detailed essay about {TOPICS[i % len(TOPICS)]} number {i} (burst {tag}):",
            max_tokens)) for i in range(n)])
    bad = [r.error for r in recs if r.error or not r.server_timing]
    if bad:
        raise SystemExit(f"{len(bad)} of {n} streams failed or had no server_timing: {bad[0]}")
    out: dict[str, float] = {}
    for part in PARTS:
        values = [r.server_timing.get(part, 0.0) for r in recs if r.server_timing]
        out[f"{part}_p50"], out[f"{part}_p95"] = pct(values, 50), pct(values, 95)
    ttfts = [r.ttft * 1e3 for r in recs]
    out["client_ttft_p50"], out["client_ttft_p95"] = pct(ttfts, 50), pct(ttfts, 95)
    # What the path around the engine added to each request (the prefill step's own time swings by
    # 40% from one burst to the next here, and queue + prefill carry it).
    beyond = [r.ttft * 1e3 - r.server_timing.get("queue", 0.0) - r.server_timing.get("prefill", 0.0)
              for r in recs if r.server_timing]
    out["beyond_engine_p50"], out["beyond_engine_p95"] = pct(beyond, 50), pct(beyond, 95)
    return out


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    sides = {"app": a.url, **({"variant": a.variant_url} if a.variant_url else {})}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for url in sides.values():  # warm up (compiled kernels, first connections)
        await burst(url, 4, 4, -1)
    for b in range(a.bursts):
        order = list(sides) if b % 2 == 0 else list(sides)[::-1]
        for name in order:
            res = await burst(sides[name], a.streams, a.tokens, b)
            runs[name].append(res)
            print(f"burst {b} {name}: " + json.dumps({k: round(v, 1) for k, v in res.items()}), flush=True)
            time.sleep(a.pause_s)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    return {"args": vars(a), "machine": machine(), "medians": med, "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--variant-url", default="")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--bursts", type=int, default=6)
    p.add_argument("--pause-s", type=float, default=2.0)
    p.add_argument("--out", default="bench/results/burst_parts.json")
    a = p.parse_args()
    result = asyncio.run(main_async(a))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    sides = list(result["medians"])
    print(f"\n| ms, median of {a.bursts} bursts of {a.streams} | " + " | ".join(
        f"{s} p50 | {s} p95" for s in sides) + " |")
    print("|---|" + "---|---|" * len(sides))
    for part in (*PARTS, "client_ttft", "beyond_engine"):
        cells = " | ".join(f"{result['medians'][s][part + '_p50']:.1f} | {result['medians'][s][part + '_p95']:.1f}"
                           for s in sides)
        print(f"| {part} | {cells} |")


if __name__ == "__main__":
    main()
