#!/usr/bin/env python
"""Decode step time by attention path and by whether the step replays a CUDA graph.

For each variant (``attention`` x ``decode_graphs``) one engine is built, and for each batch size
B that many greedy requests (32-token prompts) decode together; the figure is the median wall
time of the steps that were decodes only, measured alternately across variants (round-robin per
batch size, so a noisy machine hits every variant alike).

    .venv/bin/python bench/bench_decode_graphs.py --device cuda            # sdpa, flex, flex + graphs
    .venv/bin/python bench/bench_decode_graphs.py --device cpu --quick     # here: paged_kernel, flex, static

On CPU ``static`` runs the graphs' padded static-buffer step eagerly (no capture exists on CPU):
it shows what padding costs, not what a graph saves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stages.config import EngineSettings  # noqa: E402
from stages.engine.core.engine import LLMEngine  # noqa: E402
from stages.model_info import EMBEDDED_MODEL  # noqa: E402
from stages.transport.messages import SamplingParams  # noqa: E402


def variants(device: str) -> dict[str, dict[str, str]]:
    if device == "cuda":
        return {"sdpa": {"attention": "sdpa", "decode_graphs": "off"},
                "flex": {"attention": "flex", "decode_graphs": "off"},
                "flex+cuda_graphs": {"attention": "flex", "decode_graphs": "cuda"}}
    return {"paged_kernel": {"attention": "paged_kernel", "decode_graphs": "off"},
            "flex": {"attention": "flex", "decode_graphs": "off"},
            "flex+static": {"attention": "flex", "decode_graphs": "static"}}


def decode_steps(engine: LLMEngine, batch: int, tokens: int) -> list[float]:
    """Wall seconds of each decode-only step while ``batch`` requests generate ``tokens`` each."""
    sync = _sync(engine)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", [100 + (i * 7 + j) % 5000 for j in range(32)],
                           SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        decoding = not engine.scheduler.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens
                                                          for r in engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        sync()
        if decoding:
            times.append(time.perf_counter() - t0)
    return times


def _sync(engine: LLMEngine) -> Any:
    if engine.runner.device.type == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="16 tokens, one round")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.quick:
        a.tokens, a.rounds = 16, 1
    batches = [int(b) for b in a.batches.split(",")]
    engines, load_s = {}, {}
    for name, kw in variants(a.device).items():
        t0 = time.perf_counter()
        engines[name] = LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(
            device=a.device, weights="float32" if a.device == "cpu" else "auto",
            num_threads=a.threads, max_num_seqs=max(batches), **kw))
        load_s[name] = time.perf_counter() - t0  # with flex: its compile; with graphs: every capture
        decode_steps(engines[name], max(batches), 4)  # warm-up: compiles for the batch shapes
    steps: dict[str, dict[int, list[float]]] = {n: {b: [] for b in batches} for n in engines}
    for _ in range(a.rounds):
        for b in batches:
            for name, engine in engines.items():
                steps[name][b] += decode_steps(engine, b, a.tokens)
    table = {name: {b: statistics.median(v) * 1e3 for b, v in per.items()} for name, per in steps.items()}
    first = next(iter(table))
    print(f"decode step, median ms ({a.device}, {a.tokens} tokens x {a.rounds} rounds)")
    print("| variant | load + compile/capture s | " + " | ".join(f"B={b}" for b in batches) + " |")
    print("|---|---|" + "---|" * len(batches))
    for name, row in table.items():
        cells = [f"{row[b]:.2f} ({table[first][b] / row[b]:.2f}x)" for b in batches]
        print(f"| {name} | {load_s[name]:.1f} | " + " | ".join(cells) + " |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "load_s": load_s, "median_step_ms": table,
                                           "replays": {n: dict(e.runner.graphs.replays) for n, e in engines.items()
                                                       if e.runner.graphs is not None}}, indent=1))


if __name__ == "__main__":
    main()
