"""``load``: 1, 8, 32 and 64 concurrent streams; TTFT split into queue and prefill from the server's
own ``server_timing`` (or, failing that, its ``/metrics`` histograms); TPOT against concurrency."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import httpx

from bench import prom, report
from bench.target import Target, chat_body, exact_prompt, probe, stream_chat

#: Histograms that give mean queue / prefill time per request when there is no server_timing.
QUEUE_HISTS = ["lifecycle:request_queue_time_seconds", "vllm:request_queue_time_seconds"]
PREFILL_HISTS = ["vllm:request_prefill_time_seconds"]
PARTS = ["prep", "queue", "prefill", "rest"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--levels", default="1,8,32,64", help="concurrency levels")
    p.add_argument("--prompt-tokens", type=int, default=128, help="rendered prompt length")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens, ignore_eos")


async def _hist_means(c: httpx.AsyncClient, before: dict[str, float] | None) -> tuple[dict[str, float], dict[str, Any]]:
    r = await c.get("/metrics")
    m = prom.parse(r.text)
    means: dict[str, Any] = {}
    if before is not None:
        for part, names in (("queue", QUEUE_HISTS), ("prefill", PREFILL_HISTS)):
            for name in names:
                if name + "_count" in m:
                    n = m[name + "_count"] - before.get(name + "_count", 0)
                    s = m[name + "_sum"] - before.get(name + "_sum", 0)
                    means[part] = 1e3 * s / n if n > 0 else None
                    break
    return m, means


async def wave(c: httpx.AsyncClient, target: Target, n: int, prompt_tokens: int, max_tokens: int,
               bar: Any) -> dict[str, Any]:
    """``n`` streams started together; per-request TTFT parts, TPOT and the wave's throughput."""
    prompts = [(await exact_prompt(c, target, prompt_tokens))[0] for _ in range(n)]
    before = (await _hist_means(c, None))[0] if target.has_metrics and not target.has_server_timing else None

    async def one(text: str) -> Any:
        rec = await stream_chat(c, chat_body(target.model, text, max_tokens))
        bar.update(1)
        return rec

    t0 = time.perf_counter()
    recs = await asyncio.gather(*[one(t) for t in prompts])
    wall = time.perf_counter() - t0
    means = (await _hist_means(c, before))[1] if before is not None else {}
    ok = [r for r in recs if r.error is None]
    parts: dict[str, list[float]] = {p: [] for p in PARTS}
    for r in ok:
        st = r.server_timing if r.timing_source == "server_timing" else None
        if st:
            parts["prep"].append(st.get("prep", 0.0))
            parts["queue"].append(st.get("queue", 0.0))
            parts["prefill"].append(st.get("prefill", 0.0))
            parts["rest"].append(r.ttft * 1e3 - st.get("prep", 0.0) - st.get("queue", 0.0) - st.get("prefill", 0.0))
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    out = {"concurrency": n, "errors": len(recs) - len(ok),
           "ttft_p50_ms": report.pct([r.ttft for r in ok], 50) * 1e3,
           "ttft_p95_ms": report.pct([r.ttft for r in ok], 95) * 1e3,
           "tpot_p50_ms": report.pct([r.tpot for r in ok], 50) * 1e3,
           "tpot_p95_ms": report.pct([r.tpot for r in ok], 95) * 1e3,
           "gap_p50_ms": report.pct(gaps, 50) * 1e3, "gap_p95_ms": report.pct(gaps, 95) * 1e3,
           "tokens_per_event": tokens / max(1, sum(len(r.event_times) for r in ok)),
           "output_tok_s": tokens / wall, "wall_s": wall,
           "prompt_tokens_usage": report.med([r.prompt_tokens for r in ok if r.prompt_tokens]),
           "requests": [r.summary() for r in recs]}
    for p in PARTS:
        out[f"{p}_p50_ms"] = report.med(parts[p]) if parts[p] else means.get(p)
    out["ttft_parts_source"] = "server_timing" if parts["queue"] else ("metrics" if means else None)
    return out


