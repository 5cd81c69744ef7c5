#!/usr/bin/env python
"""The cores' matmul peaks (float32, bfloat16, int8) and what the prompt's linear layers reach.

Peaks are torch's best GEMM throughput on large square problems (oneDNN picks AMX, AVX512-BF16/VNNI
or AVX2 for the CPU at hand), best of a one-second loop each, with ``--threads`` threads. Then one
prompt chunk of ``--rows`` rows goes through the embedded model's quantised linear layers as a
prefill step runs them (``QuantLinear`` with its dense copies or the block kernel, whichever the
load-time calibration chose for that size), and its throughput is quoted as a fraction of each peak.

    .venv/bin/python bench/experiments/matmul_peak.py --threads 2 --rows 512
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def best(fn, seconds: float = 1.0) -> float:  # type: ignore[no-untyped-def]
    fn()
    out, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def peaks(size: int) -> dict[str, float]:
    """GOP/s of an ``size``³ GEMM in float32, bfloat16 and int8 (int32 accumulation)."""
    ops = 2 * size ** 3
    a, b = torch.randn(size, size), torch.randn(size, size)
    a8 = torch.randint(-127, 127, (size, size), dtype=torch.int8)
    b8 = torch.randint(-127, 127, (size, size), dtype=torch.int8)
    ab, bb = a.bfloat16(), b.bfloat16()
    return {"float32": ops / best(lambda: a @ b) / 1e9,
            "bfloat16": ops / best(lambda: ab @ bb) / 1e9,
            "int8": ops / best(lambda: torch._int_mm(a8, b8)) / 1e9}


def model_linears(rows: int) -> tuple[float, str]:
    """GOP/s of one ``rows``-row chunk through every decoder linear layer of the embedded model."""
    from stages.config import EngineSettings
    from stages.engine.core.engine import LLMEngine
    from stages.model_info import EMBEDDED_MODEL

    engine = LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(num_threads=torch.get_num_threads()))
    mods = [m for layer in engine.runner.model.layers
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    xs = [torch.randn(rows, m.in_features) for m in mods]
    ops = sum(2 * rows * m.in_features * m.out_features for m in mods)

    def chunk() -> None:
        for m, x in zip(mods, xs, strict=True):
            m(x)

    with torch.inference_mode():
        took = best(chunk, 2.0)
    path = f"dense {mods[0].dense_dtype} GEMM" if rows >= mods[0].dense_min_rows else "block kernel"
    return ops / took / 1e9, path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--json", default="")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"load average {os.getloadavg()[0]:.2f}; {a.threads} threads", flush=True)
    peak = peaks(a.size)
    linear, path = model_linears(a.rows)
    print(f"| GEMM {a.size}³ | GOP/s |\n|---|---|")
    for k, v in peak.items():
        print(f"| {k} | {v:,.0f} |")
    print(f"\nprompt chunk of {a.rows} rows through the model's linears ({path}): {linear:,.0f} GOP/s = "
          + ", ".join(f"{linear / v:.2f} of the {k} peak" for k, v in peak.items()))
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"peaks": peak, "linears": linear, "path": path, "rows": a.rows}, indent=1))


if __name__ == "__main__":
    main()
