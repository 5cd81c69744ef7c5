"""The full graph over HTTP versus the same engine called in-process, in one run, alternating.

In-process: ``AsyncEngine`` (the engine core on its step thread) driven from asyncio in this
process, prompts pre-tokenised. Graph: the real Serve app on loopback (Ingress → Preprocess →
Egress → Engine), text prompts over HTTP with SSE, measured by an httpx client in this process.
Same engine settings, same prompts (the graph tokenises them to the same ids), same token counts.
Both stay up for the whole run and the sides alternate round by round (who goes first alternates
too), so a change in the machine's load hits both; medians over rounds are reported, and the
ratios of each round.

    .venv/bin/python bench/bench_graph.py            # full run (3 rounds, ~6 min on 2 cores)
    .venv/bin/python bench/bench_graph.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MODEL_NAME, ServeApp, machine, pct, stream_completion  # noqa: E402
from stages.config import EngineSettings  # noqa: E402
from stages.model_info import EMBEDDED_MODEL, load_tokenizer  # noqa: E402
from stages.transport.messages import EngineRequest, SamplingParams  # noqa: E402

TOPICS = ["rivers", "volcanoes", "bridges", "bees", "libraries", "glaciers", "trains", "forests"]


def prompts(n: int) -> list[str]:
    return [f"Write a detailed essay about {TOPICS[i % len(TOPICS)]} number {i}:" for i in range(n)]


# -- in-process ----------------------------------------------------------------------------------
async def inproc_one(engine: Any, rid: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft, times, n = None, [], 0
    engine_timings: dict[str, float] = {}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for outs in engine.generate(EngineRequest(rid, ids, params)):
        for out in outs:  # one item: every choice's output since the last one (here one choice)
            engine_timings.update(out.timings)
            if out.new_token_ids:
                now = time.perf_counter()
                ttft = ttft if ttft is not None else now - t0
                # A coalesced item carries several tokens: spread its gap evenly over them.
                times.extend([now] * len(out.new_token_ids))
                n += len(out.new_token_ids)
    # The engine's own queue and prefill, in ms like the graph's Server-Timing parts.
    timing = {k: engine_timings[k] * 1e3 for k in ("queue", "prefill") if k in engine_timings}
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "times": times, "n": n, "timing": timing}


async def inproc_side(settings: EngineSettings, tok: Any) -> tuple[Any, Any]:
    """An in-process engine and the ``one`` request function over it (the caller shuts it down)."""
    from stages.engine.core.engine import LLMEngine
    from stages.engine.driver.async_engine import AsyncEngine
    from stages.engine.driver.in_process import InProcessDriver

    engine = AsyncEngine(InProcessDriver(LLMEngine.from_config(EMBEDDED_MODEL, settings)))
    engine.start()

    def one(i: int, text: str, mt: int) -> Any:
        return inproc_one(engine, f"r{i}-{time.monotonic_ns()}", tok(text)["input_ids"], mt)

    return engine, one


# -- graph -----------------------------------------------------------------------------------------
def graph_side(client: httpx.AsyncClient, url: str) -> Any:
    """The ``one`` request function over the Serve app's HTTP API, through httpx."""
    return stream_side(functools.partial(stream_completion, client, url))


def stream_side(stream: Any) -> Any:
    """The ``one`` request function over any client's streaming-completion call ``stream(body)``
    (httpx's above, or ``bench.lean_client``'s)."""
    async def one(i: int, text: str, mt: int) -> dict[str, Any]:
        r = await stream({"model": MODEL_NAME, "prompt": text, "max_tokens": mt, "temperature": 0,
                          "ignore_eos": True})
        timing = (r.final or {}).get("server_timing") or {}
        return {"ttft": r.ttft, "e2e": r.e2e, "times": r.token_times, "n": r.num_tokens, "timing": timing}
    return one


