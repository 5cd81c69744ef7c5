"""``sweep``: TTFT against prompt length, from 100 tokens up to the model's context, with exact counts
via ``/tokenize``; the fitted prefill tok/s next to the ``2 × params × tokens / FLOP/s`` estimate.

``--url`` may list several servers (comma-separated): they are measured in the same run, taking turns
request by request, and drawn on one plot; the table adds each peer's TTFT over the first server's."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import time
from typing import Any
from urllib.parse import urlsplit

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
    lists = {"url": "a comma-separated list sweeps several servers side by side",
             "model": "with several --url, one name for all or a comma-separated list, one per URL"}
    for action in p._actions:  # the shared --url/--model, which this subcommand also takes as lists
        if action.dest in lists:
            action.help = f"{action.help}; {lists[action.dest]}"


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


def servers(url: str, model: str | None) -> list[tuple[str, str | None]]:
    """The (URL, model) pairs of ``--url`` and ``--model``, both comma-separated. One model name applies
    to every server (a side-by-side sweep compares one model served twice), a list names one per URL,
    and none lets each server pick its first ``/v1/models`` entry."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    models = [m.strip() for m in (model or "").split(",") if m.strip()]
    if len(models) > 1 and len(models) != len(urls):
        raise SystemExit(f"--model names {len(models)} models for {len(urls)} URL(s): give one, or one per URL")
    if len(models) <= 1:
        models = [models[0] if models else None] * len(urls)
    return list(zip(urls, models, strict=True))


def names(targets: list[Target]) -> list[str]:
    """Short server names for the tables: host:port (two servers of one build on one machine differ only
    there), numbered when a URL is given twice (an A/A run of one server against itself)."""
    hosts = [urlsplit(t.url).netloc or t.url for t in targets]
    return hosts if len(set(hosts)) == len(hosts) else [f"{i + 1}: {h}" for i, h in enumerate(hosts)]


def label(name: str, t: Target) -> str:
    """A server's name on the plot: its short name and the version it reports, cut short."""
    return f"{name} ({t.server_version[:24]})" if t.server_version else name


def known_params(targets: list[Target]) -> float:
    """Parameters of the first model whose served name we know (0: unknown)."""
    return next((v for t in targets for k, v in KNOWN_PARAMS.items() if k in t.model.lower()), 0)


def turn_order(n_servers: int, rep: int) -> list[int]:
    """Server indices in the order they take their turn in repeat ``rep``: rotated by one each repeat
    (two servers alternate), so each takes every place equally often and neither always runs right after
    the other's long prompt or into the same drift of background load."""
    return [(rep + j) % n_servers for j in range(n_servers)]


async def prepare(url: str, model: str | None) -> Target:
    """Probe one server and say what its sweep leaves out."""
    target = await probe(url, model)
    if not target.has_tokenize:
        target.skip("no /tokenize: prompt lengths are approximate; the plot uses usage.prompt_tokens")
    if not target.has_server_timing:
        target.skip("no server_timing: server-side prefill comes from llama.cpp's `timings` where present, "
                    "otherwise only the client's TTFT is fitted")
    return target


async def measure_point(c: Any, target: Target, n: int, max_tokens: int) -> dict[str, Any]:
    """One request with an ``n``-token prompt, counted by this server's own ``/tokenize`` where it has one."""
    text, counted = await exact_prompt(c, target, n)
    rec = await stream_chat(c, chat_body(target.model, text, max_tokens))
    st = rec.server_timing or {}
    return {"target_tokens": n, "tokenize_count": counted,
            "prompt_tokens": rec.prompt_tokens, "ttft_ms": rec.ttft * 1e3,
            "prefill_ms": st.get("prefill"), "queue_ms": st.get("queue"), "prep_ms": st.get("prep"),
            "error": rec.error}


