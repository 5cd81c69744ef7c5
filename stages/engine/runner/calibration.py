"""Where a dense GEMM on unpacked weights starts to beat the quantised kernel, on this machine.

Measured at engine load (:meth:`LlamaForCausalLM.calibrate_dense_min_rows`), and remembered per
machine in the kernel cache: on a small AVX2 CPU the measurement takes seconds of every start and
restart, and its answer changes only with what it is keyed on (the CPU, the kernel build, torch and
its thread count, the layers' kinds and shapes, the sizes tried).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from stages.engine.runner.quant import QuantLinear, release_scratch

#: Row counts :func:`measure_dense_min_rows` bisects, in ascending order: torch's int4/int8 kernels
#: lose to a dense GEMM within a few dozen rows. The block kernel's dense path also unpacks every
#: layer (a fixed cost per step), so it wins only from a few hundred rows, where a prompt chunk's
#: GEMMs are compute-bound; sizes up to 256 decide (a step has at most 512 rows by default).
CALIBRATION_ROWS = (2, 3, 4, 6, 8, 12, 16, 24, 32)
BLOCK_CALIBRATION_ROWS = (4, 16, 64, 128, 192, 256)


def measure_dense_min_rows(layers: list[QuantLinear], rows: tuple[int, ...] = CALIBRATION_ROWS,
                           repeats: int = 5, budget_s: float = 0.3) -> int | None:
    """The smallest row count in ``rows`` at which the dense GEMMs of ``layers`` (together, as one
    forward pass runs them) are at least as fast as the quantised kernel on this machine, with
    torch's current thread count; None when the quantised kernel wins at every size tried.

    Where the two cross depends on the CPU (bfloat16 dot products or AMX or neither, AVX2 or AVX-512,
    the memory bandwidth) and on the layer shapes. Timing all layers, not one, matters: one layer's
    weights sit in the CPU cache when timed alone, while a real step streams every layer's from
    memory. The dense path gains on the kernel as rows grow, so the sizes are bisected, the largest
    first: where the kernel wins even there (a CPU without fast bfloat16 or float32 GEMMs) one
    comparison decides. Each side is timed ``repeats`` times, fewer where one pass alone exceeds
    ``budget_s``: at a few hundred rows on a small AVX2 CPU a pass of all layers takes a second, and
    the load is on every engine start's path.
    """
    layers = [m for m in layers if m.has_dense]
    if not layers:
        return None

    def cost(fn_name: str, n: int) -> float:
        xs = [torch.randn(n, m.in_features) for m in layers]
        fns = [getattr(m, fn_name) for m in layers]

        def one_pass() -> float:
            t0 = time.perf_counter()
            for fn, x in zip(fns, xs, strict=True):
                fn(x)
            return time.perf_counter() - t0

        first = one_pass()  # warms up (first-call allocation, packing caches), sizes the repeats
        n_rep = min(repeats, max(1, int(budget_s / first)))
        return statistics.median(one_pass() for _ in range(n_rep))

    def dense_wins(n: int) -> bool:
        # Interleaved, so a burst of load on the machine hits both sides alike.
        return cost("dense_matmul", n) <= cost("quant_matmul", n)

    try:
        with torch.inference_mode():
            return first_win(rows, dense_wins)
    finally:
        release_scratch()


def first_win(rows: tuple[int, ...], wins: Callable[[int], bool]) -> int | None:
    """The smallest of the ascending ``rows`` at which ``wins`` holds, for a ``wins`` that, once true,
    stays true at every larger size; None when it fails at the largest. Asks about the largest
    first, then bisects: ``1 + ceil(log2(len(rows)))`` questions at most."""
    if not wins(rows[-1]):
        return None
    lo, hi = 0, len(rows) - 1  # rows[hi] wins
    while lo < hi:
        mid = (lo + hi) // 2
        if wins(rows[mid]):
            hi = mid
        else:
            lo = mid + 1
    return rows[hi]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def calibration_key(layers: list[QuantLinear], rows: tuple[int, ...]) -> str:
    """What the measurement's answer depends on, hashed."""
    from stages.engine.runner.quant import cpu_flags

    kernel = getattr(layers[0]._block, "library", "torch") if layers else "torch"
    parts = [_cpu_model(), " ".join(sorted(cpu_flags())), os.path.basename(kernel), torch.__version__,
             str(torch.get_num_threads()), repr(rows),
             repr([(m.kind, m.in_features, m.out_features) for m in layers])]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def calibrate_dense_min_rows(layers: list[QuantLinear], rows: tuple[int, ...] = CALIBRATION_ROWS,
                             repeats: int = 5) -> int | None:
    """:func:`measure_dense_min_rows`, measured once per machine and kept in the kernel cache
    (``calibration-<key>.json``); where the cache cannot be written, measured each time."""
    from stages.engine.runner.kernels import cache_dir

    layers = [m for m in layers if m.has_dense]
    if not layers:
        return None
    path = cache_dir() / f"calibration-{calibration_key(layers, rows)}.json"
    try:
        return json.loads(path.read_text())["dense_min_rows"]
    except (OSError, ValueError, KeyError):
        pass
    found = measure_dense_min_rows(layers, rows, repeats)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"dense_min_rows": found}, f)
        os.replace(tmp, path)  # several engines may calibrate at once: whole files only
    except OSError:
        pass
    return found
