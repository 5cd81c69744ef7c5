"""``proxy``: the same stream direct and through a real nginx (see ``bench/nginx.py``): default
buffering, default buffering with ``proxy_ignore_headers X-Accel-Buffering``, and both again with
``gzip`` on for ``text/event-stream``; per-event arrival times on each path.

With the server's ``X-Accel-Buffering: no`` honoured, nginx passes each event on as it arrives (gaps
track the direct ones). When nginx ignores the header the response is buffered: with gzip on the
stream then arrives in one piece; without gzip, nginx 1.22 still forwards each upstream HTTP chunk
(one SSE event) as it comes, which the table shows rather than assumes."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import httpx

from bench import report
from bench.nginx import VARIANTS, Nginx
from bench.target import StreamRecord, chat_body, exact_prompt, probe, stream_chat

#: Path label → nginx variant (None: direct).
PATHS: dict[str, str | None] = {
    "direct": None,
    "nginx (default buffering)": "default",
    "nginx ignoring X-Accel-Buffering": "ignore",
    "nginx + gzip": "gzip",
    "nginx + gzip ignoring X-Accel-Buffering": "gzip+ignore",
}
#: Two events closer than this arrived in one read: a clump.
CLUMP_S = 0.002


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length")
    p.add_argument("--variants", default=",".join(v for v in PATHS.values() if v),
                   help="nginx variants to run besides direct (default, ignore, gzip, gzip+ignore)")
    p.add_argument("--tolerance", type=float, default=0.2,
                   help="allowed relative difference of median gaps, nginx vs direct")


def path_stats(recs: list[StreamRecord]) -> dict[str, Any]:
    ok = [r for r in recs if r.error is None]
    gaps = [g for r in ok for g in r.gaps]
    return {"streams": len(recs), "errors": len(recs) - len(ok),
            "first_event_ms": report.med([r.event_times[0] * 1e3 for r in ok]),
            "last_event_ms": report.med([r.event_times[-1] * 1e3 for r in ok]),
            "first_over_last": report.med([r.event_times[0] / r.event_times[-1] for r in ok if r.event_times[-1] > 0]),
            "events": report.med([len(r.event_times) for r in ok]),
            "tokens": report.med([r.completion_tokens for r in ok if r.completion_tokens]),
            "gap_p50_ms": report.pct(gaps, 50) * 1e3, "gap_p95_ms": report.pct(gaps, 95) * 1e3,
            "clumped_gap_frac": sum(g < CLUMP_S for g in gaps) / len(gaps) if gaps else float("nan"),
            "max_events_per_clump": report.med([_max_clump(r) for r in ok])}


def _max_clump(r: StreamRecord) -> int:
    best = cur = 1
    for g in r.gaps:
        cur = cur + 1 if g < CLUMP_S else 1
        best = max(best, cur)
    return best


async def measure(upstream: str, model: str, rounds: int, prompt_tokens: int, max_tokens: int,
                  bar: Any = None, target: Any = None, variants: list[str] | None = None
                  ) -> tuple[dict[str, list[StreamRecord]], str]:
    """Alternate direct and each nginx variant, ``rounds`` times each."""
    paths = {p: v for p, v in PATHS.items() if v is None or variants is None or v in variants}
    recs: dict[str, list[StreamRecord]] = {p: [] for p in paths}
    with Nginx(upstream, variants={v: VARIANTS[v] for v in paths.values() if v}) as ng:
        urls = {p: ng.urls[v] if v else upstream for p, v in paths.items()}
        async with httpx.AsyncClient(timeout=600) as c:
            for path in paths:  # warm each path's connection
                await stream_chat(c, chat_body(model, "warm up", 2), base=urls[path])
            for _ in range(rounds):
                for path in paths:
                    text = (await exact_prompt(_Based(c, upstream), target, prompt_tokens))[0] if target else \
                        "Tell me a long story about a lighthouse keeper."
                    recs[path].append(await stream_chat(c, chat_body(model, text, max_tokens), base=urls[path]))
                    if bar is not None:
                        bar.update(1)
        version = ng.version()
    return recs, version


class _Based:
    """An AsyncClient whose relative URLs go to ``base`` (for /tokenize on the upstream)."""

    def __init__(self, c: httpx.AsyncClient, base: str) -> None:
        self.c, self.base = c, base

    async def post(self, path: str, **kw: Any) -> httpx.Response:
        return await self.c.post(self.base + path, **kw)


def verdict(stats: dict[str, dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """Per nginx path: its median gap over the direct one, and whether its events clump."""
    d = stats["direct"]
    out: dict[str, Any] = {"direct_clumped_gap_frac": d["clumped_gap_frac"]}
    for p, v in PATHS.items():
        if v is None or p not in stats:
            continue
        s = stats[p]
        ratio = s["gap_p50_ms"] / d["gap_p50_ms"] if d["gap_p50_ms"] else float("nan")
        out[v] = {"gap_p50_over_direct": ratio, "tracks_direct": abs(ratio - 1) <= tolerance,
                  "first_over_last": s["first_over_last"], "clumped_gap_frac": s["clumped_gap_frac"],
                  "clumps": s["clumped_gap_frac"] > max(0.5, 2 * d["clumped_gap_frac"])}
    return out


async def main(a: argparse.Namespace) -> dict[str, Any]:
    run = report.Run("proxy", a, a.out)
    target = await probe(a.url, a.model)
    variants = [v for v in a.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown nginx variants {sorted(unknown)}; known: {sorted(VARIANTS)}")
    bar = report.progress(a.repeats * (len(variants) + 1), "proxy", not a.no_progress)
    recs, version = await measure(target.url, target.model, a.repeats, a.prompt_tokens, a.max_tokens, bar, target,
                                  variants)
    bar.close()
    stats = {p: path_stats(r) for p, r in recs.items()}
    v = verdict(stats, a.tolerance)
    rows = [[p, s["first_event_ms"], s["last_event_ms"], s["gap_p50_ms"], s["gap_p95_ms"],
             100 * s["clumped_gap_frac"], s["max_events_per_clump"], s["events"], s["tokens"]] for p, s in stats.items()]
    table = report.md_table(["path", "first event (ms)", "last event (ms)", "gap p50 (ms)", "gap p95 (ms)",
                             f"gaps < {CLUMP_S * 1e3:g} ms (%)", "largest clump (events)", "events", "tokens"], rows)
    table += (f"\n\n{version}; {a.repeats} round(s) alternating the {len(recs)} paths, one stream at a time, "
              f"{a.max_tokens} tokens (usage), greedy, ignore_eos; medians over streams; a clump is events less "
              f"than {CLUMP_S * 1e3:g} ms apart.\n\n")
    table += report.md_table(["nginx variant", "median gap / direct", f"within ±{a.tolerance:.0%}", "events clump"],
                             [[k, f"{x['gap_p50_over_direct']:.2f}", "yes" if x["tracks_direct"] else "no",
                               "yes" if x["clumps"] else "no"] for k, x in v.items() if isinstance(x, dict)])
    fig, ax = report.figure(1, 8, 4.2)
    for k, (p, rs) in enumerate(recs.items()):
        r = next((x for x in rs if x.error is None), None)
        if r:
            ax.step([t * 1e3 for t in r.event_times], range(1, len(r.event_times) + 1), where="post",
                    label=p, color=f"C{k}", lw=3.0 - 0.5 * k, alpha=0.85)
    ax.set_xlabel("arrival time since the request was sent (ms)")
    ax.set_ylabel("SSE content events received")
    ax.set_title(f"One {a.max_tokens}-token stream on each path (round 1)")
    ax.legend(fontsize=8, loc="upper left")
    results = {"paths": stats, "verdict": v, "nginx": version,
               "event_times_ms": {p: [[t * 1e3 for t in r.event_times] for r in rs] for p, rs in recs.items()},
               "requests": {p: [r.summary() for r in rs] for p, rs in recs.items()}}
    spreads = {f"gap_p50_ms[{p}]": report.spread([report.med(r.gaps) * 1e3 for r in rs if r.error is None])
               for p, rs in recs.items()}
    run.write(results, table, fig, a.repeats, spreads, [target])
    return results


def cli(a: argparse.Namespace) -> Any:
    return asyncio.run(main(a))
