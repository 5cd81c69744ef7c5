"""``python -m bench`` without our app: the help of every subcommand, the scripts that still start,
the Prometheus parser and the spread/percentile maths, and the fallbacks against a bare
OpenAI-compatible server (no /tokenize, /metrics or server_timing). The subcommands against the
real app are in ``tests/app/test_bench_cli.py``.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bench import prom, report
from tests.bench_harness import ROOT, run_bench


# -- no app needed -----------------------------------------------------------------------------------
def test_help_lists_every_subcommand() -> None:
    out = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for name in ("client", "sweep", "load", "cancel", "proxy", "compare", "multiturn", "docs"):
        assert name in out.stdout
        sub = subprocess.run([sys.executable, "-m", "bench", name, "--help"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert sub.returncode == 0 and "--url" in sub.stdout


@pytest.mark.parametrize("script", ["bench/bench_graph.py", "bench/experiments/bench_observability.py"])
def test_existing_scripts_still_start(script: str) -> None:
    out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_prometheus_parse_and_aliases() -> None:
    text = ('# TYPE lifecycle:num_requests_running gauge\n'
            'lifecycle:num_requests_running{model_name="m"} 3.0\n'
            'lifecycle:kv_cache_usage_perc{model_name="m"} 0.25\n'
            'llamacpp:tokens_predicted_total 7\n')
    m = prom.parse(text)
    assert prom.pick(m, "num_requests_running") == 3.0
    assert prom.pick(m, "kv_cache_usage_perc") == 0.25
    assert prom.pick(m, "generation_tokens") == 7.0
    assert prom.pick(m, "tokens_after_client_gone") is None


def test_spread_and_percentiles() -> None:
    s = report.spread([10.0, 12.0, 11.0])
    assert s["median"] == 11.0 and s["min"] == 10.0 and s["max"] == 12.0
    assert s["spread_pct"] == pytest.approx(100 * 2 / 11)
    assert report.pct([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert math.isnan(report.pct([], 50))


# -- a bare OpenAI-compatible server: no /tokenize, /metrics or server_timing -----------------------
@pytest.fixture(scope="module")
def bare_server() -> Any:
    """A minimal OpenAI-compatible server (fake tokens, one per event) with none of our extras."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "bare", "object": "model"}]})

    async def chat(request: Request) -> Any:
        body = await request.json()
        n = int(body.get("max_tokens") or 4)
        if not body.get("stream"):
            return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * n},
                                              "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})

        async def events() -> Any:
            for i in range(n):
                await asyncio.sleep(0.005)
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": f"t{i} "},
                                                          "finish_reason": None}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n,
                                                                  "total_tokens": 5 + n}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])
    from tests.serve_harness import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(10)


def test_client_against_a_bare_server_falls_back(bare_server: str, tmp_path: Path) -> None:
    doc = run_bench(["client", "--url", bare_server, "--concurrency", "2", "--requests", "2", "--max-tokens", "6",
                     "--repeats", "1"], tmp_path)
    assert doc["servers"][0]["has_tokenize"] is False and doc["servers"][0]["has_metrics"] is False
    assert any("no /tokenize" in n for n in doc["notes"])
    pooled = doc["results"]["pooled"]
    assert pooled["completion_tokens_total"] == 12 and pooled["tokens_per_event"] == 1.0


def test_load_and_cancel_against_a_bare_server_say_what_they_skip(bare_server: str, tmp_path: Path) -> None:
    doc = run_bench(["load", "--url", bare_server, "--levels", "1,2", "--max-tokens", "4", "--repeats", "1"],
                    tmp_path)
    assert any("not split into queue and prefill" in n for n in doc["notes"])
    assert doc["results"]["levels"][1]["output_tok_s"] > 0
    doc = run_bench(["cancel", "--url", bare_server, "--streams", "2", "--drop", "1", "--drop-after", "0.1",
                     "--observe", "0.2", "--max-tokens", "400", "--repeats", "1"], tmp_path)
    assert any("no /metrics" in n for n in doc["notes"])


def test_multiturn_and_docs_against_a_bare_server_read_no_cache_hits(bare_server: str,
                                                                                 tmp_path: Path) -> None:
    doc = run_bench(["multiturn", "--url", bare_server, "--conversations", "2", "--turns", "2", "--user-tokens", "20",
                     "--max-tokens", "3", "--repeats", "1", "--label", "bare"], tmp_path)
    assert any("cached_tokens" in n for n in doc["notes"])
    res = doc["results"]
    assert res["label"] == "bare" and len(res["requests"]) == 4
    assert all(r["cached_tokens"] == 0 for r in res["requests"])
    assert res["per_round"][0]["hit_rate"] == 0 and res["per_round"][0]["output_tok_s"] > 0
    assert "Configuration: **bare**" in (tmp_path / "multiturn.md").read_text()
    doc = run_bench(["docs", "--url", bare_server, "--documents", "2", "--questions", "2", "--doc-tokens", "30",
                     "--max-tokens", "3", "--repeats", "2"], tmp_path)
    assert [(r["document"], r["question"]) for r in doc["results"]["requests"][:4]] == [(0, 0), (1, 0), (0, 1), (1, 1)]
