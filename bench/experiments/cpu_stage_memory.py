"""Resident memory of the CPU-stage replicas after heavy requests, not only when fresh.

    make serve   # or any `serve run serve_config.yaml`
    .venv/bin/python bench/experiments/cpu_stage_memory.py --url http://127.0.0.1:8000 --out bench/results/mem.json

Against a running app, finds each Ingress, Preprocess and Egress replica's process (by its title
``ray::ServeReplica:<app>:<deployment>``) and reads its RSS and USS: fresh, after one 1 MB prompt
(a completion whose prompt is 1 MiB of text: parsed by the Ingress, templated and tokenised by
Preprocess, then refused for its length), after 100 structured-output requests with distinct JSON
schemas (100 grammar compiles in Preprocess), and again after ``--settle`` seconds idle. Issue 33's
goal: every CPU-stage replica at most 200 MB after all of it.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

STAGES = ("Ingress", "Preprocess", "Egress")


def replicas(app: str) -> dict[str, list[int]]:
    """PIDs of the app's CPU-stage replicas, by deployment."""
    found: dict[str, list[int]] = {s: [] for s in STAGES}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        for stage in STAGES:
            if f"ServeReplica:{app}:{stage}" in title:
                found[stage].append(int(proc.info["pid"]))
    return found


def memory(pids: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    out = {}
    for stage, ids in pids.items():
        for i, pid in enumerate(ids):
            full = psutil.Process(pid).memory_full_info()
            out[f"{stage}#{i}"] = {"rss_mb": round(full.rss / 2**20, 1), "uss_mb": round(full.uss / 2**20, 1)}
    return out


def huge_prompt(url: str, model: str, size: int) -> int:
    words = [w for w in "the river carries stone and amber past the old mill at dusk".split()]
    rng = random.Random(0)
    text = " ".join(rng.choice(words) for _ in range(size // 4))[:size]
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": text, "max_tokens": 1}, timeout=300)
    return r.status_code


def schema(i: int) -> dict[str, Any]:
    rng = random.Random(i)
    props = {"".join(rng.choices(string.ascii_lowercase, k=8)): {"type": rng.choice(["string", "integer", "boolean"])}
             for _ in range(6)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def compiles(url: str, model: str, count: int) -> list[int]:
    codes = []
    with httpx.Client(timeout=120) as client:
        for i in range(count):
            body = {"model": model, "messages": [{"role": "user", "content": f"Fill in record {i}."}],
                    "max_tokens": 1, "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": f"r{i}", "schema": schema(i)}}}
            codes.append(client.post(url + "/v1/chat/completions", json=body).status_code)
    return codes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--app", default="lifecycle")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--prompt-bytes", type=int, default=2**20)
    p.add_argument("--compiles", type=int, default=100)
    p.add_argument("--settle", type=float, default=10.0)
    p.add_argument("--out", default="")
    a = p.parse_args()
    pids = replicas(a.app)
    report: dict[str, Any] = {"fresh": memory(pids)}
    report["huge_prompt_status"] = huge_prompt(a.url, a.model, a.prompt_bytes)
    report["after_huge_prompt"] = memory(pids)
    codes = compiles(a.url, a.model, a.compiles)
    report["compile_statuses"] = {str(c): codes.count(c) for c in sorted(set(codes))}
    report["after_compiles"] = memory(pids)
    time.sleep(a.settle)
    report["settled"] = memory(pids)
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
