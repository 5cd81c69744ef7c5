#!/usr/bin/env python
"""Greedy agreement of each quantised weight path with the float32 model over the parity prompts.

The float32 engine is token-exact with transformers on the GGUF's exact dequantisation
(``tests/parity/test_parity.py``); this measures how far each quantised path (and LM-head choice)
moves greedy decoding from it: per prompt, the number of leading tokens equal to float32's, out of
``--tokens``. All prompts run at once (chunked prefill, 64-token chunks), as in the parity test.

    .venv/bin/python bench/experiments/quant_agreement.py    # block kernel (int4/int8, Q8_0 head) and torch's kernels
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from stages.config import EngineSettings  # noqa: E402
from stages.engine.core.engine import LLMEngine  # noqa: E402
from stages.model_info import EMBEDDED_MODEL, load_tokenizer  # noqa: E402
from stages.transport.messages import SamplingParams  # noqa: E402
from tests.parity.test_parity import _TEXTS, _long_text  # noqa: E402


def prompts() -> list[list[int]]:
    tok = load_tokenizer(EMBEDDED_MODEL)
    out = [[tok.bos_token_id or 1]] + [tok(t)["input_ids"] for t in _TEXTS]
    chat = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about GPUs."}],
                                   add_generation_prompt=True, tokenize=False)
    out += [tok(chat)["input_ids"], tok(_long_text(3))["input_ids"], tok(_long_text(24))["input_ids"]]
    return out


def run(weights: str, lm_head: str, ps: list[list[int]], n: int, kernel: str = "torch") -> list[list[int]]:
    import stages.engine.runner.loader as loader

    saved = loader.lm_head_default
    if weights != "float32" and lm_head != "auto":
        loader.lm_head_default = lambda w, b: lm_head  # type: ignore[assignment]
    try:
        eng = LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(
            device="cpu", weights=weights, num_kv_blocks=1024, max_num_batched_tokens=64,
            enable_prefix_caching=False, quant_kernel=kernel))
    finally:
        loader.lm_head_default = saved
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, params)
    outs: list[list[int]] = [[] for _ in ps]
    while eng.has_unfinished():
        for o in eng.step():
            outs[int(o.request_id)].extend(o.new_token_ids)
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--configs", default="int4:q8_0:native,int8:q8_0:native,int4:int8:torch,int4:float:torch",
                    help="weights:lm_head[:quant_kernel] (lm_head auto = the default for that kernel)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "quant_agreement.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ps = prompts()
    ref = run("float32", "float", ps, a.tokens)
    res = {}
    for cfg in a.configs.split(","):
        weights, head, *rest = cfg.split(":")
        got = run(weights, head, ps, a.tokens, rest[0] if rest else "torch")
        prefix = [next((k for k, (x, y) in enumerate(zip(g, r, strict=True)) if x != y), a.tokens)
                  for g, r in zip(got, ref, strict=True)]
        res[cfg] = {"identical_prompts": sum(p == a.tokens for p in prefix), "prompts": len(ps),
                    "median_leading_tokens_equal": statistics.median(prefix), "leading_tokens_equal": prefix}
        print(f"weights {weights}, LM head {head}, kernel {rest[0] if rest else 'torch'}: {res[cfg]['identical_prompts']}/{len(ps)} prompts identical "
              f"for {a.tokens} tokens; leading tokens equal per prompt {prefix}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"tokens": a.tokens, "results": res}, indent=2) + "\n")


if __name__ == "__main__":
    main()
