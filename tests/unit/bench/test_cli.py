"""``python -m bench``: every subcommand briefly against the real app (small sizes), its result files
and measured fields; the nginx proxy check; the fallbacks against a bare OpenAI-compatible server.

Each subcommand runs as a subprocess, as a user runs it. ``compare`` skips without a built
``llama-server`` (``make peer``); the nginx tests skip without nginx (``make test`` installs it).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bench import prom, report
from bench.nginx import nginx_binary
from bench.peer import DEFAULT_BINARY

ROOT = Path(__file__).resolve().parents[3]


def run_bench(args: list[str], out: Path, timeout: float = 300) -> dict[str, Any]:
    """Run ``python -m bench ARGS --out OUT``; return its JSON result after checking all three files."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "bench", *args, "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = args[0]
    for ext in ("json", "md", "png"):
        path = out / f"{name}.{ext}"
        assert path.is_file() and path.stat().st_size > 0, f"{path} missing"
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / f"{name}.json").read_text())
    # Provenance every result file carries.
    assert doc["machine"]["cpus"] >= 1 and doc["machine"]["cpu"]
    assert doc["versions"]["python"] and doc["versions"]["httpx"]
    assert doc["config"]["url"] and doc["repeats"] >= 1
    assert doc["spread"] and all("per_repeat" in s and "spread_pct" in s for s in doc["spread"].values())
    assert doc["servers"][0]["model"]
    md = (out / f"{name}.md").read_text()
    assert md.startswith(f"# `{name}`") and "|---|" in md and "python -m bench " + name in md
    return doc


def finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


# -- no app needed -----------------------------------------------------------------------------------
def test_help_lists_every_subcommand() -> None:
    out = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for name in ("client", "sweep", "load", "cancel", "proxy", "compare"):
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


# -- the real app ------------------------------------------------------------------------------------
def test_client(serve_app: Any, tmp_path: Path) -> None:
    doc = run_bench(["client", "--url", serve_app.url, "--concurrency", "2", "--requests", "2",
                     "--prompt-tokens", "40", "--max-tokens", "8", "--repeats", "2"], tmp_path)
    r = doc["results"]
    assert len(r["per_repeat"]) == 2
    p = r["pooled"]
    assert p["errors"] == 0 and p["completion_tokens_total"] == 2 * 2 * 8  # from usage
    assert p["prompt_tokens_usage"] == 40  # exact, via /tokenize
    for k in ("ttft_p50_ms", "ttft_p95_ms", "gap_p50_ms", "gap_p95_ms", "tpot_p50_ms", "e2e_p50_s", "output_tok_s",
              "tokens_per_event"):
        assert finite(p[k]) and p[k] > 0, k
    assert doc["spread"]["ttft_p50_ms"]["per_repeat"] and doc["servers"][0]["has_server_timing"]


def test_sweep(serve_app: Any, tmp_path: Path) -> None:
    doc = run_bench(["sweep", "--url", serve_app.url, "--lengths", "100,300", "--repeats", "1",
                     "--flops-threads", "1"], tmp_path)
    r = doc["results"]
    assert [m["prompt_tokens"] for m in r["medians"]] == [100, 300]  # exact counts
    assert all(p["tokenize_count"] == p["prompt_tokens"] for p in r["points"])
    assert all(finite(m["ttft_ms"]) and finite(m["prefill_ms"]) for m in r["medians"])
    assert r["fit"]["prefill_tok_s_from_ttft"] > 0 and r["fit"]["prefill_tok_s_from_server"] > 0
    assert r["params"] > 1e8 and r["estimate"]["1"]["flops"] > 0 and r["estimate"]["1"]["prefill_tok_s"] > 0


def test_load(serve_app: Any, tmp_path: Path) -> None:
    doc = run_bench(["load", "--url", serve_app.url, "--levels", "1,4", "--prompt-tokens", "32", "--max-tokens", "6",
                     "--repeats", "1"], tmp_path)
    levels = doc["results"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 4]
    for lv in levels:
        for k in ("ttft_p50_ms", "queue_p50_ms", "prefill_p50_ms", "prep_p50_ms", "tpot_p50_ms", "output_tok_s"):
            assert finite(lv[k]), k
    assert all(w["ttft_parts_source"] == "server_timing" for w in doc["results"]["waves"])


def test_cancel(serve_app: Any, tmp_path: Path) -> None:
    doc = run_bench(["cancel", "--url", serve_app.url, "--streams", "4", "--drop", "2", "--drop-after", "1.0",
                     "--observe", "2", "--max-tokens", "400", "--prompt-tokens", "32", "--repeats", "1"], tmp_path)
    r = doc["results"]["rounds"][0]
    # All four are in the engine (the engine's numbers reach /metrics through periodic reports).
    assert r["running_at_drop"] == 4, r
    # The dropped requests leave the engine within the observed window, and few tokens go to nobody.
    assert r["running_drop_latency_s"] is not None and r["running_drop_latency_s"] < 2
    assert r["tokens_for_nobody_dropped"] is not None and r["tokens_for_nobody_dropped"] < 2 * 20
    assert r["running_end"] == 0
    assert len(r["samples"]) > 10 and all("t" in s for s in r["samples"])


@pytest.mark.skipif(nginx_binary() is None, reason="nginx not installed (make test installs it)")
def test_proxy_nginx_default_buffering_streams_event_by_event(serve_app: Any, tmp_path: Path) -> None:
    """Through default-buffering nginx the first event of a 64-token stream arrives well before the last,
    and the gaps between events track the direct ones (median within 20%); with gzip on and the
    X-Accel-Buffering header ignored, the stream clumps."""
    doc = run_bench(["proxy", "--url", serve_app.url, "--max-tokens", "64", "--repeats", "2",
                     "--variants", "default,gzip+ignore"], tmp_path)
    paths = doc["results"]["paths"]
    direct, nginx = paths["direct"], paths["nginx (default buffering)"]
    assert direct["tokens"] == nginx["tokens"] == 64
    assert nginx["first_over_last"] < 0.25, nginx  # not delivered in one piece
    ratio = nginx["gap_p50_ms"] / direct["gap_p50_ms"]
    assert 0.8 <= ratio <= 1.2, (ratio, direct, nginx)
    assert nginx["clumped_gap_frac"] < 0.2
    clumped = paths["nginx + gzip ignoring X-Accel-Buffering"]
    assert clumped["clumped_gap_frac"] > 0.5, clumped
    assert doc["results"]["verdict"]["default"]["tracks_direct"] is True


@pytest.mark.skipif(not os.access(DEFAULT_BINARY, os.X_OK), reason=f"no peer binary at {DEFAULT_BINARY} (make peer)")
def test_compare(serve_app: Any, tmp_path: Path) -> None:
    doc = run_bench(["compare", "--url", serve_app.url, "--levels", "1,2", "--max-tokens", "8", "--repeats", "1",
                     "--peer-parallel", "4", "--peer-ctx", "4096"], tmp_path)
    assert doc["servers"][1]["server_version"]
    for lv in doc["results"]["levels"]:
        for k in ("ratio_output_tok_s", "ratio_ttft_p50_ms", "ratio_tpot_p50_ms", "ours_output_tok_s",
                  "peer_output_tok_s"):
            assert finite(lv[k]) and lv[k] > 0, k
    assert all(w["completion_tokens_p50"] == 8 for w in doc["results"]["waves"])  # ignore_eos on both
