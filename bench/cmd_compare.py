"""``compare``: the same client against this server and a peer (llama.cpp's ``llama-server`` on the same
GGUF file) in one run, alternating rounds: chat, greedy, ignore_eos, 128 tokens, 1, 8 and 32 streams.
Throughput, TTFT and ITL ratios (ours / peer) per level."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench import report
from bench.peer import DEFAULT_BINARY, LlamaServer
from bench.target import Target, chat_body, probe, stream_chat

TOPICS = ["rivers", "volcanoes", "bridges", "bees", "libraries", "glaciers", "trains", "forests"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer-url", default="", help="an already running peer")
    p.add_argument("--peer-bin", default=str(DEFAULT_BINARY), help="llama-server binary")
    p.add_argument("--peer-gguf", default="", help="GGUF for the peer")
    p.add_argument("--peer-threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--peer-parallel", type=int, default=32, help="llama-server -np")
    p.add_argument("--peer-ctx", type=int, default=32768, help="llama-server -c")
    p.add_argument("--levels", default="1,8,32", help="concurrent streams")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per stream")


async def wave(t: Target, n: int, max_tokens: int, rnd: int, bar: Any) -> dict[str, Any]:
    async with t.client(n) as c:
        async def one(i: int) -> Any:
            text = f"Write a detailed essay about {TOPICS[i % len(TOPICS)]} number {i} (round {rnd}):"
            rec = await stream_chat(c, chat_body(t.model, text, max_tokens))
            bar.update(1)
            return rec

        t0 = time.perf_counter()
        recs = await asyncio.gather(*[one(i) for i in range(n)])
        wall = time.perf_counter() - t0
    ok = [r for r in recs if r.error is None]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    gaps = [g for r in ok for g in r.gaps]
    return {"concurrency": n, "errors": len(recs) - len(ok), "first_error": next((r.error for r in recs if r.error), None),
            "output_tok_s": tokens / wall, "ttft_p50_ms": report.pct([r.ttft for r in ok], 50) * 1e3,
            "ttft_p95_ms": report.pct([r.ttft for r in ok], 95) * 1e3,
            "tpot_p50_ms": report.pct([r.tpot for r in ok], 50) * 1e3,
            "gap_p50_ms": report.pct(gaps, 50) * 1e3, "gap_p95_ms": report.pct(gaps, 95) * 1e3,
            "tokens_per_event": tokens / max(1, sum(len(r.event_times) for r in ok)),
            "completion_tokens_p50": report.med([r.completion_tokens for r in ok if r.completion_tokens]),
            "prompt_tokens_p50": report.med([r.prompt_tokens for r in ok if r.prompt_tokens]),
            "wall_s": wall}


async def run_compare(a: argparse.Namespace, ours: Target, peer: Target) -> list[dict[str, Any]]:
    levels = [int(x) for x in a.levels.split(",") if x]
    bar = report.progress(2 * sum(levels) * a.repeats, "compare", not a.no_progress)
    for t in (ours, peer):
        await wave(t, 1, 4, -1, report.progress(1, "warm-up", False))
    waves = []
    for rnd in range(a.repeats):
        for n in levels:
            order = [("ours", ours), ("peer", peer)]
            if rnd % 2:
                order.reverse()  # alternate who goes first
            for name, t in order:
                w = await wave(t, n, a.max_tokens, rnd, bar)
                waves.append({"server": name, "round": rnd, **w})
    bar.close()
    return waves


async def main(a: argparse.Namespace) -> dict[str, Any]:
    run = report.Run("compare", a, a.out)
    ours = await probe(a.url, a.model)
    peer_proc = None
    if a.peer_url:
        peer_url = a.peer_url
    else:
        peer_proc = LlamaServer(a.peer_bin, a.peer_gguf or None, a.peer_threads, a.peer_parallel, a.peer_ctx,
                                alias=ours.model)
        print(f"[bench] starting peer: {peer_proc.command}", flush=True)
        peer_proc.start()
        peer_url = peer_proc.url
    try:
        peer = await probe(peer_url, ours.model)
        if peer_proc:
            peer.server_version = f"{peer_proc.version()} | {peer.server_version}"
            peer.notes.append(f"peer command: {peer_proc.command}")
        waves = await run_compare(a, ours, peer)
    finally:
        if peer_proc:
            peer_proc.stop()
    levels = [int(x) for x in a.levels.split(",") if x]
    keys = ["output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "gap_p50_ms", "ttft_p95_ms", "tokens_per_event"]
    summary, spreads, rows = [], {}, []
    for n in levels:
        row: dict[str, Any] = {"concurrency": n}
        for name in ("ours", "peer"):
            ws = [w for w in waves if w["server"] == name and w["concurrency"] == n]
            for k in keys:
                sp = report.spread([w[k] for w in ws])
                spreads[f"{name}.{k}@{n}"] = sp
                row[f"{name}_{k}"] = sp["median"]
        for k in keys[:5]:
            row[f"ratio_{k}"] = row[f"ours_{k}"] / row[f"peer_{k}"] if row[f"peer_{k}"] else float("nan")
        summary.append(row)
        rows.append([str(n), row["ours_output_tok_s"], row["peer_output_tok_s"], f"{row['ratio_output_tok_s']:.2f}",
                     row["ours_ttft_p50_ms"], row["peer_ttft_p50_ms"], f"{row['ratio_ttft_p50_ms']:.2f}",
                     row["ours_tpot_p50_ms"], row["peer_tpot_p50_ms"], f"{row['ratio_tpot_p50_ms']:.2f}",
                     row["ours_gap_p50_ms"], row["peer_gap_p50_ms"],
                     row["ours_ttft_p95_ms"], row["peer_ttft_p95_ms"], f"{row['ratio_ttft_p95_ms']:.2f}"])
    table = report.md_table(["streams", "ours tok/s", "peer tok/s", "ours/peer", "ours TTFT p50 (ms)", "peer TTFT",
                             "ours/peer", "ours TPOT p50 (ms)", "peer TPOT", "ours/peer", "ours event gap p50 (ms)",
                             "peer event gap", "ours TTFT p95 (ms)", "peer TTFT p95", "ours/peer"], rows)
    table += (f"\n\nMedians over {a.repeats} round(s), the servers alternating (who goes first alternates too); "
              f"chat, greedy, ignore_eos, {a.max_tokens} tokens (usage). Ratios: ours / peer (tok/s: >1 is ours "
              f"faster; TTFT and TPOT: <1 is ours faster).")
    fig, axes = report.figure(3, 10, 3.6)
    for ax, k, label in ((axes[0], "output_tok_s", "output tokens/s (all streams)"),
                         (axes[1], "ttft_p50_ms", "TTFT p50 (ms)"), (axes[2], "tpot_p50_ms", "TPOT p50 (ms)")):
        for name, style in (("ours", "o-"), ("peer", "s--")):
            ax.plot(levels, [r[f"{name}_{k}"] for r in summary], style,
                    label="lifecycle-serve" if name == "ours" else "llama-server")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    peer_desc = f"llama-server -t {a.peer_threads}" if not a.peer_url else "peer"
    fig.suptitle(f"{ours.model}: lifecycle-serve vs {peer_desc}, same machine, alternating rounds")
    results = {"levels": summary, "waves": waves}
    run.write(results, table, fig, a.repeats, spreads, [ours, peer])
    return results


def cli(a: argparse.Namespace) -> Any:
    return asyncio.run(main(a))
