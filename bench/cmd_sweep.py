"""``sweep``: TTFT against prompt length, from 100 tokens up to the model's context, with exact counts
via ``/tokenize``; the fitted prefill tok/s next to the ``2 × params × tokens / FLOP/s`` estimate."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

from bench import report
from bench.target import Target, chat_body, exact_prompt, probe, stream_chat

#: Parameter counts of models we know by served name (lower-case substring → parameters).
KNOWN_PARAMS = {"smollm2-135m": 134_515_008, "smollm2-360m": 361_821_120, "qwen2.5-0.5b": 494_032_768}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="",
                   help="comma-separated prompt lengths in tokens")
    p.add_argument("--max-tokens", type=int, default=2, help="output tokens per request")
    p.add_argument("--params", type=float, default=0,
                   help="model parameters for the 2·P·T estimate")
    p.add_argument("--linear-max", type=int, default=1024,
                   help="the straight-line prefill fit uses prompts up to this length (at least the two shortest)")
    p.add_argument("--from-json", default="",
                   help="re-analyse and re-plot the points of an earlier sweep.json instead of measuring")
    p.add_argument("--flops-threads", default="",
                   help="comma-separated thread counts to measure FLOP/s with")


def default_lengths(context: int | None, max_tokens: int) -> list[int]:
    top = (context or 2048) - max_tokens - 8
    out, n = [], 100
    while n < top:
        out.append(n)
        n *= 2
    return out + [top]


def measure_flops(threads: int, size: int = 1024, seconds: float = 1.0) -> float:
    """float32 GEMM FLOP/s on this machine with ``threads`` torch threads (best of a short loop)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)
        best, t_end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * size**3 / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(old)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b·x; returns (a, b)."""
    n = len(xs)
    if n < 2:
        return float("nan"), float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else float("nan")
    return my - b * mx, b


def fits(med_rows: list[dict[str, Any]], linear_max: int) -> dict[str, Any]:
    """Straight lines over the short prompts (client TTFT, server prefill) and a quadratic over all."""
    rows = sorted(med_rows, key=lambda r: r["prompt_tokens"])
    short = [r for r in rows if r["prompt_tokens"] <= linear_max]
    if len(short) < 2:
        short = rows[:2]
    lin_max = short[-1]["prompt_tokens"] if short else linear_max
    a0, b0 = fit_line([r["prompt_tokens"] for r in short], [r["ttft_ms"] for r in short])
    fit: dict[str, Any] = {"linear_max_tokens": lin_max, "ttft_intercept_ms": a0, "ttft_ms_per_token": b0,
                           "prefill_tok_s_from_ttft": 1e3 / b0 if b0 > 0 else None}
    pre = [r for r in short if r["prefill_ms"] == r["prefill_ms"]]
    if len(pre) >= 2:
        a1, b1 = fit_line([r["prompt_tokens"] for r in pre], [r["prefill_ms"] for r in pre])
        fit.update({"prefill_intercept_ms": a1, "prefill_ms_per_token": b1,
                    "prefill_tok_s_from_server": 1e3 / b1 if b1 > 0 else None})
    if len(rows) >= 3:
        import numpy as np

        x = np.array([r["prompt_tokens"] for r in rows], dtype=float)
        (b, c), *_ = np.linalg.lstsq(np.c_[x, x * x], np.array([r["ttft_ms"] for r in rows]), rcond=None)
        fit.update({"quad_b_ms_per_token": float(b), "quad_c_ms_per_token2": float(c),
                    "quad_linear_tok_s": 1e3 / float(b) if b > 0 else None})
    return fit


async def main(a: argparse.Namespace) -> dict[str, Any]:
    run = report.Run("sweep", a, a.out)
    if a.from_json:
        return reanalyse(a, run)
    target = await probe(a.url, a.model)
    if not target.has_tokenize:
        target.skip("no /tokenize: prompt lengths are approximate; the plot uses usage.prompt_tokens")
    if not target.has_server_timing:
        target.skip("no server_timing: server-side prefill comes from llama.cpp's `timings` where present, "
                    "otherwise only the client's TTFT is fitted")
    lengths = [int(x) for x in a.lengths.split(",") if x] or default_lengths(target.max_model_len, a.max_tokens)
    params = a.params or next((v for k, v in KNOWN_PARAMS.items() if k in target.model.lower()), 0)
    threads = [int(x) for x in a.flops_threads.split(",") if x] or sorted({1, os.cpu_count() or 1})
    flops = {t: measure_flops(t) for t in threads}
    points: list[dict[str, Any]] = []
    bar = report.progress(len(lengths) * a.repeats, "sweep", not a.no_progress)
    async with target.client(2) as c:
        await stream_chat(c, chat_body(target.model, "warm up", 2))
        for rep in range(a.repeats):
            for n in lengths:
                text, counted = await exact_prompt(c, target, n)
                rec = await stream_chat(c, chat_body(target.model, text, a.max_tokens))
                st = rec.server_timing or {}
                points.append({"repeat": rep, "target_tokens": n, "tokenize_count": counted,
                               "prompt_tokens": rec.prompt_tokens, "ttft_ms": rec.ttft * 1e3,
                               "prefill_ms": st.get("prefill"), "queue_ms": st.get("queue"), "prep_ms": st.get("prep"),
                               "error": rec.error})
                bar.update(1)
    bar.close()
    return analyse(a, run, target, lengths, params, flops, points)


def reanalyse(a: argparse.Namespace, run: report.Run) -> dict[str, Any]:
    """The analysis, table and plot again from an earlier run's measurements (provenance kept)."""
    import json

    doc = json.loads(open(a.from_json).read())
    res = doc["results"]
    run.machine, run.versions, run.started = doc["machine"], doc["versions"], doc["started"]
    run.config = {**doc["config"], "reanalysed_by": run.command}
    run.command = doc["command"]
    t = doc["servers"][0]
    target = Target(**{k: t[k] for k in ("url", "model", "max_model_len", "server_version", "has_tokenize",
                                         "has_metrics", "has_server_timing", "has_server_timing_header")})
    a.repeats = doc["repeats"]
    flops = {int(k): v["flops"] for k, v in res["estimate"].items()}
    return analyse(a, run, target, res["lengths"], res["params"], flops, res["points"], load_end=doc["machine"].get("load_avg_end"))


