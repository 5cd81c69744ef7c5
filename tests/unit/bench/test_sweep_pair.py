"""``python -m bench sweep`` with several servers, without a server: the ``--url``/``--model`` lists, the
turn order, the per-length ratios and rates on synthetic points, the re-analysis of a one-server and a
two-server sweep.json (fits recovered from known lines), the interleaved measuring loop with the
requests faked, and llama.cpp's ``/tokenize`` dialect against an in-process mock transport."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench import cmd_sweep as cs
from bench import report
from bench.target import StreamRecord, Target, _tokenize_api, count_chat_tokens, exact_prompt

LENGTHS = [100, 200, 400]


def line_points(server: int | None, ms_per_token: float, usage_extra: int = 0, repeats: int = 2,
                ) -> list[dict[str, Any]]:
    """Points on TTFT = 50 ms + ms_per_token × T (T: the usage count), ±1 ms between repeats, prefill
    10 ms under TTFT; ``usage_extra`` tokens more than asked (a template that counts differently)."""
    out = []
    for rep in range(repeats):
        for n in LENGTHS:
            u = n + usage_extra
            ttft = 50 + ms_per_token * u + (1 if rep else -1)
            out.append({"repeat": rep, **({"server": server} if server is not None else {}), "target_tokens": n,
                        "tokenize_count": u, "prompt_tokens": u, "ttft_ms": ttft, "prefill_ms": ttft - 10,
                        "queue_ms": None, "prep_ms": None, "error": None})
    return out


# -- arguments and order -----------------------------------------------------------------------------
def test_urls_and_models() -> None:
    assert cs.servers("http://a:1", None) == [("http://a:1", None)]
    assert cs.servers("http://a:1, http://b:2/v1", None) == [("http://a:1", None), ("http://b:2/v1", None)]
    assert cs.servers("http://a:1,http://b:2", "m") == [("http://a:1", "m"), ("http://b:2", "m")]
    assert cs.servers("http://a:1,http://b:2", "m,n") == [("http://a:1", "m"), ("http://b:2", "n")]
    with pytest.raises(SystemExit, match="2 models for 3 URL"):
        cs.servers("a,b,c", "m,n")


def test_turn_order_alternates_and_rotates() -> None:
    assert [cs.turn_order(2, r) for r in range(4)] == [[0, 1], [1, 0], [0, 1], [1, 0]]
    three = [cs.turn_order(3, r) for r in range(3)]
    for place in range(3):  # every server takes every place once in three repeats
        assert sorted(order[place] for order in three) == [0, 1, 2]
    assert cs.turn_order(1, 5) == [0]


def test_names_are_short_and_unique() -> None:
    a, b = Target("http://127.0.0.1:8000", server_version="0.2.0"), Target("http://127.0.0.1:8091")
    assert cs.names([a, b]) == ["127.0.0.1:8000", "127.0.0.1:8091"]
    assert cs.names([a, a]) == ["1: 127.0.0.1:8000", "2: 127.0.0.1:8000"]
    assert cs.label("127.0.0.1:8000", a) == "127.0.0.1:8000 (0.2.0)" and cs.label("x", b) == "x"


# -- analysis ----------------------------------------------------------------------------------------
def test_by_length_ratios_rates_and_misses() -> None:
    first, peer = line_points(0, 2.0), line_points(1, 4.0, usage_extra=1)
    peer[0]["error"] = "HTTP 500"  # repeat 0 at 100 tokens fails on the peer: its repeat 1 stands alone
    rows = cs.by_length([first, peer])
    assert [r["target_tokens"] for r in rows] == LENGTHS  # one row per asked length despite usage n vs n+1
    r100 = rows[0]
    assert r100["servers"][0] == pytest.approx({"prompt_tokens": 100, "ttft_ms": 250.0,
                                                "tok_s_by_ttft": 100 / 0.25})
    assert r100["servers"][1]["ttft_ms"] == pytest.approx(50 + 4 * 101 + 1)
    assert r100["ttft_ratio_to_first"] == [pytest.approx((50 + 4 * 101 + 1) / 250)]
    r400 = rows[2]
    assert r400["ttft_ratio_to_first"][0] == pytest.approx((50 + 4 * 401) / (50 + 2 * 400))
    assert r400["servers"][1]["tok_s_by_ttft"] == pytest.approx(401 / ((50 + 4 * 401) / 1e3))
    # A server with no answer at a length: NaN there, the others kept.
    rows = cs.by_length([first, [p for p in peer if p["target_tokens"] != 200]])
    assert math.isnan(rows[1]["ttft_ratio_to_first"][0]) and rows[1]["servers"][0]["ttft_ms"] == 450.0
    # Repeat by repeat, the failed request has no pair.
    assert cs.paired_ratios([first, peer], 1, 100) == [pytest.approx((50 + 4 * 101 + 1) / 251)]
    assert len(cs.paired_ratios([first, peer], 1, 400)) == 2


def test_per_server_fits_recover_the_lines() -> None:
    points = line_points(0, 2.0) + line_points(1, 4.0, usage_extra=1)
    per = [cs.analyse_server(cs.server_points(points, i), 1024) for i in (0, 1)]
    assert per[0]["fit"]["prefill_tok_s_from_ttft"] == pytest.approx(500)
    assert per[1]["fit"]["prefill_tok_s_from_ttft"] == pytest.approx(250)
    assert per[1]["fit"]["prefill_tok_s_from_server"] == pytest.approx(250)
    assert [m["prompt_tokens"] for m in per[1]["medians"]] == [101, 201, 401]
    # A point without ``server`` (the one-server format) is the first server's.
    assert cs.server_points(line_points(None, 2.0), 0) == line_points(None, 2.0)


def sweep_doc(servers: list[Target], points: list[dict[str, Any]]) -> dict[str, Any]:
    return {"command": "python -m bench sweep", "started": "then", "repeats": 2, "config": {"url": "x"},
            "machine": {"cpus": 2, "cpu": "test", "mem_gib": 1.0, "load_avg_start": [0.0], "load_avg_end": [0.0]},
            "versions": {"python": "3", "lifecycle-serve (bench) git": "abc"},
            "servers": [t.describe() for t in servers],
            "results": {"lengths": LENGTHS, "points": points, "params": 134_515_008,
                        "estimate": {"1": {"flops": 1e11, "prefill_tok_s": 1e11 / (2 * 134_515_008)}}}}


def reanalyse(doc: dict[str, Any], tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any], str]:
    src = tmp_path / "in.json"
    src.write_text(json.dumps(doc))
    a = argparse.Namespace(from_json=str(src), linear_max=1024, out=str(tmp_path / "out"), repeats=0)
    res = cs.reanalyse(a, report.Run("sweep", a, a.out))
    assert (tmp_path / "out" / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    return res, json.loads((tmp_path / "out" / "sweep.json").read_text()), \
        (tmp_path / "out" / "sweep.md").read_text()


def test_reanalyse_one_server_keeps_the_old_format(tmp_path: Path) -> None:
    res, doc, md = reanalyse(sweep_doc([Target("http://127.0.0.1:8000", "m", server_version="0.2.0")],
                                       line_points(None, 2.0)), tmp_path)
    assert set(res) == {"lengths", "points", "medians", "fit", "estimate", "params"}
    assert res["fit"]["prefill_tok_s_from_ttft"] == pytest.approx(500)
    assert set(doc["spread"]) == {"ttft_ms@100", "ttft_ms@200", "ttft_ms@400"}
    assert "| prompt tokens (usage) | TTFT (ms) |" in md and "/ 127.0.0.1" not in md
    assert "\n| straight line fitted to client TTFT, prompts ≤ 400 tokens | 500.0 |" in md


def test_reanalyse_two_servers_side_by_side(tmp_path: Path) -> None:
    targets = [Target("http://127.0.0.1:8000", "m", server_version="0.2.0"),
               Target("http://127.0.0.1:8091", "m", server_version="b1-0c1e570")]
    res, doc, md = reanalyse(sweep_doc(targets, line_points(0, 2.0) + line_points(1, 4.0)), tmp_path)
    assert [s["url"] for s in res["per_server"]] == [t.url for t in targets]
    assert [s["fit"]["prefill_tok_s_from_ttft"] for s in res["per_server"]] == [pytest.approx(500),
                                                                               pytest.approx(250)]
    assert [r["ttft_ratio_to_first"][0] for r in res["by_length"]] == [
        pytest.approx((50 + 4 * n) / (50 + 2 * n)) for n in LENGTHS]
    assert "| 100 | 250.0 | 450.0 | 1.80 | 400.0 | 222.2 |" in md
    assert "127.0.0.1:8091: straight line fitted to client TTFT, prompts ≤ 400 tokens | 250.0 |" in md
    ratio = doc["spread"]["127.0.0.1:8091 / 127.0.0.1:8000 ttft@100"]
    assert ratio["per_repeat"] == [pytest.approx(449 / 249), pytest.approx(451 / 251)]
    assert len(doc["servers"]) == 2


# -- the measuring loop ------------------------------------------------------------------------------
def test_measure_interleaves_the_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []

    async def point(_c: Any, target: Target, n: int, _max_tokens: int) -> dict[str, Any]:
        calls.append((target.url, n))
        return {"target_tokens": n, "prompt_tokens": n, "ttft_ms": 1.0, "error": None}

    async def warm_up(*_: Any, **__: Any) -> StreamRecord:
        return StreamRecord()

    monkeypatch.setattr(cs, "measure_point", point)
    monkeypatch.setattr(cs, "stream_chat", warm_up)
    a = argparse.Namespace(repeats=2, no_progress=True, max_tokens=2)
    targets = [Target("http://a"), Target("http://b")]
    points = asyncio.run(cs.measure(a, targets, [100, 200]))
    assert calls == [("http://a", 100), ("http://b", 100), ("http://a", 200), ("http://b", 200),
                     ("http://b", 100), ("http://a", 100), ("http://b", 200), ("http://a", 200)]
    assert [(p["repeat"], p["server"]) for p in points] == [(0, 0), (0, 1), (0, 0), (0, 1),
                                                            (1, 1), (1, 0), (1, 1), (1, 0)]
    calls.clear()
    one = asyncio.run(cs.measure(a, targets[:1], [100]))
    assert "server" not in one[0] and len(one) == 2


# -- llama.cpp's /tokenize ---------------------------------------------------------------------------
def llama_cpp_handler(request: httpx.Request) -> httpx.Response:
    """llama-server's answers: our ``/tokenize`` dialect yields an empty list; ``/apply-template`` renders
    the chat; ``/tokenize {content}`` gives a token per word, plus one with ``add_special``."""
    body = json.loads(request.content or b"{}")
    if request.url.path == "/apply-template":
        text = "".join(f"<|im_start|> {m['role']} {m['content']} <|im_end|> " for m in body["messages"])
        return httpx.Response(200, json={"prompt": text + "<|im_start|> assistant"})
    if request.url.path == "/tokenize":
        words = body.get("content", "").split()
        return httpx.Response(200, json={"tokens": list(range(len(words) + bool(body.get("add_special"))))})
    return httpx.Response(404, json={"error": "File Not Found"})


def test_llama_cpp_tokenize_gives_exact_prompts() -> None:
    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(llama_cpp_handler), base_url="http://t") as c:
            t = Target("http://t", "m")
            assert await _tokenize_api(c, t) == "llama.cpp"
            t.tokenize_api, t.has_tokenize = "llama.cpp", True
            text, got = await exact_prompt(c, t, 150)
            assert got == 150
            assert await count_chat_tokens(c, t, [{"role": "user", "content": text}]) == 150

        async def bare(_: httpx.Request) -> httpx.Response:
            return httpx.Response(404)

        async with httpx.AsyncClient(transport=httpx.MockTransport(bare), base_url="http://t") as c:
            assert await _tokenize_api(c, Target("http://t", "m")) is None

    asyncio.run(go())
