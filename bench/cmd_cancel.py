"""``cancel``: start 20 long generations, drop 10 clients after 1 s, and watch the engine's running
count and KV usage in ``/metrics``: how long until the dropped requests leave the engine, and how
many tokens were generated for nobody."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Any

from bench import prom, report
from bench.target import StreamRecord, chat_body, exact_prompt, probe, stream_chat


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=20, help="long generations started together")
    p.add_argument("--drop", type=int, default=10, help="clients dropped")
    p.add_argument("--drop-after", type=float, default=1.0,
                   help="seconds before dropping, counted from when every stream has its first token "
                        "(so all of them are in the engine; see --from-start)")
    p.add_argument("--from-start", action="store_true",
                   help="count --drop-after from sending the requests instead")
    p.add_argument("--observe", type=float, default=5.0, help="seconds watched after the drop")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens each generation asks for")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length")
    p.add_argument("--poll", type=float, default=0.05, help="/metrics polling interval in s")


async def one_round(a: argparse.Namespace, target: Any, bar: Any) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    async with target.client(a.streams + 4) as c:
        prompts = [(await exact_prompt(c, target, a.prompt_tokens))[0] for _ in range(a.streams)]
        stop = asyncio.Event()
        t0 = time.perf_counter()

        async def poll() -> None:
            while not stop.is_set():
                try:
                    s = await prom.scrape(c)
                    s["t"] = time.perf_counter() - t0
                    samples.append(s)
                except Exception as exc:  # noqa: BLE001 - a missed sample is not fatal
                    samples.append({"t": time.perf_counter() - t0, "error": str(exc)})
                await asyncio.sleep(a.poll)

        poller = asyncio.create_task(poll()) if target.has_metrics else None
        if poller:
            while not samples:
                await asyncio.sleep(0.01)
            t0_base = dict(samples[0])
        else:
            t0_base = {}
        recs = [StreamRecord() for _ in prompts]
        tasks = [asyncio.create_task(stream_chat(c, chat_body(target.model, p, a.max_tokens), rec=r))
                 for p, r in zip(prompts, recs, strict=True)]
        t_all_started = None
        if not a.from_start:
            deadline = time.perf_counter() + 120
            while any(not r.event_times and r.error is None for r in recs) and time.perf_counter() < deadline:
                await asyncio.sleep(0.02)
            t_all_started = time.perf_counter() - t0
        await asyncio.sleep(a.drop_after)
        t_drop = time.perf_counter() - t0
        for t in tasks[:a.drop]:
            t.cancel()
        bar.update(a.drop)
        await asyncio.sleep(a.observe)
        t_rest = time.perf_counter() - t0
        at_rest = dict(samples[-1]) if samples else {}
        for t in tasks[a.drop:]:
            t.cancel()
        bar.update(a.streams - a.drop)
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        # Let the engine settle (running back to zero) before the next round.
        deadline = time.perf_counter() + 30
        while poller and time.perf_counter() < deadline and (samples[-1].get("num_requests_running") or 0) > 0:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)
        stop.set()
        if poller:
            await poller
    out = analyse(a, samples, t_drop, t_rest, t0_base, at_rest)
    out["t_all_first_token_s"] = t_all_started
    out["dropped_tokens_received"] = [r.completion_tokens or len(r.event_times) for r in recs[:a.drop]]
    return out


def analyse(a: argparse.Namespace, samples: list[dict[str, Any]], t_drop: float, t_rest: float,
            base: dict[str, Any], at_rest: dict[str, Any]) -> dict[str, Any]:
    good = [s for s in samples if "error" not in s and s.get("num_requests_running") is not None]
    before = [s for s in good if s["t"] <= t_drop]
    running_at_drop = before[-1]["num_requests_running"] if before else None
    kv_at_drop = before[-1].get("kv_cache_usage_perc") if before else None
    pct100 = (lambda v: None if v is None else 100 * v)  # noqa: E731
    t_running_dropped = None
    window_tokens = None
    if running_at_drop is not None:
        goal = running_at_drop - min(a.drop, running_at_drop)
        hit = next((s for s in good if t_drop < s["t"] <= t_rest and s["num_requests_running"] <= goal), None)
        t_running_dropped = hit["t"] - t_drop if hit else None
        # The engine only counts tokens after it learns the client went; from the client's side, every
        # token made for the dropped requests between the drop and their leaving the engine was for
        # nobody: their share of all tokens generated in that window.
        g0, g1 = before[-1].get("generation_tokens"), (hit or {}).get("generation_tokens")
        if hit and g0 is not None and g1 is not None and running_at_drop:
            window_tokens = (g1 - g0) * min(a.drop, running_at_drop) / running_at_drop
    kv_after = [s.get("kv_cache_usage_perc") for s in good if t_drop < s["t"] <= t_rest]
    t_kv_drop = None
    if kv_at_drop is not None:
        hit = next((s for s in good if t_drop < s["t"] <= t_rest and (s.get("kv_cache_usage_perc") or 0) < kv_at_drop),
                   None)
        t_kv_drop = hit["t"] - t_drop if hit else None
    gone = None
    if base.get("tokens_after_client_gone") is not None and at_rest.get("tokens_after_client_gone") is not None:
        gone = at_rest["tokens_after_client_gone"] - base["tokens_after_client_gone"]
    end = good[-1] if good else {}
    gone_all = (end.get("tokens_after_client_gone") - base["tokens_after_client_gone"]
                if base.get("tokens_after_client_gone") is not None and end.get("tokens_after_client_gone") is not None
                else None)
    return {"t_drop_s": t_drop, "t_cancel_rest_s": t_rest, "running_at_drop": running_at_drop,
            "kv_usage_at_drop_pct": pct100(kv_at_drop), "running_drop_latency_s": t_running_dropped,
            "kv_drop_latency_s": t_kv_drop, "kv_usage_min_after_drop_pct": pct100(min(kv_after)) if kv_after else None,
            "tokens_for_nobody_dropped": gone, "tokens_for_nobody_all": gone_all,
            "tokens_for_nobody_client_view": window_tokens,
            "running_end": end.get("num_requests_running"),
            "sample_interval_s": report.med([b["t"] - x["t"] for x, b in zip(good, good[1:], strict=False)]),
            "metrics_refresh_s": refresh_period(good),
            "samples": samples}


def refresh_period(samples: list[dict[str, Any]]) -> float | None:
    """How often the engine's numbers in /metrics actually change while it is busy: the median time
    between changes of the generation-token counter (a server may report its engine state
    periodically rather than on each scrape)."""
    changes = [s["t"] for x, s in zip(samples, samples[1:], strict=False)
               if s.get("generation_tokens") is not None and s.get("generation_tokens") != x.get("generation_tokens")]
    gaps = [b - x for x, b in zip(changes, changes[1:], strict=False)]
    return report.med(gaps) if gaps else None


async def main(a: argparse.Namespace) -> dict[str, Any]:
    run = report.Run("cancel", a, a.out)
    target = await probe(a.url, a.model)
    if not target.has_metrics:
        target.skip("no /metrics: the engine's running count and KV usage cannot be watched; "
                    "only the client side is exercised")
    rounds = []
    bar = report.progress(a.streams * a.repeats, "cancel", not a.no_progress)
    async with target.client(2) as c:
        await stream_chat(c, chat_body(target.model, "warm up", 2))
    for _ in range(a.repeats):
        rounds.append(await one_round(a, target, bar))
    bar.close()
    if rounds and rounds[0]["samples"] and rounds[0]["samples"][0].get("tokens_after_client_gone") is None \
            and target.has_metrics:
        target.skip("the server exports no tokens-after-client-gone counter: tokens generated for nobody unknown")
    keys = ["running_drop_latency_s", "kv_drop_latency_s", "tokens_for_nobody_dropped", "tokens_for_nobody_client_view",
            "running_at_drop",
            "kv_usage_at_drop_pct", "kv_usage_min_after_drop_pct", "tokens_for_nobody_all", "running_end"]
    spreads = {k: report.spread([r[k] if r[k] is not None else float("nan") for r in rounds]) for k in keys}
    labels = {"running_drop_latency_s": "drop → running count down by the dropped (s)",
              "kv_drop_latency_s": "drop → KV usage below its value at the drop (s)",
              "tokens_for_nobody_dropped": "tokens generated after the engine learned the client had gone "
                                           "(server counter, the dropped)",
              "tokens_for_nobody_client_view": "tokens generated for the dropped between the drop and their leaving "
                                               "the engine (their share of generation_tokens)",
              "running_at_drop": "engine running count at the drop",
              "kv_usage_at_drop_pct": "KV cache usage at the drop (%)",
              "kv_usage_min_after_drop_pct": "lowest KV cache usage in the observed window (%)",
              "tokens_for_nobody_all": "tokens after client gone, all (incl. the rest cancelled at the end)",
              "running_end": "engine running count at the end"}
    rows = [[labels[k], report.fmt(spreads[k]["median"], 2),
             " / ".join(report.fmt(v, 2) for v in spreads[k]["per_repeat"])]
            for k in keys]
    table = report.md_table(["measurement (median of rounds)", "value", "per round"], rows)
    when = "after sending" if a.from_start else "after every stream had its first token"
    table += (f"\n\n{a.streams} streams × {a.max_tokens} tokens (ignore_eos), {a.drop} clients dropped "
              f"{a.drop_after:g} s {when} (connection closed), the rest cancelled {a.observe:g} s later; "
              f"/metrics polled every {a.poll * 1e3:.0f} ms plus the scrape itself: one sample every "
              f"{report.fmt(report.med([r['sample_interval_s'] for r in rounds]) * 1e3, 0)} ms (median), so "
              "latencies are ± one sample interval.")
    refresh = report.med([r["metrics_refresh_s"] for r in rounds if r.get("metrics_refresh_s")])
    if refresh == refresh:
        table += (f" The engine's numbers in /metrics changed every {refresh * 1e3:,.0f} ms (median, busy engine): "
                  "the drop latencies above cannot be resolved more finely than that.")
    fig, ax = report.figure(1, 8, 4.2)
    r0 = rounds[0]
    good = [s for s in r0["samples"] if s.get("num_requests_running") is not None]
    if good:
        ax.step([s["t"] for s in good], [s["num_requests_running"] for s in good], where="post",
                label="running requests", color="C0")
        ax.set_ylabel("engine running requests", color="C0")
        ax2 = ax.twinx()
        ax2.plot([s["t"] for s in good], [100 * (s.get("kv_cache_usage_perc") or 0) for s in good],
                 color="C1", label="KV cache usage")
        ax2.set_ylabel("KV cache usage (%)", color="C1")
        ax2.set_ylim(bottom=0)
        ax2.grid(False)
    ax.axvline(r0["t_drop_s"], color="C3", ls="--", label=f"{a.drop} clients dropped")
    ax.axvline(r0["t_cancel_rest_s"], color="grey", ls=":", label="rest cancelled")
    ax.set_xlabel("time since the streams started (s)")
    ax.set_ylim(bottom=0)
    ax.set_title("Cancellation: engine state from /metrics (round 1)")
    ax.legend(loc="lower left", fontsize=8)
    run.write({"rounds": rounds}, table, fig, a.repeats, spreads, [target])
    return {"rounds": rounds}


def cli(a: argparse.Namespace) -> Any:
    return asyncio.run(main(a))
