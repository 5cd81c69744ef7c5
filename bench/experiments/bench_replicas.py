"""32 streams against one engine replica vs two, side by side in one Ray session, alternating rounds.

    .venv/bin/python bench/experiments/bench_replicas.py [--rounds 3] [--concurrency 32] [--max-tokens 128]

Both apps run the shipped ``serve_config.yaml`` args (one torch thread per engine); "two" differs
only in ``Engine.num_replicas: 2``. Requests go through Serve's proxy, so the project's
``EngineRouter`` spreads them over the engines. Writes ``bench/results/replicas.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.cmd_client import run_batch, summarize  # noqa: E402
from bench.common import machine  # noqa: E402
from bench.target import probe  # noqa: E402
from tests.serve_harness import deploy_app, start_ray, stop_app  # noqa: E402


def shipped() -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    app = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
    options = {d.pop("name"): d for d in app["deployments"]}
    for d in options.values():  # fixed replica counts for a fair comparison: no autoscaling here
        if d.pop("autoscaling_config", None) is not None:
            d["num_replicas"] = 1
    return app["args"], options


def stage_cpu_seconds(app: str) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each deployment's replica processes of ``app``
    (Ray titles them ``ray::ServeReplica:<app>:<deployment>``)."""
    import psutil

    out: dict[str, float] = {}
    for proc in psutil.process_iter(["cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        prefix = f"ray::ServeReplica:{app}:"
        if title.startswith(prefix):
            deployment = title[len(prefix):].split()[0]
            try:
                t = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            out[deployment] = out.get(deployment, 0.0) + t.user + t.system
    return out


async def measure(url: str, app: str, concurrency: int, max_tokens: int) -> dict[str, Any]:
    target = await probe(url)
    before = stage_cpu_seconds(app)
    recs, wall = await run_batch(target, concurrency, concurrency, 64, max_tokens)
    after = stage_cpu_seconds(app)
    s = summarize(recs, wall)
    n, tokens = max(1, s["requests"] - s["errors"]), max(1, s["completion_tokens_total"])
    s["cpu_ms_per_request"] = {d: (after[d] - before.get(d, 0.0)) * 1e3 / n for d in after}
    s["cpu_ms_per_token"] = {d: (after[d] - before.get(d, 0.0)) * 1e3 / tokens for d in after}
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    a = p.parse_args()
    args, options = shipped()
    start_ray()
    urls = {}
    for name, engines in (("one", 1), ("two", 2)):
        opts = json.loads(json.dumps(options))
        opts["Engine"]["num_replicas"] = engines
        urls[name] = deploy_app(args, name=name, route_prefix=f"/{name}", options=opts)
    runs: dict[str, list[dict[str, Any]]] = {"one": [], "two": []}
    try:
        for r in range(a.rounds):
            for name in (("one", "two") if r % 2 == 0 else ("two", "one")):
                s = asyncio.run(measure(urls[name], name, a.concurrency, a.max_tokens))
                runs[name].append(s)
                print(f"round {r} {name}: {s['output_tok_s']:.1f} tok/s, TTFT p50 {s['ttft_p50_ms']:.0f} ms, "
                      f"TPOT p50 {s['tpot_p50_ms']:.1f} ms, errors {s['errors']}; CPU ms/request "
                      f"{ {d: round(v, 1) for d, v in s['cpu_ms_per_request'].items()} }", flush=True)
    finally:
        stop_app()
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms")}
           for k, v in runs.items()}
    result = {"machine": machine(), "concurrency": a.concurrency, "max_tokens": a.max_tokens, "rounds": a.rounds,
              "runs": runs, "median": med, "ratio_two_over_one": med["two"]["output_tok_s"] / med["one"]["output_tok_s"]}
    out = ROOT / "bench" / "results" / "replicas.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(med, indent=2), f"\ntwo/one throughput: {result['ratio_two_over_one']:.2f}")


if __name__ == "__main__":
    main()
