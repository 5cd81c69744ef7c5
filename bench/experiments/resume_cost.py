"""What resumable streams cost: throughput and latency at N streams with ``X-Resumable`` against
none, and the memory one kept stream holds.

    make serve   # or any `serve run serve_config.yaml`
    .venv/bin/python bench/experiments/resume_cost.py --url http://127.0.0.1:8000 --out bench/results/resume.json

1. ``--rounds`` rounds, the order alternating: a wave of ``--streams`` greedy streams of
   ``--max-tokens`` tokens (ignore_eos) with no header, and the same wave with ``X-Resumable``.
   Output tok/s, TTFT and inter-token gaps, per wave; ratios of the medians.
2. Memory: ``--streams`` resumable streams each dropped after 2 events run on detached; once the
   engines are idle, the app's ``/metrics`` says how many bytes the Egress replicas keep, and the
   Egress processes' RSS is read against before. Then every stream is resumed to the end (which
   also checks each one joins up: no gap, no duplicate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench import prom, report
from bench.target import chat_body, exact_prompt, probe, stream_chat


def egress_rss(app: str) -> int:
    """Summed RSS of the app's Egress replica processes."""
    total = 0
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        if f"ServeReplica:{app}:Egress" in " ".join(proc.info["cmdline"] or []):
            total += proc.info["memory_info"].rss
    return total


async def wave(url: str, model: str, prompts: list[str], max_tokens: int, resumable: bool) -> dict[str, Any]:
    headers = {"X-Resumable": "60"} if resumable else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600,
                                 limits=httpx.Limits(max_connections=len(prompts) + 4)) as c:
        t0 = time.perf_counter()
        recs = await asyncio.gather(*[stream_chat(c, chat_body(model, p, max_tokens)) for p in prompts])
        wall = time.perf_counter() - t0
    ok = [r for r in recs if r.error is None]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    gaps = [g for r in ok for g in r.gaps]
    return {"resumable": resumable, "errors": len(recs) - len(ok), "output_tok_s": tokens / wall,
            "ttft_p50_ms": report.pct([r.ttft for r in ok], 50) * 1e3,
            "ttft_p95_ms": report.pct([r.ttft for r in ok], 95) * 1e3,
            "gap_p50_ms": report.pct(gaps, 50) * 1e3}


async def _drop_after(c: httpx.AsyncClient, body: dict[str, Any], events: int) -> tuple[str, int]:
    """Start a resumable stream, read ``events`` content events, drop it: (response id, last id)."""
    last_id, rid, seen = -1, "", 0
    async with c.stream("POST", "/v1/chat/completions", json=body, headers={"X-Resumable": "120"}) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("id: "):
                last_id = int(line[4:])
            elif line.startswith("data: {"):
                rid = json.loads(line[6:])["id"]
                seen += 1
                if seen >= events:
                    break
    return rid, last_id


async def _resume(c: httpx.AsyncClient, rid: str, after: int) -> list[int]:
    ids = []
    async with c.stream("GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": str(after)}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("id: "):
                ids.append(int(line[4:]))
    return ids


async def _metric(c: httpx.AsyncClient, name: str) -> float:
    r = await c.get("/metrics")
    return prom.parse(r.text).get(name, 0.0)


async def memory(url: str, model: str, prompts: list[str], max_tokens: int, app: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=len(prompts) + 4)) as c:
        rss0 = egress_rss(app)
        dropped = await asyncio.gather(*[_drop_after(c, chat_body(model, p, max_tokens), 2) for p in prompts])
        deadline = time.monotonic() + 600
        while await _metric(c, "lifecycle:num_requests_running") > 0 and time.monotonic() < deadline:
            await asyncio.sleep(1)
        await asyncio.sleep(8)  # the Egress replicas' next metrics report
        kept = await _metric(c, "lifecycle:resumable_streams_detached")
        kept_bytes = await _metric(c, "lifecycle:resume_kept_bytes")
        rss1 = egress_rss(app)
        ids = await asyncio.gather(*[_resume(c, rid, last) for rid, last in dropped])
        joined = all(got == list(range(last + 1, last + 1 + len(got))) for (_, last), got in zip(dropped, ids, strict=True))
    n = len(prompts)
    return {"streams": n, "kept_reported": kept, "kept_bytes": kept_bytes, "bytes_per_stream": kept_bytes / n,
            "egress_rss_before_mb": rss0 / 2**20, "egress_rss_kept_mb": rss1 / 2**20,
            "rss_per_stream_kb": (rss1 - rss0) / n / 1024, "all_joined": joined}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--app", default="lifecycle", help="Serve app name (for the Egress processes)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results/resume_cost.json")
    args = ap.parse_args()
    target = await probe(args.url)
    async with target.client(4, timeout=60) as c:
        prompts = [(await exact_prompt(c, target, args.prompt_tokens))[0] for _ in range(args.streams)]
    load = [psutil.getloadavg()[0]]
    waves = []
    for r in range(args.rounds):
        for resumable in ((False, True) if r % 2 == 0 else (True, False)):
            w = await wave(target.url, target.model, prompts, args.max_tokens, resumable)
            waves.append(w)
            print(json.dumps(w))
    mem = await memory(target.url, target.model, prompts, args.max_tokens, args.app)
    print(json.dumps(mem))
    load.append(psutil.getloadavg()[0])

    def med(resumable: bool, key: str) -> float:
        return statistics.median(w[key] for w in waves if w["resumable"] == resumable)

    summary = {k: {"none": med(False, k), "resumable": med(True, k), "ratio": med(True, k) / med(False, k)}
               for k in ("output_tok_s", "ttft_p50_ms", "ttft_p95_ms", "gap_p50_ms")}
    out = {"args": vars(args), "load_avg_start_end": load, "waves": waves, "summary": summary, "memory": mem}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
