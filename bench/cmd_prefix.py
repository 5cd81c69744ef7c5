"""``multiturn`` and ``docs``: workloads whose later requests repeat an earlier prompt's prefix, to
measure what a prefix cache (and a router that keeps a prefix on the replica that caches it) saves.

``multiturn``: ``--conversations`` conversations at once, ``--turns`` turns each, one after another;
every turn resends the whole history plus a new user message, so all but that message can be cached.
``docs``: ``--documents`` long documents with ``--questions`` questions each, one user message =
document + question, issued interleaved (q0 of every document, then q1, ...) so that only the cache,
not arrival order, can keep a document's questions together.

Per request: client TTFT, end-to-end time, ``usage``'s prompt, completion and
``prompt_tokens_details.cached_tokens`` (0 when absent). "Later" requests (turn ≥ 1,
question ≥ 1) are the ones a cache can help. Every round draws fresh words (the seed includes the
round), so one round's cache does not help the next, and the same arguments give the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import httpx

from bench import report
from bench.target import Target, chat_body, gather_limited, probe, stream_chat

#: Common words, one token each (with their leading space) in most BPE vocabularies, so N words ≈ N
#: tokens; ``usage.prompt_tokens`` gives the exact count.
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city name team minute idea kid body back parent face others level office door health person art "
         "war history party result change morning reason research girl guy moment air teacher force order "
         "red blue green old new good great small large long little big high low early late young open "
         "run walk talk read write sing play make take give find tell ask seem feel try leave call keep chair "
         "river stone bread apple garden window paper glass music light road field letter table").split()

#: (group, index) record keys of each workload: requests in one group share a prefix; index ≥ 1 is "later".
KEYS = {"multiturn": ("conversation", "turn"), "docs": ("document", "question")}

#: (result key, label, digits) of the per-round summary, in table order.
METRICS = [("ttft_p50_ms", "TTFT p50 (ms)", 1), ("ttft_p95_ms", "TTFT p95 (ms)", 1),
           ("first_ttft_p50_ms", "TTFT p50, first requests (ms)", 1),
           ("later_ttft_p50_ms", "TTFT p50, later requests (ms)", 1),
           ("later_ttft_p95_ms", "TTFT p95, later requests (ms)", 1), ("e2e_p50_s", "end-to-end p50 (s)", 2),
           ("output_tok_s", "output tok/s", 1), ("prompt_tokens", "prompt tokens (total)", 0),
           ("hit_rate", "cache-hit rate (cached / prompt tokens)", 3),
           ("later_hit_rate", "cache-hit rate, later requests", 3),
           ("later_cached_frac_p50", "cached fraction of prompt p50, later requests", 3),
           ("errors", "errors", 0)]


def add_args(p: argparse.ArgumentParser) -> None:
    """One module, two subcommands: the subcommand's name (the last word of its prog) picks the options."""
    p.add_argument("--label", default="", help="configuration name for the result header (e.g. cache_aware)")
    if p.prog.rsplit(" ", 1)[-1] == "multiturn":
        p.add_argument("--conversations", type=int, default=8, help="conversations at once")
        p.add_argument("--turns", type=int, default=5, help="turns per conversation, one after another")
        p.add_argument("--user-tokens", type=int, default=200, help="words (≈ tokens) per user message")
        p.add_argument("--system", default=None,
                       help="system prompt; without it none is sent (the chat template's own applies)")
        p.add_argument("--max-tokens", type=int, default=64, help="output tokens at most, greedy")
    else:
        p.add_argument("--documents", type=int, default=3, help="documents")
        p.add_argument("--questions", type=int, default=8, help="questions per document")
        p.add_argument("--doc-tokens", type=int, default=1500, help="words (≈ tokens) per document")
        p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
        p.add_argument("--max-tokens", type=int, default=32, help="output tokens at most, greedy")


# -- prompts -----------------------------------------------------------------------------------------
def words(n: int, *seed: Any) -> str:
    """``n`` pseudo-random words, the same for the same seed (a string seed: stable across processes)."""
    rng = random.Random("/".join(str(s) for s in seed))
    return " ".join(rng.choice(WORDS) for _ in range(n))


def user_message(rnd: int, conversation: int, turn: int, n: int) -> str:
    return words(n, "user", rnd, conversation, turn)


def document(rnd: int, doc: int, n: int) -> str:
    return words(n, "doc", rnd, doc)


def question(rnd: int, doc: int, q: int) -> str:
    w = words(1, "question", rnd, doc, q)
    return f"\n\nQuestion {q + 1}: which word most often follows '{w}' in the text above? Answer briefly."


def docs_order(documents: int, questions: int) -> list[tuple[int, int]]:
    """(document, question) in issue order: q0 of every document, then q1 of every document, ..."""
    return [(d, q) for q in range(questions) for d in range(documents)]