async def measure(a: argparse.Namespace, targets: list[Target], lengths: list[int]) -> list[dict[str, Any]]:
    """Every length in every repeat on every server, one request at a time, the servers taking turns
    (``turn_order``) so background load falls on them alike. A point names its ``server`` (index into
    ``targets``) only when there are several, so a one-server sweep.json reads as it always did."""
    points: list[dict[str, Any]] = []
    bar = report.progress(len(lengths) * a.repeats * len(targets), "sweep", not a.no_progress)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(t.client(2)) for t in targets]
        for t, c in zip(targets, clients, strict=True):
            await stream_chat(c, chat_body(t.model, "warm up", 2))
        for rep in range(a.repeats):
            for n in lengths:
                for i in turn_order(len(targets), rep):
                    tag = {"server": i} if len(targets) > 1 else {}
                    points.append({"repeat": rep, **tag,
                                   **await measure_point(clients[i], targets[i], n, a.max_tokens)})
                    bar.update(1)
    bar.close()
    return points


async def main(a: argparse.Namespace) -> dict[str, Any]:
    run = report.Run("sweep", a, a.out)
    if a.from_json:
        return reanalyse(a, run)
    targets = [await prepare(url, model) for url, model in servers(a.url, a.model)]
    # The shortest context of all, so every length fits every server.
    context = min((t.max_model_len for t in targets if t.max_model_len), default=None)
    lengths = [int(x) for x in a.lengths.split(",") if x] or default_lengths(context, a.max_tokens)
    params = a.params or known_params(targets)
    threads = [int(x) for x in a.flops_threads.split(",") if x] or sorted({1, os.cpu_count() or 1})
    flops = {t: measure_flops(t) for t in threads}
    points = await measure(a, targets, lengths)
    return analyse(a, run, targets, lengths, params, flops, points)


def reanalyse(a: argparse.Namespace, run: report.Run) -> dict[str, Any]:
    """The analysis, table and plot again from an earlier run's measurements (provenance kept); a
    one-server file and a several-server file alike (points without ``server`` belong to the first)."""
    import json

    doc = json.loads(open(a.from_json).read())
    res = doc["results"]
    run.machine, run.versions, run.started = doc["machine"], doc["versions"], doc["started"]
    run.config = {**doc["config"], "reanalysed_by": run.command}
    run.command = doc["command"]
    keys = [f.name for f in dataclasses.fields(Target) if f.name != "notes"]
    targets = [Target(**{k: t[k] for k in keys if k in t}) for t in doc["servers"]]
    a.repeats = doc["repeats"]
    flops = {int(k): v["flops"] for k, v in res["estimate"].items()}
    return analyse(a, run, targets, res["lengths"], res["params"], flops, res["points"],
                   load_end=doc["machine"].get("load_avg_end"))


# -- analysis ----------------------------------------------------------------------------------------
def usable(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points that answered and reported their prompt length."""
    return [p for p in points if p["error"] is None and p["prompt_tokens"]]


def server_points(points: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    """Server ``i``'s points (a point without ``server`` is the first's: the one-server format)."""
    return [p for p in points if p.get("server", 0) == i]


def medians(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per prompt length as the server's ``usage`` counted it: the median TTFT and server
    prefill over the repeats, and every repeat's TTFT (for the spread)."""
    by_len: dict[int, list[dict[str, Any]]] = {}
    for p in usable(points):
        by_len.setdefault(p["prompt_tokens"], []).append(p)
    return [{"prompt_tokens": n, "ttft_ms": report.med([p["ttft_ms"] for p in ps]),
             "prefill_ms": report.med([p["prefill_ms"] for p in ps if p["prefill_ms"] is not None]),
             "ttft_per_repeat": [p["ttft_ms"] for p in ps]} for n, ps in sorted(by_len.items())]


def analyse_server(points: list[dict[str, Any]], linear_max: int) -> dict[str, Any]:
    """One server's medians and fits (its points only)."""
    med_rows = medians(points)
    return {"points": usable(points), "medians": med_rows, "fit": fits(med_rows, linear_max)}


