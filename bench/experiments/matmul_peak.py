#!/usr/bin/env python
"""The cores' matmul peaks (float32, bfloat16, int8) and what the prompt's linear layers reach.

Peaks are torch's best GEMM throughput on large square problems (oneDNN picks AMX, AVX512-BF16/VNNI
or AVX2 for the CPU at hand), best of a one-second loop each, with ``--threads`` threads, and the
instruction set's own int8 multiply-accumulate peak with operands in registers (``int8_peak.cpp``:
on a CPU without VNNI or AMX torch's int8 GEMM falls back to reference loops, so its figure says
nothing about the cores). Then one
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


def isa_int8_peak(threads: int) -> tuple[float, str]:
    """GOP/s of the widest int8 dot-product instruction this CPU has, on ``threads`` threads, and
    that instruction's name (``int8_peak.cpp``, built with the engine's kernel builder)."""
    import ctypes

    from stages.engine.runner import kernels

    lib = ctypes.CDLL(str(kernels.build([Path(__file__).with_name("int8_peak.cpp")])))
    lib.lifecycle_int8_peak.argtypes = [ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p]
    lib.lifecycle_int8_peak.restype = ctypes.c_int64
    lib.lifecycle_int8_peak_isa.restype = ctypes.c_char_p
    isa = lib.lifecycle_int8_peak_isa().decode()
    sink = (ctypes.c_int32 * max(threads, 1))()
    iters = 20_000_000
    ops = lib.lifecycle_int8_peak(iters, threads, sink)
    if ops == 0:
        return 0.0, isa
    return ops / best(lambda: lib.lifecycle_int8_peak(iters, threads, sink)) / 1e9, isa


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
    isa_peak, isa = isa_int8_peak(a.threads)
    if isa_peak:
        peak[f"int8 instruction ({isa}, registers only)"] = isa_peak
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
