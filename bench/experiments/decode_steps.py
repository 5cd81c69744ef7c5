#!/usr/bin/env python
"""Decode step time in-process, at the default engine config (the embedded model, quantised).

Drives :class:`stages.engine.core.engine.LLMEngine` alone (no Ray, no HTTP): ``B`` greedy requests
are added, prefilled, and then every timed ``step()`` is a pure decode step of ``B`` rows. Reports
the median step time for each (streams, threads) pair, alternating the pairs within each repeat so
background load hits them alike, and the share of a step spent outside the model's forward pass.

    .venv/bin/python bench/experiments/decode_steps.py             # 1 and 8 streams, 1 and 2 threads
    .venv/bin/python bench/experiments/decode_steps.py --streams 1,8,32 --threads 1,2 --steps 64
    .venv/bin/python bench/experiments/decode_steps.py --isa avx2  # the AVX2 kernels on an AVX-512 CPU
    .venv/bin/python bench/experiments/decode_steps.py --config "{'quant_kernel': 'torch'}"
"""

from __future__ import annotations

import argparse
import ast
import json
import os
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


def run(engine: LLMEngine, streams: int, threads: int, steps: int, tag: str) -> tuple[float, float]:
    """Median decode step and median forward pass (seconds) of ``streams`` rows on ``threads``."""
    runner = engine.runner
    runner.step_threads = threads
    torch.set_num_threads(threads)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        # Distinct prompts (no prefix sharing beyond the first tokens), ~40 tokens each.
        engine.add_request(f"{tag}-{i}", [1 + (7 * i + j) % 4000 for j in range(40)], params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    forward = runner.model.forward
    spans: list[float] = []

    def timed(*a, **k):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = forward(*a, **k)
        spans.append(time.perf_counter() - t0)
        return out

    runner.model.forward = timed  # type: ignore[method-assign]
    step_times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t0)
    finally:
        runner.model.forward = forward  # type: ignore[method-assign]
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()
    return statistics.median(step_times), statistics.median(spans)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="1,8")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--isa", default="auto", help="engine.cpu_isa: auto | avx512 | avx2 | generic")
    p.add_argument("--config", default="{}", help="other engine settings, a Python dict literal")
    p.add_argument("--json", default="", help="also write the results here")
    a = p.parse_args()
    streams = [int(s) for s in a.streams.split(",")]
    threads = [int(t) for t in a.threads.split(",")]
    engine = LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(**{"num_threads": 1, "cpu_isa": a.isa,
                                                                          **ast.literal_eval(a.config)}))
    kernel = engine.runner.block_kernel
    isa = kernel.isa_name if kernel is not None else "torch"
    print(f"load average {os.getloadavg()[0]:.2f}; matmul kernel {isa}", flush=True)
    results: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for rep in range(a.repeats + 1):  # the first round warms up
        for s in streams:
            for t in threads:
                step, fwd = run(engine, s, t, a.steps, f"r{rep}-{s}-{t}")
                if rep:
                    results.setdefault((s, t), []).append((step, fwd))
    rows = []
    print("| streams | threads | step ms (median) | forward ms | outside forward |")
    print("|---|---|---|---|---|")
    for (s, t), runs in sorted(results.items()):
        step = statistics.median(r[0] for r in runs)
        fwd = statistics.median(r[1] for r in runs)
        rows.append({"streams": s, "threads": t, "step_ms": step * 1e3, "forward_ms": fwd * 1e3})
        print(f"| {s} | {t} | {step * 1e3:.2f} | {fwd * 1e3:.2f} | {(step - fwd) * 1e3:.2f} |")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"isa": isa, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
