"""The CPU paged decode-attention kernel (stages/engine/runner/kernels) against torch's SDPA on gathered K/V."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from stages.engine.runner import kernels

kernel = kernels.paged_attention()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C++ compiler here: the engine uses SDPA")


def reference(q, k_cache, v_cache, tables, ctx_lens, block_size, scale):
    b, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    outs = []
    for i in range(b):
        pos = torch.arange(int(ctx_lens[i]))
        slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].float().transpose(0, 1)  # [kvh, L, d]
        v = v_cache[slots].float().transpose(0, 1)
        qq = q[i].view(kv_heads, heads // kv_heads, dim)
        outs.append(F.scaled_dot_product_attention(qq, k, v, scale=scale).reshape(heads, dim))
    return torch.stack(outs)


def case(seed: int, b: int, heads: int, kv_heads: int, dim: int, block_size: int, max_ctx: int):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 512
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)
    ctx = torch.randint(1, max_ctx + 1, (b,), generator=g, dtype=torch.int32)
    ctx[0] = 1  # a sequence with one token of context (its own)
    width = int(-(-int(ctx.max()) // block_size))
    # Blocks scattered through the pool, in no order: what a busy block manager hands out.
    tables = torch.randperm(num_blocks, generator=g)[: b * width].view(b, width).to(torch.int32).contiguous()
    # q as the model has it: a slice of [B, heads + kv_heads, d] (not contiguous across sequences).
    q = torch.randn(b, heads + kv_heads, dim, generator=g)[:, :heads]
    return q, k_cache, v_cache, tables, ctx


@needs_kernel
# head_dim 64 with 1 to 4 query heads per KV head takes the register path on AVX-512 (9/3, 8/8,
# 8/4, 16/4); 16/2 (8 per KV head), 128 and 32 take the generic loops.
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 8, 64), (8, 4, 64), (16, 4, 64), (16, 2, 64),
                                                (4, 4, 128), (8, 2, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_sdpa_on_gathered_kv(heads, kv_heads, dim, threads):
    q, k_cache, v_cache, tables, ctx = case(1, 7, heads, kv_heads, dim, 16, 100)
    scale = dim ** -0.5
    got = kernel(q, k_cache, v_cache, tables, ctx, 16, scale, threads)
    want = reference(q, k_cache, v_cache, tables, ctx, 16, scale)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_bfloat16_cache_and_odd_block_size():
    q, k_cache, v_cache, tables, ctx = case(2, 5, 9, 3, 64, 5, 60)
    kb, vb = k_cache.bfloat16(), v_cache.bfloat16()
    got = kernel(q, kb, vb, tables, ctx, 5, 0.125, 1)
    want = reference(q, kb, vb, tables, ctx, 5, 0.125)  # the same bfloat16 values, in float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_long_context_and_large_scores():
    # Scores far from zero exercise the max subtraction and the exp's range reduction.
    q, k_cache, v_cache, tables, ctx = case(3, 3, 9, 3, 64, 16, 2000)
    got = kernel(q * 30, k_cache, v_cache, tables, ctx, 16, 0.125, 1)
    want = reference(q * 30, k_cache, v_cache, tables, ctx, 16, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.isfinite(got).all()


@needs_kernel
def test_rejects_what_it_cannot_read():
    q, k_cache, v_cache, tables, ctx = case(4, 2, 9, 3, 64, 16, 20)
    with pytest.raises(ValueError):
        kernel(q, k_cache, v_cache, tables.long(), ctx, 16, 0.125, 1)
    with pytest.raises(ValueError):
        kernel(q, k_cache.half(), v_cache.half(), tables, ctx, 16, 0.125, 1)


def test_without_a_compiler_the_kernel_is_absent_and_the_engine_uses_sdpa(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("LIFECYCLE_KERNEL_CACHE", str(tmp_path / "cache"))
    kernels._load_kernel.cache_clear()
    try:
        assert kernels.paged_attention() is None
    finally:
        kernels._load_kernel.cache_clear()
    monkeypatch.delenv("CXX")
    monkeypatch.delenv("LIFECYCLE_KERNEL_CACHE")
    assert (kernels.paged_attention() is None) == (kernel is None)


@needs_kernel
def test_build_is_cached_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv("LIFECYCLE_KERNEL_CACHE", str(tmp_path))
    first = kernels.build()
    mtime = first.stat().st_mtime_ns
    assert kernels.build() == first and first.stat().st_mtime_ns == mtime  # found, not rebuilt
    changed = tmp_path / "paged_attention.cpp"
    changed.write_text(kernels.SOURCES[0].read_text() + "\n// changed\n")
    assert kernels.build((changed, *kernels.SOURCES[1:])) != first


@needs_kernel
def test_a_bfloat16_model_on_cpu_decodes_a_batch_through_the_kernel():
    """The kernel returns float32; a bfloat16 model gets its own dtype back (this crashed in o_proj)."""
    from stages.config import EngineSettings
    from stages.engine.core.engine import LLMEngine
    from stages.model_info import EMBEDDED_MODEL
    from stages.transport.messages import SamplingParams

    eng = LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(device="cpu", num_kv_blocks=256, dtype="bfloat16",
                                                               weights="float32"))
    assert eng.runner.paged_kernel is not None and eng.runner.kv_caches[0][0].dtype == torch.bfloat16
    for i in range(3):
        eng.add_request(f"r{i}", [1, 2, 3, 4 + i], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    tokens = 0
    while eng.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in eng.step())
    assert tokens == 18


def _run_mixed(prefill_kernel_max_len: int, **config: Any) -> tuple[dict[str, list[int]], dict[str, list[float]], list[tuple]]:
    """:func:`_mixed_run`, once per argument set in this session (each run loads a model)."""
    return _mixed_run(prefill_kernel_max_len, tuple(sorted(config.items())))


@functools.cache
def _mixed_run(prefill_kernel_max_len: int, config_items: tuple) -> tuple[dict[str, list[int]], dict[str, list[float]], list[tuple]]:
    """A chunked prompt, a short one, then one sharing the first's prefix (a cache hit) arriving
    while the others decode: steps mixing decodes, prompt chunks at an offset, and cached blocks."""
    import random

    from stages.config import EngineSettings
    from stages.engine.core.engine import LLMEngine
    from stages.model_info import EMBEDDED_MODEL
    from stages.transport.messages import SamplingParams

    # float32 weights: with int8 activations (the quantised default) a 1e-6 difference in attention
    # can flip an activation's rounding, and logprobs then move by ~0.1 on such random prompts.
    eng = LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(
        device="cpu", num_kv_blocks=256, max_num_batched_tokens=64, weights="float32",
        prefill_kernel_max_len=prefill_kernel_max_len, **dict(config_items)))
    layouts = []
    prepare = eng.runner.prepare

    def recording(batch):
        ids, meta, ordered = prepare(batch)
        layouts.append((len(ids), meta.num_decodes, len(meta.prefills)))
        return ids, meta, ordered

    eng.runner.prepare = recording
    rng = random.Random(3)
    a = [rng.randrange(100, 40000) for _ in range(100)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    eng.add_request("a", a, params)
    eng.add_request("b", [rng.randrange(100, 40000) for _ in range(20)], params)
    tokens: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    logprobs: dict[str, list[float]] = {"a": [], "b": [], "c": []}
    steps = 0
    while eng.has_unfinished():
        if steps == 3:
            eng.add_request("c", a[:48] + [rng.randrange(100, 40000) for _ in range(10)], params)
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.logprobs or []]
        steps += 1
    return tokens, logprobs, layouts


@needs_kernel
def test_prompt_tokens_through_the_kernel_match_gather_and_sdpa():
    """``prefill_kernel_max_len``: prompt tokens as the kernel's query rows give what SDPA gives."""
    kern_tokens, kern_lp, kern_layouts = _run_mixed(4096)
    sdpa_tokens, sdpa_lp, sdpa_layouts = _run_mixed(0)
    assert kern_tokens == sdpa_tokens and all(len(t) == 8 for t in kern_tokens.values())
    for rid in kern_lp:
        torch.testing.assert_close(torch.tensor(kern_lp[rid]), torch.tensor(sdpa_lp[rid]), rtol=0, atol=1e-4)
    # The kernel side really ran prompts through the kernel (every token a row, no SDPA prefills),
    # including steps that mixed decodes with prompt chunks; the other side did not.
    prompt_steps = [(n, nd, np_) for n, nd, np_ in kern_layouts if n > 3]
    assert prompt_steps and all(nd == n and np_ == 0 for n, nd, np_ in prompt_steps)
    assert any(np_ > 0 for _, _, np_ in sdpa_layouts)
    assert any(0 < nd < n for n, nd, _ in sdpa_layouts)  # a mixed step: decodes beside a prompt chunk