async def _suite(one: Any, a: argparse.Namespace) -> dict[str, Any]:
    """Idle TTFT/ITL (sequential), 1-stream and N-stream throughput."""
    texts = prompts(max(a.streams, a.idle_reps))
    await one(0, "warm up", 4)
    idle = [await one(i, texts[i], a.idle_tokens) for i in range(a.idle_reps)]
    itls = [b - x for r in idle for x, b in zip(r["times"], r["times"][1:], strict=False)]
    single = await one(99, texts[0], a.tokens)
    t0, cpu0 = time.perf_counter(), time.process_time()
    many = await asyncio.gather(*[one(1000 + i, texts[i], a.tokens) for i in range(a.streams)])
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    total = sum(r["n"] for r in many)
    assert total == a.streams * a.tokens, total
    many_itls = [b - x for r in many for x, b in zip(r["times"], r["times"][1:], strict=False) if b > x]
    # The server's own TTFT split (prep, hops, queue, prefill, first_flush; graph only): what a
    # client's TTFT has beyond the server's ``ttft`` is what no server part explains.
    parts = {}
    if all(r.get("timing", {}).get("ttft") is not None for r in idle):
        parts = {f"idle_{k}_p50_ms": statistics.median(r["timing"].get(k, 0.0) for r in idle)
                 for k in ("prep", "hops", "queue", "prefill", "first_flush", "ttft")}
        parts["idle_unexplained_p50_ms"] = statistics.median(r["ttft"] * 1e3 - r["timing"]["ttft"] for r in idle)
    # TTFT less the engine's own queue and prefill, on both sides: what the path around the engine
    # adds, without the prefill step's own noise (36-44 ms from one idle request to the next here).
    if all({"queue", "prefill"} <= set(r.get("timing", {})) for r in idle):
        parts["idle_beyond_engine_p50_ms"] = statistics.median(
            r["ttft"] * 1e3 - r["timing"]["queue"] - r["timing"]["prefill"] for r in idle)
    return {**parts,
        "idle_ttft_p50_ms": pct([r["ttft"] for r in idle], 50) * 1e3,
        "idle_ttft_p95_ms": pct([r["ttft"] for r in idle], 95) * 1e3,
        "idle_itl_p50_ms": pct(itls, 50) * 1e3,
        "idle_itl_p95_ms": pct(itls, 95) * 1e3,
        "tok_s_1": single["n"] / (single["e2e"]),
        f"tok_s_{a.streams}": total / wall,
        f"ttft_p50_ms_{a.streams}": statistics.median(r["ttft"] for r in many) * 1e3,
        # Distinct arrival times per stream at N streams: how many tokens each SSE event carried.
        f"tokens_per_event_{a.streams}": total / max(1, sum(len(set(r["times"])) for r in many)),
        f"itl_p50_ms_{a.streams}": pct(many_itls, 50) * 1e3,
        # This process's CPU per token over the N-stream wave: the client's own work on a graph
        # side (the in-process engine idles then); the engine's compute too on the in-process side.
        f"bench_cpu_ms_per_token_{a.streams}": cpu / total * 1e3,
    }