def by_length(per_server: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per asked prompt length: each server's median TTFT, median ``usage`` prompt tokens and prefill
    tok/s by TTFT (tokens / TTFT), and each peer's TTFT over the first server's (>1: the first is
    faster). Rows go by the asked length, not ``usage``, so servers whose templates count a token
    differently still share a row; a ratio is of medians, NaN where a server has no answer."""
    nan = float("nan")
    rows = []
    for n in sorted({p["target_tokens"] for ps in per_server for p in ps}):
        cells = []
        for ps in per_server:
            sel = [p for p in usable(ps) if p["target_tokens"] == n]
            ttft, tokens = report.med([p["ttft_ms"] for p in sel]), report.med([p["prompt_tokens"] for p in sel])
            cells.append({"prompt_tokens": tokens, "ttft_ms": ttft,
                          "tok_s_by_ttft": tokens / (ttft / 1e3) if ttft else nan})
        first = cells[0]["ttft_ms"]
        rows.append({"target_tokens": n, "servers": cells,
                     "ttft_ratio_to_first": [c["ttft_ms"] / first if first else nan for c in cells[1:]]})
    return rows


def paired_ratios(per_server: list[list[dict[str, Any]]], peer: int, n: int) -> list[float]:
    """The peer's TTFT over the first server's at asked length ``n``, repeat by repeat (the two requests
    of a repeat ran back to back): how steady the ratio is, for the spread."""
    def ttft(i: int) -> dict[int, float]:
        return {p["repeat"]: p["ttft_ms"] for p in usable(per_server[i]) if p["target_tokens"] == n}

    first, other = ttft(0), ttft(peer)
    return [other[r] / first[r] for r in sorted(first.keys() & other.keys()) if first[r]]


# -- tables ------------------------------------------------------------------------------------------
def medians_table(med_rows: list[dict[str, Any]]) -> str:
    """Median TTFT and server prefill per prompt length, the rates they imply and the TTFT spread."""
    rows = []
    for r in med_rows:
        n, ttft, pre = r["prompt_tokens"], r["ttft_ms"], r["prefill_ms"]
        rows.append([f"{n:,}", ttft, pre, n / (ttft / 1e3), n / (pre / 1e3) if pre == pre and pre else None,
                     report.fmt(report.spread(r["ttft_per_repeat"])["spread_pct"], 0) + "%"])
    return report.md_table(["prompt tokens (usage)", "TTFT (ms)", "server prefill (ms)", "tok/s by TTFT",
                            "tok/s by prefill", "TTFT spread"], rows)


def rates_table(fitted: list[tuple[str, dict[str, Any]]], estimate: dict[str, Any], params: float) -> str:
    """The prefill rates of each (name, fit) (no name: one server, rows as they always read), then the
    2·P·T estimate per thread count."""
    rows = []
    for name, fit in fitted:
        lin, pre = f"prompts ≤ {fit['linear_max_tokens']:,} tokens", f"{name}: " if name else ""
        rows += [[f"{pre}straight line fitted to client TTFT, {lin}", fit["prefill_tok_s_from_ttft"]],
                 [f"{pre}straight line fitted to server_timing prefill, {lin}", fit.get("prefill_tok_s_from_server")]]
    rows += [[f"2 × {params / 1e6:.1f} M params × T / ({e['flops'] / 1e9:.1f} GFLOP/s float32 GEMM, {t} thread(s))",
              e["prefill_tok_s"]] for t, e in estimate.items() if params]
    return report.md_table(["prefill rate", "tok/s"], rows)


def quad_note(fit: dict[str, Any], name: str = "") -> str:
    """The quadratic over all lengths in words ("" without one: fewer than three lengths)."""
    if fit.get("quad_c_ms_per_token2") is None:
        return ""
    return (f"\n\n{name + ': ' if name else ''}Over all lengths, least squares through the origin: TTFT ≈ "
            f"{fit['quad_b_ms_per_token']:.2f} ms × T + {fit['quad_c_ms_per_token2'] * 1e6:,.0f} ms × (T / 1000)²; "
            "the T² term (attention over the whole prompt) bends the curve upward at long prompts.")


def ratio_table(names: list[str], rows: list[dict[str, Any]]) -> str:
    """``by_length`` as a table: TTFT per server, each peer over the first, tok/s by TTFT per server."""
    headers = (["prompt tokens (usage)"] + [f"{s} TTFT (ms)" for s in names]
               + [f"{s} / {names[0]} TTFT" for s in names[1:]] + [f"{s} tok/s by TTFT" for s in names])
    out = []
    for r in rows:
        counts = " / ".join(dict.fromkeys(report.fmt(c["prompt_tokens"], 0) for c in r["servers"]))
        out.append([counts] + [c["ttft_ms"] for c in r["servers"]]
                   + [report.fmt(x, 2) for x in r["ttft_ratio_to_first"]]
                   + [c["tok_s_by_ttft"] for c in r["servers"]])
    return report.md_table(headers, out)


# -- plots -------------------------------------------------------------------------------------------
def estimate_lines(ax: Any, grid: list[float], estimate: dict[str, Any], first_colour: int) -> None:
    """The 2·P·T / FLOP/s lines, one per thread count."""
    for k, (t, e) in enumerate(estimate.items()):
        if e["prefill_tok_s"]:
            ax.plot(grid, [x / e["prefill_tok_s"] for x in grid], ":", color=f"C{first_colour + k}",
                    label=f"2·P·T / FLOP/s, {t} thread(s): {e['prefill_tok_s']:,.0f} tok/s")


def finish_axes(ax: Any, limit: int | None) -> None:
    """Labels, title and legend of one panel (``limit``: the linear part's top, None for all lengths)."""
    ax.set_xlabel("prompt length (tokens, from usage)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("all lengths" if limit is None else f"up to {limit:,} tokens (the linear part)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7.5)


def plot_one(ok: list[dict[str, Any]], fit: dict[str, Any], estimate: dict[str, Any], model: str) -> Any:
    """One server: every request's TTFT and server prefill, the quadratic over all lengths (left) and the
    straight line over the short prompts (right), against the 2·P·T estimate."""
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
        estimate_lines(ax, grid, estimate, 3)
        finish_axes(ax, limit)
    fig.suptitle(f"TTFT vs prompt length, one request at a time — {model}")
    return fig


def plot_several(labels: list[str], per: list[dict[str, Any]], estimate: dict[str, Any], models: str) -> Any:
    """Several servers on the same axes, one colour each: every request's TTFT and the line through the
    medians (all lengths, left) or the straight-line fit (the short prompts, right); the 2·P·T estimate
    once, since the servers share the machine."""
    fig, axes = report.figure(2, 10, 4.2)
    for ax, limit in ((axes[0], None), (axes[1], max(r["fit"]["linear_max_tokens"] for r in per))):
        top = 0
        for i, (name, r) in enumerate(zip(labels, per, strict=True)):
            sel = [p for p in r["points"] if limit is None or p["prompt_tokens"] <= limit]
            meds = [m for m in r["medians"] if limit is None or m["prompt_tokens"] <= limit]
            top = max([top] + [p["prompt_tokens"] for p in sel])
            ax.scatter([p["prompt_tokens"] for p in sel], [p["ttft_ms"] / 1e3 for p in sel], s=14, alpha=0.45,
                       color=f"C{i}")
            ax.plot([m["prompt_tokens"] for m in meds], [m["ttft_ms"] / 1e3 for m in meds], "o-" if limit is None
                    else "o", ms=3, color=f"C{i}", label=f"{name}: median TTFT, dots each request")
            fit = r["fit"]
            if limit is not None and fit["ttft_ms_per_token"] == fit["ttft_ms_per_token"]:
                xs = [limit * k / 50 for k in range(51)]
                ax.plot(xs, [(fit["ttft_intercept_ms"] + fit["ttft_ms_per_token"] * x) / 1e3 for x in xs], "--",
                        color=f"C{i}", label=f"{name}: line fit {fit['prefill_tok_s_from_ttft']:,.0f} tok/s")
        estimate_lines(ax, [top * k / 50 for k in range(51)], estimate, len(per))
        finish_axes(ax, limit)
    fig.suptitle(f"TTFT vs prompt length, one request at a time, servers taking turns — {models}")
    return fig


# -- results -----------------------------------------------------------------------------------------
def analyse(a: argparse.Namespace, run: report.Run, targets: list[Target], lengths: list[int], params: float,
            flops: dict[int, float], points: list[dict[str, Any]], load_end: list[float] | None = None) -> dict[str, Any]:
    """Per-server medians and fits, then one write: the single-server report as it always was, or the
    servers side by side."""
    per = [analyse_server(server_points(points, i), a.linear_max) for i in range(len(targets))]
    estimate = {str(t): {"flops": f, "prefill_tok_s": f / (2 * params) if params else None} for t, f in flops.items()}
    if not params:
        targets[0].skip("model parameters unknown (pass --params): no 2·P·T estimate")
    if len(targets) == 1:
        r = per[0]
        table = medians_table(r["medians"]) + "\n\n" + rates_table([("", r["fit"])], estimate, params) \
            + quad_note(r["fit"])
        fig = plot_one(r["points"], r["fit"], estimate, targets[0].model)
        results = {"lengths": lengths, "points": points, "medians": r["medians"], "fit": r["fit"],
                   "estimate": estimate, "params": params}
        spreads = {f"ttft_ms@{m['prompt_tokens']}": report.spread(m["ttft_per_repeat"]) for m in r["medians"]}
    else:
        table, fig, results, spreads = side_by_side(a, targets, lengths, params, estimate, points, per)
    run.write(results, table, fig, a.repeats, spreads, targets, load_end=load_end)
    return results


def side_by_side(a: argparse.Namespace, targets: list[Target], lengths: list[int], params: float,
                 estimate: dict[str, Any], points: list[dict[str, Any]],
                 per: list[dict[str, Any]]) -> tuple[str, Any, dict[str, Any], dict[str, Any]]:
    """Table, figure, results and spreads of several servers: the per-length comparison first, then the
    fitted rates, then each server's own median table."""
    short = names(targets)
    labels = [label(name, t) for name, t in zip(short, targets, strict=True)]
    per_points = [server_points(points, i) for i in range(len(targets))]
    rows = by_length(per_points)
    table = ratio_table(short, rows)
    table += (f"\n\nMedians over {a.repeats} repeat(s); the servers take turns request by request, the order "
              f"rotating each repeat. {' and '.join(short[1:])} / {short[0]}: the peer's median TTFT over the "
              f"first's (>1: {short[0]} is faster). tok/s by TTFT: usage prompt tokens / TTFT.")
    table += "\n\n" + rates_table(list(zip(short, [r["fit"] for r in per], strict=True)), estimate, params)
    table += "".join(quad_note(r["fit"], name) for name, r in zip(short, per, strict=True))
    for name, r in zip(short, per, strict=True):
        table += f"\n\n{name}:\n\n" + medians_table(r["medians"])
    models = " vs ".join(dict.fromkeys(t.model.rsplit("/", 1)[-1] for t in targets))
    fig = plot_several(labels, per, estimate, models)
    results = {"lengths": lengths, "points": points, "estimate": estimate, "params": params,
               "per_server": [{"url": t.url, "name": name, "label": lab, "medians": r["medians"], "fit": r["fit"]}
                              for t, name, lab, r in zip(targets, short, labels, per, strict=True)],
               "by_length": rows}
    spreads = {f"{name} ttft_ms@{m['prompt_tokens']}": report.spread(m["ttft_per_repeat"])
               for name, r in zip(short, per, strict=True) for m in r["medians"]}
    spreads.update({f"{short[i]} / {short[0]} ttft@{r['target_tokens']}": report.spread(
        paired_ratios(per_points, i, r["target_tokens"])) for r in rows for i in range(1, len(targets))})
    return table, fig, results, spreads


def cli(a: argparse.Namespace) -> Any:
    return asyncio.run(main(a))
