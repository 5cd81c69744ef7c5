"""Structured-output costs on this machine (BENCHMARKS.md "Structured outputs").

1. ``libs``: compile time of a small and a large JSON schema in llguidance, xgrammar and
   outlines-core, for the same tokenizer (the libraries other than llguidance are optional: install
   them outside the project, e.g. ``pip install --target /tmp/gcmp --no-deps xgrammar apache-tvm-ffi
   outlines-core`` and run with ``PYTHONPATH=/tmp/gcmp``).
2. ``compile``: Preprocess's compile (``GrammarCompiler.compile``) cold vs cached, and the engine's
   matcher-template build, for the small and the large schema.
3. ``mask``: the per-step mask cost at batch 1 and 32 (llguidance filling the bitmask, and the
   sampler unpacking and applying it), with matchers advanced into realistic mid-document states.
4. ``throughput``: 32 streams in the in-process engine, all constrained vs none, alternating rounds.

    .venv/bin/python bench/experiments/bench_grammar.py [libs compile mask throughput] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.grammar_schemas import LARGE, SMALL  # noqa: E402

MODEL = "embedded:smollm2-135m-instruct"


def _median_ms(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def bench_libs(tokenizer: Any, vocab: int, eos: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    import llguidance

    from stages.preprocess.grammar import JSON_OPTIONS, tokenizer_json

    tok_json = tokenizer_json(tokenizer)
    t0 = time.perf_counter()
    llg = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    out["llguidance_tokenizer_ms"] = (time.perf_counter() - t0) * 1000
    for name, schema in (("small", SMALL), ("large", LARGE)):
        def llg_compile(schema: dict[str, Any] = schema) -> None:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            m = llguidance.LLMatcher(llg, grammar)
            assert not m.is_error(), m.get_error()
            m.compute_bitmask()  # the first mask: llguidance builds its lexer lazily, count it here
        out[f"llguidance_{name}_ms"] = _median_ms(llg_compile, 7)
    try:
        import transformers
        import xgrammar

        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        out["xgrammar_tokenizer_ms"] = (time.perf_counter() - t0) * 1000
        for name, schema in (("small", SMALL), ("large", LARGE)):
            def xgr(schema: dict[str, Any] = schema) -> None:
                xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(schema))
            out[f"xgrammar_{name}_ms"] = _median_ms(xgr, 7)
    except ImportError as exc:
        out["xgrammar"] = f"not installed ({exc})"
    try:
        from outlines_core import Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema

        vocab_map: dict[str, list[int]] = {}
        for token, i in tokenizer.backend_tokenizer.get_vocab().items():
            if i not in eos:
                vocab_map.setdefault(token.replace("\u0120", " ").replace("\u010a", "\n"), []).append(i)
        voc = Vocabulary(eos[0], vocab_map)
        for name, schema in (("small", SMALL), ("large", LARGE)):
            def oc(schema: dict[str, Any] = schema) -> None:
                Index(build_regex_from_schema(json.dumps(schema)), voc)
            out[f"outlines_core_{name}_ms"] = _median_ms(oc, 3)
    except ImportError as exc:
        out["outlines_core"] = f"not installed ({exc})"
    return out


def bench_compile(tokenizer: Any, vocab: int, eos: list[int]) -> dict[str, Any]:
    from stages.engine.core.structured import GrammarBackend
    from stages.preprocess.grammar import GrammarCompiler
    from stages.transport.messages import StructuredOutputSpec

    out: dict[str, Any] = {}
    for name, schema in (("small", SMALL), ("large", LARGE)):
        spec = StructuredOutputSpec("json_schema", json.dumps(schema))
        cold, cached, build_cold, build_cached = [], [], [], []
        for _ in range(7):
            compiler = GrammarCompiler(tokenizer, vocab, eos)
            compiler._llg = shared_llg(tokenizer, vocab, eos)  # the tokenizer is built once per replica
            grammar, hit, seconds = asyncio.run(compiler.compile(spec))
            assert not hit
            cold.append(seconds)
            _, hit, seconds = asyncio.run(compiler.compile(spec))
            assert hit
            cached.append(seconds)
            backend = GrammarBackend(tokenizer, vocab, eos)
            backend._llg = compiler._llg
            t0 = time.perf_counter()
            backend.build(grammar)
            build_cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            backend.build(grammar)
            build_cached.append(time.perf_counter() - t0)
        out[name] = {"spec_bytes": len(spec.spec), "grammar_bytes": len(grammar.grammar),
                     "preprocess_cold_ms": statistics.median(cold) * 1000,
                     "preprocess_cached_ms": statistics.median(cached) * 1000,
                     "engine_build_cold_ms": statistics.median(build_cold) * 1000,
                     "engine_build_cached_ms": statistics.median(build_cached) * 1000}
    return out


_LLG: Any = None


def shared_llg(tokenizer: Any, vocab: int, eos: list[int]) -> Any:
    global _LLG
    if _LLG is None:
        from stages.preprocess.grammar import make_llg_tokenizer, tokenizer_json

        _LLG = make_llg_tokenizer(tokenizer_json(tokenizer), vocab, eos)
    return _LLG


def large_instance(i: int) -> dict[str, Any]:
    """A valid instance of ``LARGE`` (values vary with ``i``)."""
    values = [f"name{i}", 40 + i, 1.5 + i, i % 2 == 0, "paid", f"ABC-{1000 + i}",
              {"street": f"Main {i}", "city": "Oslo", "country": "DE"},
              [{"sku": "abcd1234", "qty": 1 + i % 9}], "2024-01-02", None]
    return {name: values[k % len(values)] for k, name in enumerate(LARGE["properties"])}


def small_instance(i: int) -> dict[str, Any]:
    return {"city": f"Town{i}", "unit": "celsius", "days": 1 + i % 7}


def bench_mask(tokenizer: Any, vocab: int, eos: list[int], steps: int = 40) -> dict[str, Any]:
    """Per-step cost as in decoding: each step fills every row's mask, then each row's matcher
    consumes the next token of its own valid document (so no step repeats a state)."""
    import torch

    from stages.engine.core.structured import GrammarBackend, apply_bitmask
    from stages.preprocess.grammar import JSON_OPTIONS, GrammarCompiler
    from stages.transport.messages import StructuredOutputSpec

    compiler = GrammarCompiler(tokenizer, vocab, eos)
    sep = (JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"])
    out: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "steps": steps}
    for name, schema, instance in (("small", SMALL, small_instance), ("large", LARGE, large_instance)):
        grammar = compiler.compile_sync(StructuredOutputSpec("json_schema", json.dumps(schema)))
        backend = GrammarBackend(tokenizer, vocab, eos)
        backend._llg = compiler.llg_tokenizer
        backend.build(grammar)
        for batch in (1, 32):
            docs = [tokenizer.encode(json.dumps(instance(i), separators=sep), add_special_tokens=False)
                    for i in range(batch)]
            states = [backend.new_state(grammar) for _ in range(batch)]
            fills, applies = [], []
            base = torch.randn(batch, vocab)
            for step in range(steps):
                outputs = [d[:step % len(d)] for d in docs]
                for j, d in enumerate(docs):
                    if step % len(d) == 0:
                        states[j] = backend.new_state(grammar)  # document done: start the next one
                logits = base.clone()
                t0 = time.perf_counter()
                bitmask = backend.fill_bitmask(states, outputs)
                t1 = time.perf_counter()
                apply_bitmask(logits, bitmask)
                fills.append(t1 - t0)
                applies.append(time.perf_counter() - t1)
                for state, d in zip(states, docs, strict=True):
                    ok = state.accept(d[step % len(d)])
                    assert ok, state.error
            fill, apply = statistics.median(fills) * 1000, statistics.median(applies) * 1000
            out[f"{name}_b{batch}"] = {"fill_ms": fill, "apply_ms": apply, "total_ms": fill + apply}
    return out


def bench_throughput(rounds: int, streams: int, max_tokens: int) -> dict[str, Any]:
    """Decode tokens/s of ``streams`` concurrent requests, all constrained vs none, alternating."""
    from stages.api.max_tokens import MaxTokens
    from stages.config import EngineSettings
    from stages.engine.core.engine import LLMEngine
    from stages.preprocess.grammar import GrammarCompiler
    from stages.preprocess.preprocessor import Preprocessor
    from stages.transport.messages import PreprocessRequest, SamplingParams, StructuredOutputSpec

    engine = LLMEngine.from_config(MODEL, EngineSettings(device="cpu", max_num_seqs=streams, kv_cache_memory_gb=0.5,
                                                         max_num_batched_tokens=2048))
    pre = Preprocessor(MODEL)
    compiler = GrammarCompiler(pre.tokenizer, pre.model_vocab_size, pre.eos_token_ids)
    # A schema that cannot finish inside max_tokens (long bounded strings), so both runs produce
    # exactly max_tokens per stream and the comparison is token for token.
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 600, "maxLength": 800}},
              "required": ["story"], "additionalProperties": False}
    grammar = compiler.compile_sync(StructuredOutputSpec("json_schema", json.dumps(schema)))
    engine.grammars.build(grammar)
    prompts = [pre.process(PreprocessRequest(
        f"p{i}", SamplingParams(), MaxTokens(), messages=[{"role": "user", "content": f"Tell story number {i}."}]
    )).prompt_token_ids for i in range(streams)]
    results: dict[str, list[float]] = {"none": [], "constrained": []}
    shares: list[float] = []
    cpu: dict[str, list[float]] = {"none": [], "constrained": []}
    for r in range(-1, rounds):  # round -1 warms up (first-call costs in torch and llguidance), not counted
        for mode in ("none", "constrained") if r % 2 else ("constrained", "none"):
            for i, prompt in enumerate(prompts):
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                engine.add_request(f"{mode}-{r}-{i}", prompt, params,
                                   grammar=grammar if mode == "constrained" else None)
            first_decode = None
            tokens = 0
            mask_before = 0.0
            while engine.has_unfinished():
                outs = engine.step()
                decoding = [o for o in outs if o.new_token_ids]
                if first_decode is None and len(decoding) == streams:
                    first_decode = time.perf_counter()  # every stream has its first token: decode begins
                    cpu_before = time.process_time()  # this process's CPU, all threads: less load-sensitive
                    mask_before = engine.grammars.mask_stats.seconds
                    continue
                if first_decode is not None:
                    tokens += sum(len(o.new_token_ids) for o in decoding)
            elapsed = time.perf_counter() - first_decode
            cpu_ms_per_token = (time.process_time() - cpu_before) / tokens * 1000
            rate = tokens / elapsed
            share = (engine.grammars.mask_stats.seconds - mask_before) / elapsed
            if r >= 0:
                results[mode].append(rate)
                cpu[mode].append(cpu_ms_per_token)
                if mode == "constrained":
                    shares.append(share)
            print(f"round {r} {mode}: {rate:.1f} tok/s, {cpu_ms_per_token:.2f} CPU ms/token, "
                  f"mask fill {share:.1%} of decode time", flush=True)
    none, constrained = statistics.median(results["none"]), statistics.median(results["constrained"])
    return {"streams": streams, "max_tokens": max_tokens, "rounds": rounds, "weights": engine.runner.weights,
            "tok_s": results, "median_none": none, "median_constrained": constrained,
            "ratio": constrained / none, "ratios_per_round": [c / n for c, n in zip(
                results["constrained"], results["none"], strict=True)],
            "cpu_ms_per_token": cpu, "cpu_ratio": statistics.median(cpu["constrained"]) / statistics.median(cpu["none"]),
            "mask_fill_share_of_decode": statistics.median(shares) if shares else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", default=["libs", "compile", "mask", "throughput"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from stages.model_info import load_cpu_tokenizer, model_info

    tokenizer = load_cpu_tokenizer(MODEL)
    info = model_info(MODEL, tokenizer=tokenizer)
    vocab, eos = info.vocab_size, info.eos_token_ids
    results: dict[str, Any] = {}
    if "libs" in args.parts:
        results["libs"] = bench_libs(tokenizer, vocab, eos)
        print(json.dumps(results["libs"], indent=1), flush=True)
    if "compile" in args.parts:
        results["compile"] = bench_compile(tokenizer, vocab, eos)
        print(json.dumps(results["compile"], indent=1), flush=True)
    if "mask" in args.parts:
        results["mask"] = bench_mask(tokenizer, vocab, eos)
        print(json.dumps(results["mask"], indent=1), flush=True)
    if "throughput" in args.parts:
        results["throughput"] = bench_throughput(args.rounds, args.streams, args.max_tokens)
        print(json.dumps(results["throughput"], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
