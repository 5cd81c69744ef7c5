#!/usr/bin/env python
"""Ops and Python time of one batch-1 decode step (issue 11's "fewer ops per step" figures).

Runs one request to a ~64-token context, then profiles ``--steps`` decode steps with the torch
profiler and prints, per step: the number of aten ops called from Python (top-level, i.e. not
counting the ops a composite op calls internally) and all aten ops; the step's wall time (measured
without the profiler, median over ``--timed`` steps); and the time inside the heavy kernels (GEMMs,
int4/int8 matmuls, attention). Wall minus kernels is the per-step Python and small-op overhead.

    .venv/bin/python bench/experiments/profile_step.py --weights float32,int4 --threads 1
    # the code before a change, from an export of that commit:
    git archive <rev> | tar -x -C /tmp/rev && cd /tmp/rev && /work/main/.venv/bin/python bench/experiments/profile_step.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from stages.config import EngineSettings  # noqa: E402
from stages.engine.core.engine import LLMEngine  # noqa: E402
from stages.model_info import EMBEDDED_MODEL, load_tokenizer  # noqa: E402
from stages.transport.messages import SamplingParams  # noqa: E402

HEAVY_LEAVES = ("aten::mm", "aten::addmm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",
                "aten::_scaled_dot_product_flash_attention_for_cpu")


def build(weights: str) -> LLMEngine:
    kwargs = {} if weights == "default" else {"weights": weights}
    return LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(device="cpu", num_kv_blocks=256, **kwargs))


def measure(eng: LLMEngine, prompt: list[int], steps: int, timed: int) -> dict[str, float]:
    eng.add_request("p", prompt, SamplingParams(max_tokens=64 + steps + timed, temperature=0.0, ignore_eos=True))
    for _ in range(64 - len(prompt)):
        eng.step()
    walls = []
    for _ in range(timed):
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    # An op is top-level when no other aten op's interval encloses it (one thread: the step's).
    top = 0
    stack: list[float] = []
    for e in sorted(events, key=lambda e: (e.time_range.start, -e.time_range.end)):
        while stack and stack[-1] <= e.time_range.start:
            stack.pop()
        top += not stack
        stack.append(e.time_range.end)
    # The heavy kernels themselves (under linear/matmul wrappers where there are any).
    kernel_us = sum(e.time_range.end - e.time_range.start for e in events if e.name in HEAVY_LEAVES)
    wall = statistics.median(walls)
    eng.abort("p")
    eng.step()
    return {"top_level_ops": top / steps, "all_aten_ops": len(events) / steps, "wall_ms": wall * 1e3,
            "kernel_ms": kernel_us / steps / 1e3, "overhead_ms": wall * 1e3 - kernel_us / steps / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="float32,int4", help="formats ('default': the config default)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="profiled steps")
    ap.add_argument("--timed", type=int, default=30, help="steps timed without the profiler")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians reported")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    prompt = load_tokenizer(EMBEDDED_MODEL)("The history of computing is a story of layers.")["input_ids"]
    engines = {w: build(w) for w in a.weights.split(",")}
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in engines}
    for _ in range(a.rounds):
        for w, eng in engines.items():
            runs[w].append(measure(eng, prompt, a.steps, a.timed))
    for w, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{w}: {med['top_level_ops']:.0f} top-level aten ops/step ({med['all_aten_ops']:.0f} incl. nested); "
              f"step {med['wall_ms']:.2f} ms = kernels {med['kernel_ms']:.2f} ms + overhead "
              f"{med['overhead_ms']:.2f} ms (medians of {a.rounds} rounds, {torch.get_num_threads()} thread(s))")


if __name__ == "__main__":
    main()
