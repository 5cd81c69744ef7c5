#!/usr/bin/env python
"""Where the engine process's resident memory goes, and what the dense prompt path buys.

    .venv/bin/python bench/experiments/engine_memory.py [--trade] [--json OUT]

In one process, at the default engine config: RSS after importing torch, after loading the engine
(then trimmed, as the core process does), and after one 1,500-token request, with the growth of
each step split by mapping (``/proc/self/smaps``: the heap, anonymous mappings, the KV pool's
mapping, libraries). Then the model's tensor bytes, of which stored dense copies of quantised
layers (only torch's kernels keep them; block-kernel layers unpack their weights for prompt chunks
of ``dense_min_rows`` rows or more).

``--trade`` also times a 512- and a 2,048-token prompt and decode steps at 8 and 32 streams with
the dense GEMMs, then again without them (every layer on the block kernel at every row count).

``--isa avx2`` emulates an AVX2-only CPU on a bigger one: torch's own kernels at their AVX2 level
(``ATEN_CPU_CAPABILITY``), oneDNN's GEMMs too (``ONEDNN_MAX_CPU_ISA``), our kernels built for
Haswell (``engine.cpu_isa``), and no native bfloat16 (so the dense weights are float32, as
:func:`stages.engine.runner.quant.dense_dtype` picks there). ``--dense-dtype`` overrides that pick.
"""

from __future__ import annotations

import argparse
import collections
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


def smaps() -> collections.Counter[str]:
    """Resident KB by mapping: ``[heap]``, ``[anon]``, a file's name, or ``[.so] <library>``."""
    out: collections.Counter[str] = collections.Counter()
    where = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and ":" not in parts[0]:
                path = parts[5] if len(parts) > 5 else "[anon]"
                where = "[.so] " + os.path.basename(path).split(".so")[0] if ".so" in path else path
            elif parts[0] == "Rss:":
                out[where] += int(parts[1])
    return out


def mb(kb: float) -> float:
    return round(kb / 1024, 1)


def grew(before: collections.Counter[str], after: collections.Counter[str], top: int = 6) -> dict[str, float]:
    diff = collections.Counter({k: after[k] - before.get(k, 0) for k in after})
    return {k: mb(v) for k, v in diff.most_common(top) if v > 512}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trade", action="store_true", help="also time prompts and decode steps with and without the dense copies")
    p.add_argument("--json", default="")
    p.add_argument("--isa", choices=["native", "avx2"], default="native", help="emulate an AVX2-only CPU")
    p.add_argument("--dense-dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    args = p.parse_args()
    if args.isa == "avx2":
        os.environ.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", DNNL_MAX_CPU_ISA="AVX2")
    out: dict[str, object] = {"python_mb": mb(sum(smaps().values())), "isa": args.isa}

    import torch

    from stages.engine.runner import quant

    if args.isa == "avx2":
        flags = frozenset(f for f in quant.cpu_flags() if not f.startswith(("avx512", "amx")))
        quant.cpu_flags = lambda: flags
    if args.dense_dtype != "auto":
        quant.dense_dtype = lambda: getattr(torch, args.dense_dtype)
    out["dense_dtype"] = str(quant.dense_dtype())

    s_torch = smaps()
    out["after_import_torch_mb"] = mb(sum(s_torch.values()))
    from stages.config import EngineSettings
    from stages.engine.core.engine import LLMEngine
    from stages.engine.runner.quant import QuantLinear
    from stages.heap import trim_now
    from stages.model_info import EMBEDDED_MODEL
    from stages.transport.messages import SamplingParams

    engine = LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(cpu_isa="avx2" if args.isa == "avx2" else "auto"))
    trim_now()
    s_loaded = smaps()
    out["after_load_mb"] = mb(sum(s_loaded.values()))
    out["load_grew_by_mapping_mb"] = grew(s_torch, s_loaded)
    model = engine.runner.model
    tensors = {t.data_ptr(): t.numel() * t.element_size()
               for _, t in [*model.named_buffers(), *model.named_parameters()]}
    out["model_tensors_mb"] = round(sum(tensors.values()) / 2**20, 1)
    dense = [m for m in model.modules() if isinstance(m, QuantLinear) and m.has_dense]
    out["dense_copies_mb"] = round(sum(m.dense.numel() * m.dense.element_size()
                                       for m in dense if m.dense is not None) / 2**20, 1)
    out["dense_min_rows"] = getattr(model, "dense_min_rows", None)

    rng = random.Random(0)
    engine.add_request("one", [rng.randrange(1, 40000) for _ in range(1500)],
                       SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while engine.requests:
        engine.step()
    s_req = smaps()
    out["after_one_request_mb"] = mb(sum(s_req.values()))
    out["request_grew_by_mapping_mb"] = grew(s_loaded, s_req)
    print(json.dumps(out, indent=1))

    if args.trade:
        torch.set_num_threads(2)

        def prompt_s(length: int, tag: str) -> float:
            engine.add_request(tag, [rng.randrange(1, 40000) for _ in range(length)],
                               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            t0 = time.perf_counter()
            while tag in engine.requests:
                engine.step()
            return time.perf_counter() - t0

        def step_s(streams: int, tag: str) -> float:
            for i in range(streams):
                engine.add_request(f"{tag}{i}", [rng.randrange(1, 40000) for _ in range(40)],
                                   SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
            for _ in range(8):  # the prompts, then a few warm decode steps
                engine.step()
            times = []
            for _ in range(24):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            for i in range(streams):
                engine.abort(f"{tag}{i}")
            engine.step()
            return statistics.median(times)

        def run(label: str) -> dict[str, float]:
            res = {f"prompt_{n}_ms": round(1e3 * min(prompt_s(n, f"{label}p{n}{k}") for k in range(2)), 1)
                   for n in (512, 2048)}
            res.update({f"step_{b}_streams_ms": round(1e3 * min(step_s(b, f"{label}d{b}{k}") for k in range(2)), 2)
                        for b in (8, 32)})
            print(label, res)
            return res

        out["with_dense"] = run("dense")
        for m in dense:
            m.drop_dense()
        out["without_dense"] = run("kernel")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
