"""Where a streamed request's TTFT goes, from the server's own parts, through each HTTP edge in front
of the same app, alternating request by request in one run.

The closing chunk's ``server_timing`` splits the server's TTFT (``ttft``) into ``prep + hops +
queue + prefill + first_flush``; what the client's TTFT has beyond ``ttft`` ("unexplained") is the
HTTP edge. The edges: HAProxy (the port ``make serve`` serves on) forwarding to the Ingress
replica's own HTTP server; Serve's proxy actor (the edge before, on its fallback port), which sends
the replica a Serve message per request, per body pull and per response chunk; and the replica's
direct-ingress port itself, with no edge. ``LIFECYCLE_EDGE=proxy`` runs the proxy actor alone.

    .venv/bin/python bench/ttft_parts.py --requests 30 --out bench/results/ttft_parts.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import MODEL_NAME, ServeApp, machine, stream_completion  # noqa: E402

PARTS = ("prep", "hops", "queue", "prefill", "first_flush", "ttft")


def direct_ingress_url(prefix: str = "") -> str | None:
    """The first direct-ingress port (30000 and up) whose ``/health`` answers."""
    for port in range(30000, 30100):
        try:
            if httpx.get(f"http://127.0.0.1:{port}{prefix}/health", timeout=1).status_code == 200:
                return f"http://127.0.0.1:{port}{prefix}"
        except httpx.HTTPError:
            continue
    return None


async def run(urls: dict[str, str], n: int, max_tokens: int) -> dict[str, Any]:
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
    async with httpx.AsyncClient(timeout=120) as client:
        for url in urls.values():
            await stream_completion(client, url, {"model": MODEL_NAME, "prompt": "warm up", "max_tokens": 4})
        for i in range(n):
            for name, url in urls.items():  # alternate, so load drifts hit both alike
                r = await stream_completion(client, url, {"model": MODEL_NAME, "prompt": f"Write about bees, {i}:",
                                                          "max_tokens": max_tokens, "temperature": 0,
                                                          "ignore_eos": True})
                t = (r.final or {})["server_timing"]
                rows[name].append({**{k: t[k] for k in PARTS}, "client_ttft": r.ttft * 1e3,
                                   "unexplained": r.ttft * 1e3 - t["ttft"]})
    return {name: {k: statistics.median(row[k] for row in rs) for k in rs[0]} for name, rs in rows.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", default="bench/results/ttft_parts.json")
    a = p.parse_args()
    os.environ["RAY_ADDRESS"] = "local"  # a private Ray instance, never one left on the machine
    args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    env = machine()
    app = ServeApp(args)
    try:
        from tests.serve_harness import serve_proxy_url

        direct, proxy = direct_ingress_url(), serve_proxy_url()
        # The edge users get (HAProxy, or Serve's proxy actor under LIFECYCLE_EDGE=proxy), the
        # proxy actor beside it when HAProxy is the edge, and the Ingress replica's own port.
        urls = {"haproxy" if proxy else "serve_proxy": app.url, **({"serve_proxy": proxy} if proxy else {}),
                **({"direct": direct} if direct else {})}
        medians = asyncio.run(run(urls, a.requests, a.max_tokens))
    finally:
        app.close()
    env["load_avg_end"] = os.getloadavg()
    result = {"args": vars(a), "machine": env, "medians_ms": medians}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    cols = [*PARTS, "client_ttft", "unexplained"]
    print("| path | " + " | ".join(cols) + " |\n|" + "---|" * (len(cols) + 1))
    for name, m in medians.items():
        print(f"| {name} | " + " | ".join(f"{m[k]:.2f}" for k in cols) + " |")


if __name__ == "__main__":
    main()