async def run_rounds(settings: EngineSettings, tok: Any, urls: dict[str, str], a: argparse.Namespace
                     ) -> dict[str, list[dict[str, Any]]]:
    engine, inproc_one_fn = await inproc_side(settings, tok)
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    runs: dict[str, list[dict[str, Any]]] = {"in_process": [], **{name: [] for name in urls}}
    lean = None
    try:
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            sides = {"in_process": inproc_one_fn,
                     **{name: graph_side(client, url) for name, url in urls.items()}}
            if a.lean_client:
                # The same app through a client with almost no work per token (and no JSON per event).
                from bench.lean_client import LeanClient

                lean = LeanClient(urls["graph"])
                sides["graph[lean client]"] = stream_side(lean.stream_completion)
                runs["graph[lean client]"] = []
            for rnd in range(a.rounds):
                order = list(sides) if rnd % 2 == 0 else list(sides)[::-1]
                for name in order:
                    res = await _suite(sides[name], a)
                    runs[name].append(res)
                    print(f"round {rnd} {name}: {json.dumps({k: round(v, 2) for k, v in res.items()})}", flush=True)
    finally:
        if lean is not None:
            await lean.aclose()
        engine.shutdown()
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--idle-reps", type=int, default=10)
    p.add_argument("--idle-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (each side once per round)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in the engine, both sides (1: the graph's other stages need the other core)")
    p.add_argument("--direct", action="store_true",
                   help="also run the graph through the Ingress replica's direct-ingress port (no Serve proxy)")
    p.add_argument("--variant", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="also run an app that differs in this one setting, e.g. engine.step_thread_nice=null "
                        "(repeatable; one more app each)")
    p.add_argument("--serve-proxy", action="store_true",
                   help="also run the graph through Serve's proxy actor (the edge before HAProxy; its fallback port)")
    p.add_argument("--lean-client", action="store_true",
                   help="also measure the graph with bench.lean_client (raw socket, no per-event JSON): "
                        "what the httpx client's own work on the same cores costs the graph")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="bench/results/graph.json")
    a = p.parse_args()
    if a.quick:
        a.streams, a.tokens, a.idle_reps, a.idle_tokens, a.rounds = 8, 32, 3, 16, 1
    settings = EngineSettings(num_threads=a.threads, max_num_seqs=64, max_num_batched_tokens=512)
    tok = load_tokenizer(EMBEDDED_MODEL)
    env = machine()
    print("machine:", env, flush=True)
    app = ServeApp({"engine": settings.model_dump(), "http": {"keepalive_interval_s": 5.0}})
    try:
        urls = {"graph": app.url}
        if a.direct:
            from bench.ttft_parts import direct_ingress_url

            direct = direct_ingress_url()
            if direct is None:
                raise SystemExit("no direct-ingress port answered (RAY_SERVE_THROUGHPUT_OPTIMIZED=1 turns it on)")
            urls["graph_direct"] = direct
        if a.serve_proxy:
            from tests.serve_harness import serve_proxy_url

            proxy = serve_proxy_url()
            if proxy is None:
                raise SystemExit("--serve-proxy needs the HAProxy edge (unset LIFECYCLE_EDGE)")
            urls["graph_serve_proxy"] = proxy
        for i, override in enumerate(a.variant):
            # A second app like the first but for one setting (``engine.x=value``, value as YAML),
            # measured in the same rounds: the A/B of that setting through the whole graph.
            import yaml

            from tests.serve_harness import deploy_app

            key, _, value = override.partition("=")
            section, _, leaf = key.partition(".")
            variant_args = {"engine": settings.model_dump(), "http": {"keepalive_interval_s": 5.0}}
            variant_args.setdefault(section, {})[leaf] = yaml.safe_load(value)
            name = f"variant{i}"
            urls[f"graph[{override}]"] = deploy_app(variant_args, name=name, route_prefix=f"/{name}")
        runs = asyncio.run(run_rounds(settings, tok, urls, a))
    finally:
        app.close()
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    inproc = med["in_process"]
    graphs = [side for side in med if side != "in_process"]
    n = a.streams

    def ratios_of(side: str) -> dict[str, Any]:
        g = med[side]

        def per_round(f: Any) -> list[float]:
            return [round(f(i, x), 3) for i, x in zip(runs["in_process"], runs[side], strict=True)]

        return {
            f"throughput_ratio_{n}": g[f"tok_s_{n}"] / inproc[f"tok_s_{n}"],
            "throughput_ratio_1": g["tok_s_1"] / inproc["tok_s_1"],
            "idle_ttft_added_ms_p50": g["idle_ttft_p50_ms"] - inproc["idle_ttft_p50_ms"],
            "idle_beyond_engine_added_ms_p50": g["idle_beyond_engine_p50_ms"] - inproc["idle_beyond_engine_p50_ms"],
            f"per_round_throughput_ratio_{n}": per_round(lambda i, x: x[f"tok_s_{n}"] / i[f"tok_s_{n}"]),
            "per_round_idle_ttft_added_ms": per_round(lambda i, x: x["idle_ttft_p50_ms"] - i["idle_ttft_p50_ms"]),
            "per_round_idle_beyond_engine_added_ms": per_round(
                lambda i, x: x["idle_beyond_engine_p50_ms"] - i["idle_beyond_engine_p50_ms"]),
        }

    ratios = ratios_of("graph")
    for side in graphs[1:]:
        ratios[side] = ratios_of(side)
    result = {"args": vars(a), "machine": env, **med, "ratios": ratios, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"\n| metric (median of {a.rounds} rounds) | in-process | " + " | ".join(graphs) + " |")
    print("|---|---|" + "---|" * len(graphs))
    for k in med["graph"]:
        cells = " | ".join(f"{med[side].get(k, float('nan')):.2f}" for side in graphs)
        print(f"| {k} | {inproc.get(k, float('nan')):.2f} | {cells} |")
    print("\nratios:", json.dumps(ratios, indent=1))

if __name__ == "__main__":
    main()
