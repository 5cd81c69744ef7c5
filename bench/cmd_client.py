"""``client``: TTFT, inter-event gap, TPOT, end-to-end time and output tok/s at one concurrency and one
prompt/output length, as a client measures them."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench import report
from bench.target import StreamRecord, Target, chat_body, exact_prompt, gather_limited, probe


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, default=8, help="streams in flight")
    p.add_argument("--requests", type=int, default=0, help="requests per repeat (0: 2 × concurrency)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="rendered prompt length")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens, ignore_eos")


async def run_batch(target: Target, concurrency: int, requests: int, prompt_tokens: int, max_tokens: int,
                    bar: Any = None) -> tuple[list[StreamRecord], float]:
    """``requests`` streams, ``concurrency`` at a time; returns the records and the wall time."""
    async with target.client(concurrency) as c:
        prompts = [await exact_prompt(c, target, prompt_tokens) for _ in range(requests)]
        t0 = time.perf_counter()
        from bench.target import stream_chat

        recs = await gather_limited([stream_chat(c, chat_body(target.model, text, max_tokens))
                                     for text, _ in prompts], concurrency, bar)
        return recs, time.perf_counter() - t0


def summarize(recs: list[StreamRecord], wall: float) -> dict[str, Any]:
    ok = [r for r in recs if r.error is None]
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    return {
        "requests": len(recs), "errors": len(recs) - len(ok),
        "ttft_p50_ms": report.pct([r.ttft for r in ok], 50) * 1e3,
        "ttft_p95_ms": report.pct([r.ttft for r in ok], 95) * 1e3,
        "gap_p50_ms": report.pct(gaps, 50) * 1e3, "gap_p95_ms": report.pct(gaps, 95) * 1e3,
        "tpot_p50_ms": report.pct([r.tpot for r in ok], 50) * 1e3,
        "tpot_p95_ms": report.pct([r.tpot for r in ok], 95) * 1e3,
        "e2e_p50_s": report.pct([r.e2e for r in ok], 50),
        "tokens_per_event": tokens / max(1, sum(len(r.event_times) for r in ok)),
        "prompt_tokens_usage": report.med([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
        "completion_tokens_total": tokens,
        "output_tok_s": tokens / wall if wall > 0 else float("nan"),
        "per_stream_tok_s_p50": report.med([(r.completion_tokens or 0) / r.e2e for r in ok]),
        "wall_s": wall,
    }


KEYS = [("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p95_ms", "TTFT p95 (ms)"), ("gap_p50_ms", "event gap p50 (ms)"),
        ("gap_p95_ms", "event gap p95 (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)"), ("tpot_p95_ms", "TPOT p95 (ms)"),
        ("e2e_p50_s", "end-to-end p50 (s)"), ("tokens_per_event", "tokens per event"),
        ("output_tok_s", "output tok/s (all streams)"), ("per_stream_tok_s_p50", "tok/s per stream p50")]


async def main(a: argparse.Namespace) -> dict[str, Any]:
    run = report.Run("client", a, a.out)
    target = await probe(a.url, a.model)
    if not target.has_tokenize:
        target.skip("no /tokenize: prompt length is approximate; the measured length is usage.prompt_tokens")
    requests = a.requests or 2 * a.concurrency
    per_repeat: list[dict[str, Any]] = []
    all_recs: list[StreamRecord] = []
    await run_batch(target, 1, 1, 16, 4)  # warm-up, not counted
    bar = report.progress(requests * a.repeats, "client", not a.no_progress)
    for _ in range(a.repeats):
        recs, wall = await run_batch(target, a.concurrency, requests, a.prompt_tokens, a.max_tokens, bar)
        per_repeat.append(summarize(recs, wall))
        all_recs += recs
    bar.close()
    spreads = {k: report.spread([r[k] for r in per_repeat]) for k, _ in KEYS}
    pooled = summarize(all_recs, sum(r["wall_s"] for r in per_repeat))
    rows = [[label, spreads[k]["median"], fmt_range(spreads[k])] for k, label in KEYS]
    table = report.md_table(["metric (median of repeats)", "value", "range over repeats"], rows)
    table += (f"\n\n{a.concurrency} concurrent streams, {requests} requests per repeat, prompt "
              f"{fmt_tok(pooled['prompt_tokens_usage'])} tokens (usage), {a.max_tokens} tokens out, greedy, "
              "ignore_eos. TPOT = (end-to-end − TTFT) / (tokens − 1) with tokens from usage; the event gap "
              "is the time between SSE events that carried content.")
    fig, axes = report.figure(2)
    ok = [r for r in all_recs if r.error is None]
    for ax, vals, title in ((axes[0], sorted(r.ttft * 1e3 for r in ok), "TTFT"),
                            (axes[1], sorted(g * 1e3 for r in ok for g in r.gaps), "Inter-event gap")):
        if vals:
            ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], drawstyle="steps-post")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of samples ≤ x")
        ax.set_title(f"{title}: CDF, {a.concurrency} streams")
    results = {"per_repeat": per_repeat, "pooled": pooled, "requests": [r.summary() for r in all_recs]}
    run.write(results, table, fig, a.repeats, spreads, [target])
    return results


def fmt_range(s: dict[str, Any]) -> str:
    return f"{report.fmt(s['min'])} – {report.fmt(s['max'])} ({report.fmt(s['spread_pct'], 0)}%)"


def fmt_tok(v: float) -> str:
    return report.fmt(v, 0)


def cli(a: argparse.Namespace) -> Any:
    return asyncio.run(main(a))
