#!/usr/bin/env python
"""Prefill time in-process by prompt length, split into attention, matmuls and the rest.

Drives :class:`stages.engine.core.engine.LLMEngine` alone (no Ray, no HTTP) at the default
engine config (the embedded model, quantised, ``prefill_threads`` threads): one request of ``L``
random prompt tokens at a time, nothing cached, stepped until its first token. Reports the median
time to the first token and prefill tokens/s per length, and (one extra run per length, under a
wrapper that times them) the seconds in attention and in the linear layers.

    .venv/bin/python bench/experiments/prefill_steps.py --lengths 512,2048,8192
    .venv/bin/python bench/experiments/prefill_steps.py --config "{'prefill_kernel_max_len': 0}"
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from stages.config import EngineSettings  # noqa: E402
from stages.engine.core.engine import LLMEngine  # noqa: E402
from stages.model_info import EMBEDDED_MODEL  # noqa: E402
from stages.transport.messages import SamplingParams  # noqa: E402


def prefill(engine: LLMEngine, length: int, tag: str) -> float:
    """Seconds from adding one ``length``-token request to its first token."""
    rng = random.Random(tag)
    ids = [rng.randrange(1, 40000) for _ in range(length)]
    engine.add_request(tag, ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    while tag in engine.requests:
        engine.step()
    return time.perf_counter() - t0


def parts(engine: LLMEngine, length: int, tag: str) -> dict[str, float]:
    """Seconds in attention (all of ``Attention.forward`` but its two linears) and in linears."""
    from stages.engine.runner.models import llama

    spent = {"attention": 0.0, "linear": 0.0, "attn_linear": 0.0}
    model = engine.runner.model
    wrapped = []

    def timing(fn, key):  # type: ignore[no-untyped-def]
        def run(*a, **k):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[key] += time.perf_counter() - t0
            return out
        return run

    for layer in model.layers:
        for mod, key in ((layer.self_attn.qkv_proj, "attn_linear"), (layer.self_attn.o_proj, "attn_linear"),
                         (layer.mlp.gate_up_proj, "linear"), (layer.mlp.down_proj, "linear")):
            wrapped.append((mod, mod.forward))
            mod.forward = timing(mod.forward, key)
    attn_forward = llama.Attention.forward
    llama.Attention.forward = timing(attn_forward, "attention")
    try:
        total = prefill(engine, length, tag)
    finally:
        llama.Attention.forward = attn_forward
        for mod, fwd in wrapped:
            mod.forward = fwd
    # The qkv and o projections run inside Attention.forward: count them as linears only.
    return {"total": total, "linear": spent["linear"] + spent["attn_linear"],
            "attention": spent["attention"] - spent["attn_linear"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="256,1024,2048,4096,8000")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--config", default="{}", help="other engine settings, a Python dict literal")
    p.add_argument("--json", default="", help="also write the results here")
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    settings = {"num_threads": 1, "prefill_threads": a.threads, "max_model_len": max(lengths) + 64,
                **ast.literal_eval(a.config)}
    engine = LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(**settings))
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.2f}; settings {settings}", flush=True)
    prefill(engine, 300, "warm")
    rows = []
    print("| prompt tokens | TTFT s (median) | prefill tok/s | attention s | linears s | other s |")
    print("|---|---|---|---|---|---|")
    for length in lengths:
        times = [prefill(engine, length, f"{length}-{r}") for r in range(a.repeats)]
        split = parts(engine, length, f"{length}-parts")
        ttft = statistics.median(times)
        other = split["total"] - split["attention"] - split["linear"]
        row = {"tokens": length, "ttft_s": ttft, "tok_s": length / ttft, **split}
        rows.append(row)
        print(f"| {length} | {ttft:.3f} | {length / ttft:.0f} | {split['attention']:.3f} | "
              f"{split['linear']:.3f} | {other:.3f} |", flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