async def main(a: argparse.Namespace) -> dict[str, Any]:
    run = report.Run("load", a, a.out)
    target = await probe(a.url, a.model)
    levels = [int(x) for x in a.levels.split(",") if x]
    if not target.has_server_timing:
        if target.has_metrics:
            target.skip("no server_timing: TTFT parts are per-level means from /metrics histograms where present")
        else:
            target.skip("no server_timing and no /metrics: TTFT is not split into queue and prefill")
    bar = report.progress(sum(levels) * a.repeats, "load", not a.no_progress)
    waves: list[dict[str, Any]] = []
    async with target.client(max(levels)) as c:
        await stream_chat(c, chat_body(target.model, "warm up", 2))
        for rep in range(a.repeats):
            for n in levels:
                w = await wave(c, target, n, a.prompt_tokens, a.max_tokens, bar)
                w["repeat"] = rep
                waves.append(w)
    bar.close()
    keys = ["ttft_p50_ms", "ttft_p95_ms", "prep_p50_ms", "queue_p50_ms", "prefill_p50_ms", "rest_p50_ms",
            "tpot_p50_ms", "tpot_p95_ms", "gap_p50_ms", "tokens_per_event", "output_tok_s"]
    levels_out, spreads, rows = [], {}, []
    for n in levels:
        ws = [w for w in waves if w["concurrency"] == n]
        agg = {"concurrency": n}
        for k in keys:
            sp = report.spread([w[k] if w[k] is not None else float("nan") for w in ws])
            agg[k] = sp["median"]
            spreads[f"{k}@{n}"] = sp
        levels_out.append(agg)
        rows.append([str(n)] + [agg[k] for k in keys[:-2]] + [agg["tokens_per_event"], agg["output_tok_s"]] +
                    [report.fmt(spreads[f"output_tok_s@{n}"]["spread_pct"], 0) + "%"])
    table = report.md_table(["streams", "TTFT p50 (ms)", "TTFT p95", "prep", "queue", "prefill", "rest",
                             "TPOT p50 (ms)", "TPOT p95", "event gap p50 (ms)", "tokens/event", "output tok/s",
                             "tok/s spread"], [[r[0]] + r[1:] for r in rows])
    table += (f"\n\nMedians over {a.repeats} repeat(s); each level is one wave of N streams started together, "
              f"prompt {a.prompt_tokens} tokens, {a.max_tokens} tokens out, greedy, ignore_eos. TTFT parts are "
              "per-request medians of the server's server_timing (prep, queue, prefill); rest = client TTFT − "
              "their sum (first flush, egress, HTTP). TPOT = (end-to-end − TTFT) / (tokens − 1), tokens from usage.")
    fig, (ax0, ax1) = report.figure(2, 9, 4.2)
    xs = list(range(len(levels)))
    bottom = [0.0] * len(levels)
    for p in PARTS:
        vals = [(lv[f"{p}_p50_ms"] if lv[f"{p}_p50_ms"] == lv[f"{p}_p50_ms"] else 0.0) / 1e3 for lv in levels_out]
        ax0.bar(xs, vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax0.plot(xs, [lv["ttft_p50_ms"] / 1e3 for lv in levels_out], "ko-", label="client TTFT p50")
    ax0.set_xticks(xs, [str(n) for n in levels])
    ax0.set_xlabel("concurrent streams")
    ax0.set_ylabel("time to first token (s)")
    ax0.set_title("TTFT split (medians)")
    ax0.legend(fontsize=8)
    ax1.plot(levels, [lv["tpot_p50_ms"] for lv in levels_out], "o-", label="TPOT p50")
    ax1.plot(levels, [lv["tpot_p95_ms"] for lv in levels_out], "s--", label="TPOT p95")
    ax1.plot(levels, [lv["gap_p50_ms"] for lv in levels_out], "^:", label="event gap p50")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(levels, [str(n) for n in levels])
    ax1.set_xlabel("concurrent streams")
    ax1.set_ylabel("time per output token (ms)")
    ax1.set_title("TPOT vs concurrency")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    results = {"levels": levels_out, "waves": waves}
    run.write(results, table, fig, a.repeats, spreads, [target])
    return results


def cli(a: argparse.Namespace) -> Any:
    return asyncio.run(main(a))
