"""``python -m bench`` against the real app: every subcommand briefly (small sizes), its result files
and measured fields, and the nginx proxy check. The fallbacks against a bare OpenAI-compatible
server and the parts that need no server are in ``tests/unit/bench/test_cli.py``.

Each subcommand runs as a subprocess, as a user runs it. ``compare`` skips without a built
``llama-server`` (``make peer``); the nginx test skips without nginx (``make test`` installs it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from bench.nginx import nginx_binary
from bench.peer import DEFAULT_BINARY
from tests.bench_harness import finite, run_bench


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