def body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """Greedy, streamed, usage in the last chunk; stops at EOS (the reply goes back into the history)."""
    b = chat_body(model, "", max_tokens, ignore_eos=False)
    b["messages"] = [dict(m) for m in messages]
    return b


def row(rec: Any, rnd: int, group_key: str, group: int, index_key: str, index: int) -> dict[str, Any]:
    return {"round": rnd, group_key: group, index_key: index, "ttft_s": rec.ttft, "e2e_s": rec.e2e,
            "prompt_tokens": rec.prompt_tokens or 0, "completion_tokens": rec.completion_tokens or 0,
            "cached_tokens": rec.cached_tokens or 0, "error": rec.error}


# -- workloads ---------------------------------------------------------------------------------------
async def run_multiturn(c: httpx.AsyncClient, model: str, a: argparse.Namespace, rnd: int,
                        bar: Any = None) -> list[dict[str, Any]]:
    """All conversations at once; within one, each turn waits for the previous reply."""

    async def conversation(conv: int) -> list[dict[str, Any]]:
        messages = [{"role": "system", "content": a.system}] if a.system else []
        out = []
        for turn in range(a.turns):
            messages.append({"role": "user", "content": user_message(rnd, conv, turn, a.user_tokens)})
            rec = await stream_chat(c, body(model, messages, a.max_tokens))
            out.append(row(rec, rnd, "conversation", conv, "turn", turn))
            if bar is not None:
                bar.update(1)
            if rec.error is not None:
                break  # no reply to put into the history: the rest of this conversation would differ
            messages.append({"role": "assistant", "content": rec.text})
        return out

    convs = await asyncio.gather(*[conversation(i) for i in range(a.conversations)])
    return [r for conv in convs for r in conv]


async def run_docs(c: httpx.AsyncClient, model: str, a: argparse.Namespace, rnd: int,
                   bar: Any = None) -> list[dict[str, Any]]:
    """Every question of every document, ``--concurrency`` in flight, documents interleaved."""
    docs = [document(rnd, d, a.doc_tokens) for d in range(a.documents)]

    async def one(d: int, q: int) -> dict[str, Any]:
        msg = [{"role": "user", "content": docs[d] + question(rnd, d, q)}]
        return row(await stream_chat(c, body(model, msg, a.max_tokens)), rnd, "document", d, "question", q)

    order = docs_order(a.documents, a.questions)
    return await gather_limited([one(d, q) for d, q in order], a.concurrency, bar)


# -- statistics --------------------------------------------------------------------------------------
def hit_rate(recs: list[dict[str, Any]]) -> float:
    prompt = sum(r["prompt_tokens"] for r in recs)
    return sum(r["cached_tokens"] for r in recs) / prompt if prompt else float("nan")


def summarize(recs: list[dict[str, Any]], wall: float, workload: str) -> dict[str, Any]:
    """One round: TTFT overall / first / later, output tok/s over the round's wall time, hit rates."""
    group_key, index_key = KEYS[workload]
    ok = [r for r in recs if r["error"] is None]
    first = [r for r in ok if r[index_key] == 0]
    later = [r for r in ok if r[index_key] >= 1]
    ms = [r["ttft_s"] * 1e3 for r in ok]
    later_ms = [r["ttft_s"] * 1e3 for r in later]
    return {"requests": len(recs), "errors": len(recs) - len(ok),
            "ttft_p50_ms": report.pct(ms, 50), "ttft_p95_ms": report.pct(ms, 95),
            "first_ttft_p50_ms": report.med([r["ttft_s"] * 1e3 for r in first]),
            "later_ttft_p50_ms": report.pct(later_ms, 50), "later_ttft_p95_ms": report.pct(later_ms, 95),
            "e2e_p50_s": report.med([r["e2e_s"] for r in ok]),
            "output_tok_s": sum(r["completion_tokens"] for r in ok) / wall if wall > 0 else float("nan"),
            "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
            "cached_tokens": sum(r["cached_tokens"] for r in ok),
            "hit_rate": hit_rate(ok), "later_hit_rate": hit_rate(later),
            "later_cached_frac_p50": report.med([r["cached_tokens"] / r["prompt_tokens"]
                                                 for r in later if r["prompt_tokens"]]),
            "wall_s": wall}


def by_index(recs: list[dict[str, Any]], workload: str) -> dict[int, dict[str, float]]:
    """Per turn (question) index: median TTFT and cached fraction across conversations (documents)."""
    index_key = KEYS[workload][1]
    out = {}
    for i in sorted({r[index_key] for r in recs}):
        rs = [r for r in recs if r[index_key] == i and r["error"] is None]
        out[i] = {"ttft_p50_ms": report.med([r["ttft_s"] * 1e3 for r in rs]),
                  "cached_frac_p50": report.med([r["cached_tokens"] / r["prompt_tokens"]
                                                 for r in rs if r["prompt_tokens"]]),
                  "prompt_tokens_p50": report.med([r["prompt_tokens"] for r in rs])}
    return out


