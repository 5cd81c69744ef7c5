"""A/B in one process: the Q4_1 matmul with the activations quantised on one thread (the source as
of round 11, given as a path) against the shipped source (quantised on the matmul's threads).
SmolLM2's four Q4_1 shapes x 30 layers at 406 rows (a 32-prompt burst's prompt step) and 32 rows
(a decode step), two threads, the builds alternating; outputs compared bit for bit.

    .venv/bin/python bench/results/issue11/round12/scripts/quantize_threads_ab.py OLD.cpp
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(ROOT))

from stages.engine.kernels import QuantMatmul, _open, _QUANT_SRC, build  # noqa: E402
from stages.engine.quant import pack_q4_1  # noqa: E402

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (k, n): qkv, o, gate_up, down


def main() -> None:
    import ctypes

    old = QuantMatmul(ctypes.CDLL(str(build(Path(sys.argv[1])))))
    new = QuantMatmul(_open(_QUANT_SRC))
    g = torch.Generator().manual_seed(0)
    weights = []
    for k, n in SHAPES:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        d = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        m = (-torch.rand(n, k // 32, generator=g) * 0.05).half()
        weights.append((k, n, pack_q4_1(q, d, m)))
    for rows in (406, 32):
        xs = {k: torch.randn(rows, k, generator=g) for k, _ in SHAPES}
        times: dict[str, list[float]] = {"one thread quantises": [], "the matmul's threads quantise": []}
        for rnd in range(8):
            sides = [("one thread quantises", old), ("the matmul's threads quantise", new)]
            for name, kern in (sides if rnd % 2 == 0 else sides[::-1]):
                t = time.perf_counter()
                for _ in range(30):
                    for k, n, packed in weights:
                        kern.q4_1(xs[k], *packed, n, 2)
                times[name].append(time.perf_counter() - t)
        for k, n, packed in weights:
            assert torch.equal(old.q4_1(xs[k], *packed, n, 2), new.q4_1(xs[k], *packed, n, 2))
        med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        print(f"{rows} rows, 30 layers, 2 threads: " + ", ".join(f"{n} {v:.1f} ms" for n, v in med.items())
              + f"; new/old {med[list(med)[1]] / med[list(med)[0]]:.3f}; outputs bit-identical")


if __name__ == "__main__":
    main()
