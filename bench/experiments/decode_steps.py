#!/usr/bin/env python
"""Mean decode step of the engine core at 1, 8 and 32 streams, per kernel configuration, in-process.

Each stream has a ``--prompt``-token prompt and generates ``--tokens`` tokens (greedy, ignore_eos),
all streams at once, so the context grows from prompt to prompt + tokens as in `python -m bench
compare`; the figure is the mean step over the decode-only steps. Configurations alternate within
each round (the order flips between rounds), medians over rounds are printed.

    .venv/bin/python bench/experiments/decode_steps.py                       # the default and torch's kernels
    .venv/bin/python bench/experiments/decode_steps.py --configs "{}" "{'attention': 'sdpa', 'quant_kernel': 'torch'}"
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from stages.config import EngineSettings  # noqa: E402
from stages.engine.core.engine import LLMEngine  # noqa: E402
from stages.model_info import EMBEDDED_MODEL  # noqa: E402
from stages.transport.messages import SamplingParams  # noqa: E402

DEFAULT_CONFIGS = ["{}", "{'quant_kernel': 'torch'}", "{'quant_kernel': 'torch', 'attention': 'sdpa'}"]


def mean_decode_step(eng: LLMEngine, streams: int, prompt: int, tokens: int) -> float:
    for i in range(streams):
        ids = [100 + (i * 7 + j) % 5000 for j in range(prompt)]
        eng.add_request(f"s{i}", ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    walls = []
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
    return statistics.mean(walls[-(tokens - 2):])  # the decode-only steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="EngineSettings overrides (Python dicts)")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    engines = {c: LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(**{
                   "device": "cpu", "num_kv_blocks": 4096, "num_threads": a.threads, **ast.literal_eval(c)}))
               for c in a.configs}
    levels = [int(x) for x in a.streams.split(",")]
    runs: dict[str, dict[int, list[float]]] = {c: {n: [] for n in levels} for c in a.configs}
    for rnd in range(a.rounds):
        order = a.configs if rnd % 2 == 0 else a.configs[::-1]
        for n in levels:
            for c in order:
                runs[c][n].append(mean_decode_step(engines[c], n, a.prompt, a.tokens) * 1e3)
    print("\n| config | " + " | ".join(f"{n} streams (ms/step)" for n in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for c in a.configs:
        print(f"| `{c}` | " + " | ".join(f"{statistics.median(runs[c][n]):.1f}" for n in levels) + " |")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "runs_ms": runs}, indent=1))


if __name__ == "__main__":
    main()