# -- the command -------------------------------------------------------------------------------------
async def main(a: argparse.Namespace) -> dict[str, Any]:
    workload = a.command
    index_key = KEYS[workload][1]
    run = report.Run(workload, a, a.out)
    target: Target = await probe(a.url, a.model)
    multi = workload == "multiturn"
    per_round = a.conversations * a.turns if multi else a.documents * a.questions
    bar = report.progress(per_round * a.repeats, workload, not a.no_progress)
    rounds: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    async with target.client(a.conversations if multi else a.concurrency) as c:
        await stream_chat(c, chat_body(target.model, "warm up", 2))
        for rnd in range(a.repeats):
            t0 = time.perf_counter()
            recs = await (run_multiturn if multi else run_docs)(c, target.model, a, rnd, bar)
            s = summarize(recs, time.perf_counter() - t0, workload)
            s["round"], s["by_index"] = rnd, by_index(recs, workload)
            rounds.append(s)
            records += recs
    bar.close()
    if not any(r["cached_tokens"] for r in records):
        target.skip("no usage.prompt_tokens_details.cached_tokens above 0: hit rates read 0")
    spreads = {k: report.spread([r[k] for r in rounds]) for k, _, _ in METRICS}
    rows = [[label, report.fmt(float(spreads[k]["median"]), d), fmt_range(spreads[k], d)]
            for k, label, d in METRICS]
    idx = sorted({i for r in rounds for i in r["by_index"]})
    per_index = {i: {k: report.med([r["by_index"][i][k] for r in rounds if i in r["by_index"]])
                     for k in ("ttft_p50_ms", "cached_frac_p50", "prompt_tokens_p50")} for i in idx}
    head = f"Configuration: **{a.label}**\n\n" if a.label else ""
    what = (f"{a.conversations} conversations × {a.turns} turns, {a.user_tokens} words per user message, "
            f"system prompt {'given' if a.system else 'the template default'}" if multi else
            f"{a.documents} documents × {a.questions} questions, {a.doc_tokens} words per document, "
            f"{a.concurrency} in flight, documents interleaved")
    table = head + report.md_table(["metric (median of rounds)", "value", "range over rounds"], rows)
    table += "\n\n" + report.md_table(
        [index_key, "TTFT p50 (ms)", "cached fraction p50", "prompt tokens p50"],
        [[str(i), report.fmt(p["ttft_p50_ms"]), report.fmt(p["cached_frac_p50"], 3),
          report.fmt(p["prompt_tokens_p50"], 0)]
         for i, p in per_index.items()])
    table += (f"\n\n{what}; greedy, at most {a.max_tokens} tokens out; {a.repeats} round(s) with fresh words "
              f"each. Later = {index_key} ≥ 1. Hit rate = Σ cached_tokens / Σ prompt_tokens (usage); output "
              "tok/s = completion tokens / round wall time. The per-index table is the median over "
              f"{KEYS[workload][0]}s, then over rounds.")
    fig, (ax0, ax1) = report.figure(2, 9, 4.2)
    for r in rounds:
        xs = sorted(r["by_index"])
        ax0.plot(xs, [r["by_index"][i]["ttft_p50_ms"] for i in xs], "o-", label=f"round {r['round']}")
        ax1.plot(xs, [r["by_index"][i]["cached_frac_p50"] for i in xs], "o-", label=f"round {r['round']}")
    for ax, ylabel in ((ax0, "TTFT p50 (ms)"), (ax1, "cached fraction of prompt p50")):
        ax.set_xlabel(f"{index_key} index")
        ax.set_ylabel(ylabel)
        ax.set_xticks(idx)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    ax0.set_title(f"{workload}: TTFT by {index_key}{' (' + a.label + ')' if a.label else ''}")
    ax1.set_title(f"cached fraction by {index_key}")
    ax1.set_ylim(top=1.05)
    results = {"label": a.label, "workload": workload, "per_round": rounds, "by_index": per_index,
               "requests": records}
    run.write(results, table, fig, a.repeats, spreads, [target])
    return results


def fmt_range(s: dict[str, Any], digits: int) -> str:
    lo, hi = (report.fmt(float(s[k]), digits) for k in ("min", "max"))
    return f"{lo} – {hi} ({report.fmt(float(s['spread_pct']), 0)}%)"


def cli(a: argparse.Namespace) -> Any:
    return asyncio.run(main(a))