def analyse(a: argparse.Namespace, run: report.Run, target: Target, lengths: list[int], params: float,
            flops: dict[int, float], points: list[dict[str, Any]], load_end: list[float] | None = None) -> dict[str, Any]:
    ok = [p for p in points if p["error"] is None and p["prompt_tokens"]]
    by_len: dict[int, list[dict[str, Any]]] = {}
    for p in ok:
        by_len.setdefault(p["prompt_tokens"], []).append(p)
    rows, med_rows = [], []
    for n in sorted(by_len):
        ps = by_len[n]
        ttft = report.med([p["ttft_ms"] for p in ps])
        pre = report.med([p["prefill_ms"] for p in ps if p["prefill_ms"] is not None])
        med_rows.append({"prompt_tokens": n, "ttft_ms": ttft, "prefill_ms": pre,
                         "ttft_per_repeat": [p["ttft_ms"] for p in ps]})
        rows.append([f"{n:,}", ttft, pre, n / (ttft / 1e3), n / (pre / 1e3) if pre == pre and pre else None,
                     report.fmt(report.spread([p["ttft_ms"] for p in ps])["spread_pct"], 0) + "%"])
    fit = fits(med_rows, a.linear_max)
    estimate = {str(t): {"flops": f, "prefill_tok_s": f / (2 * params) if params else None} for t, f in flops.items()}
    if not params:
        target.skip("model parameters unknown (pass --params): no 2·P·T estimate")
    table = report.md_table(["prompt tokens (usage)", "TTFT (ms)", "server prefill (ms)", "tok/s by TTFT",
                             "tok/s by prefill", "TTFT spread"], rows)
    lin = f"prompts ≤ {fit['linear_max_tokens']:,} tokens"
    table += "\n\n" + report.md_table(["prefill rate", "tok/s"], [
        [f"straight line fitted to client TTFT, {lin}", fit["prefill_tok_s_from_ttft"]],
        [f"straight line fitted to server_timing prefill, {lin}", fit.get("prefill_tok_s_from_server")],
    ] + [[f"2 × {params / 1e6:.1f} M params × T / ({e['flops'] / 1e9:.1f} GFLOP/s float32 GEMM, {t} thread(s))",
          e["prefill_tok_s"]] for t, e in estimate.items() if params])
    if fit.get("quad_c_ms_per_token2") is not None:
        table += (f"\n\nOver all lengths, least squares through the origin: TTFT ≈ "
                  f"{fit['quad_b_ms_per_token']:.2f} ms × T + {fit['quad_c_ms_per_token2'] * 1e6:,.0f} ms × (T / 1000)²; "
                  "the T² term (attention over the whole prompt) bends the curve upward at long prompts.")
    fig, axes = report.figure(2, 10, 4.2)
    for ax, limit in ((axes[0], None), (axes[1], fit["linear_max_tokens"])):
        sel = [p for p in ok if limit is None or p["prompt_tokens"] <= limit]
        ax.scatter([p["prompt_tokens"] for p in sel], [p["ttft_ms"] / 1e3 for p in sel], s=16,
                   label="client TTFT (each request)")
        pts = [p for p in sel if p["prefill_ms"] is not None]
        if pts:
            ax.scatter([p["prompt_tokens"] for p in pts], [p["prefill_ms"] / 1e3 for p in pts], s=16, marker="x",
                       label="server prefill (server_timing)")
        top = max([p["prompt_tokens"] for p in sel], default=0)
        grid = [top * i / 50 for i in range(51)]
        if limit is None and fit.get("quad_c_ms_per_token2") is not None:
            ax.plot(grid, [(fit["quad_b_ms_per_token"] * x + fit["quad_c_ms_per_token2"] * x * x) / 1e3 for x in grid],
                    "-", color="C2", label="fit b·T + c·T²")
        if limit is not None and fit["ttft_ms_per_token"] == fit["ttft_ms_per_token"]:
            ax.plot(grid, [(fit["ttft_intercept_ms"] + fit["ttft_ms_per_token"] * x) / 1e3 for x in grid], "--",
                    color="C2", label=f"line fit: {fit['prefill_tok_s_from_ttft']:,.0f} tok/s")
        for k, (t, e) in enumerate(estimate.items()):
            if e["prefill_tok_s"]:
                ax.plot(grid, [x / e["prefill_tok_s"] for x in grid], ":", color=f"C{3 + k}",
                        label=f"2·P·T / FLOP/s, {t} thread(s): {e['prefill_tok_s']:,.0f} tok/s")
        ax.set_xlabel("prompt length (tokens, from usage)")
        ax.set_ylabel("time to first token (s)")
        ax.set_title("all lengths" if limit is None else f"up to {limit:,} tokens (the linear part)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7.5)
    fig.suptitle(f"TTFT vs prompt length, one request at a time — {target.model}")
    results = {"lengths": lengths, "points": points, "medians": med_rows, "fit": fit, "estimate": estimate,
               "params": params}
    spreads = {f"ttft_ms@{r['prompt_tokens']}": report.spread(r["ttft_per_repeat"]) for r in med_rows}
    run.write(results, table, fig, a.repeats, spreads, [target], load_end=load_end)
    return results


def cli(a: argparse.Namespace) -> Any:
    return asyncio.run(main(a))
