"""``python -m bench multiturn`` / ``docs`` without a server: the prompts are deterministic and fresh
per round, the documents are interleaved, the statistics and hit rates, the arguments, and the
conversation loop against an in-process mock transport (no network)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from typing import Any

import httpx
import pytest

from bench import cmd_prefix as cp
from bench.__main__ import parser


# -- prompts -----------------------------------------------------------------------------------------
def test_words_are_deterministic_sized_and_fresh_per_round() -> None:
    a = cp.user_message(0, 1, 2, 200)
    assert a == cp.user_message(0, 1, 2, 200)
    assert len(a.split()) == 200 and set(a.split()) <= set(cp.WORDS)
    others = {cp.user_message(r, c, t, 200) for r, c, t in ((1, 1, 2), (0, 0, 2), (0, 1, 3))}
    assert a not in others and len(others) == 3
    assert cp.document(0, 0, 300) == cp.document(0, 0, 300) != cp.document(1, 0, 300)
    qs = {cp.question(0, d, q) for d in range(3) for q in range(8)}
    assert len(qs) == 24


def test_docs_are_interleaved() -> None:
    assert cp.docs_order(3, 2) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_body_is_greedy_streamed_with_usage_and_copies_the_history() -> None:
    msgs = [{"role": "user", "content": "x"}]
    b = cp.body("m", msgs, 7)
    msgs.append({"role": "assistant", "content": "y"})
    assert b["messages"] == [{"role": "user", "content": "x"}]
    assert b["temperature"] == 0 and b["stream"] and b["stream_options"] == {"include_usage": True}
    assert b["max_tokens"] == 7 and "ignore_eos" not in b


# -- statistics --------------------------------------------------------------------------------------
def rec(conv: int, turn: int, ttft: float, prompt: int, cached: int, completion: int = 10,
        error: str | None = None) -> dict[str, Any]:
    return {"round": 0, "conversation": conv, "turn": turn, "ttft_s": ttft, "e2e_s": ttft + 1,
            "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached,
            "error": error}


def test_summary_hit_rates_and_later_turns() -> None:
    recs = [rec(0, 0, 0.4, 100, 0), rec(0, 1, 0.1, 200, 150), rec(1, 0, 0.6, 100, 20),
            rec(1, 1, 0.2, 300, 240), rec(1, 2, 9.0, 400, 0, error="HTTP 500")]
    s = cp.summarize(recs, 4.0, "multiturn")
    assert s["requests"] == 5 and s["errors"] == 1
    assert s["prompt_tokens"] == 700 and s["cached_tokens"] == 410
    assert s["hit_rate"] == pytest.approx(410 / 700)
    assert s["later_hit_rate"] == pytest.approx(390 / 500)
    assert s["later_cached_frac_p50"] == pytest.approx((0.75 + 0.8) / 2)
    assert s["output_tok_s"] == pytest.approx(40 / 4.0)
    assert s["later_ttft_p50_ms"] == pytest.approx(150) and s["first_ttft_p50_ms"] == pytest.approx(500)
    assert s["ttft_p50_ms"] == pytest.approx(300)
    per = cp.by_index(recs, "multiturn")
    assert per[0]["ttft_p50_ms"] == pytest.approx(500) and per[1]["cached_frac_p50"] == pytest.approx(0.775)
    assert math.isnan(per[2]["ttft_p50_ms"])


def test_an_empty_round() -> None:
    empty = cp.summarize([], 1.0, "docs")
    assert math.isnan(empty["hit_rate"]) and empty["prompt_tokens"] == 0


# -- arguments ---------------------------------------------------------------------------------------
def test_arguments_of_each_workload() -> None:
    a = parser().parse_args(["multiturn"])
    assert (a.conversations, a.turns, a.user_tokens, a.max_tokens, a.system, a.label) == (8, 5, 200, 64, None, "")
    assert a.module == "bench.cmd_prefix" and a.command == "multiturn" and a.repeats == 3
    d = parser().parse_args(["docs", "--doc-tokens", "300", "--label", "cache_aware"])
    assert (d.documents, d.questions, d.doc_tokens, d.concurrency, d.max_tokens) == (3, 8, 300, 8, 32)
    assert d.label == "cache_aware" and d.command == "docs"
    with pytest.raises(SystemExit):
        parser().parse_args(["multiturn", "--doc-tokens", "300"])


# -- the conversation loop, on a mock transport -------------------------------------------------------
def sse(reply: str, prompt: int, cached: int | None) -> bytes:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": 2, "total_tokens": prompt + 2}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    events = [{"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]} for w in reply.split("|")]
    events.append({"choices": [], "usage": usage})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_multiturn_sends_the_growing_history() -> None:
    seen: list[list[dict[str, str]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        msgs = json.loads(request.content)["messages"]
        seen.append(msgs)
        turn = sum(m["role"] == "user" for m in msgs) - 1
        return httpx.Response(200, content=sse(f"re|ply{turn}", 10 * (turn + 1), 5 * turn if turn else None),
                              headers={"content-type": "text/event-stream"})

    a = argparse.Namespace(conversations=2, turns=3, user_tokens=5, max_tokens=4, system="be brief")

    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://t") as c:
            return await cp.run_multiturn(c, "m", a, 0)

    recs = asyncio.run(go())
    assert len(recs) == 6 and all(r["error"] is None for r in recs)
    last = [m for m in seen if len(m) == 6]
    assert len(last) == 2
    for msgs in last:
        assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
        assert msgs[0]["content"] == "be brief" and msgs[2]["content"] == "reply0" and msgs[4]["content"] == "reply1"
    assert last[0][1]["content"] != last[1][1]["content"]  # distinct per conversation
    assert [r["cached_tokens"] for r in recs if r["conversation"] == 0] == [0, 5, 10]