@needs_kernel
@pytest.mark.parametrize("prefill_kernel_max_len", [4096, 0])
def test_a_bfloat16_kv_cache_holds_twice_the_tokens_and_stays_close(prefill_kernel_max_len):
    """``kv_cache_dtype="bfloat16"`` under a float32 model: the kernel reads it, SDPA paths cast it
    back, and the only change is K/V's rounding (measured: logprobs within 0.016 of float32)."""

    f32_tokens, f32_lp, _ = _run_mixed(prefill_kernel_max_len)
    bf_tokens, bf_lp, _ = _run_mixed(prefill_kernel_max_len, kv_cache_dtype="bfloat16")
    assert bf_tokens == f32_tokens
    for rid in f32_lp:
        torch.testing.assert_close(torch.tensor(bf_lp[rid]), torch.tensor(f32_lp[rid]), rtol=0, atol=0.05)


@needs_kernel
def test_a_bfloat16_kv_cache_halves_the_bytes_per_token_and_is_the_quantised_default():
    # A tiny random-weight model: what is checked is the cache's dtype and size, not the model
    # (the embedded model's four loads took ~38 s); int8 weights stand for any quantised format.
    from stages.config import EngineSettings
    from stages.engine.core.engine import LLMEngine
    from stages.model_info import cache_root
    from tests.tools_model import build_tools_model

    model = str(build_tools_model(cache_root() / "test-models" / "tiny-hermes-tools"))

    def runner(**kw: Any) -> Any:
        return LLMEngine.from_config(model, EngineSettings(device="cpu", kv_cache_memory_gb=0.01, **kw)).runner

    sizes, per_token = {}, {}
    for dtype in ("float32", "bfloat16"):
        r = runner(weights="float32", kv_cache_dtype=dtype)
        assert r.kv_caches[0][0].dtype == getattr(torch, dtype)
        sizes[dtype], per_token[dtype] = r.num_blocks, r.kv_bytes_per_token
    assert per_token["float32"] == 2 * per_token["bfloat16"]
    # auto: bfloat16 under quantised weights, float32 under float32 weights.
    for weights, want in (("int8", torch.bfloat16), ("float32", torch.float32)):
        assert runner(weights=weights).kv_caches[0][0].dtype == want
    assert 2 * sizes["float32"] <= sizes["bfloat16"] <= 2 * sizes["float32"] + 1  # the same bytes, floored
