"""The whole-layer decode step (``decode_layers.cpp``) against the per-op torch path it replaces, on
the embedded model's own Q4_1 / Q8_0 weights.

Every step the fused path takes is rerun layer by layer: each layer gets the same input both ways
and its outputs must agree to within ``LAYER_TOL`` of their magnitude. Not closer, and not compared
over the whole stack: the two sum in different orders, and with int8 activations a last-bit
difference can move a value across a rounding step. Measured here, a relative perturbation of 2e-7
of the per-op path's own input moves one layer's output by 2e-3 of its magnitude and the last
layer's by ~1%, as much as the fused path differs; a wrong op (norm, RoPE, cache write, residual)
is off by the whole magnitude."""

from __future__ import annotations

import functools

import pytest

from stages.config import EngineSettings
from stages.engine.core.engine import LLMEngine
from stages.engine.runner import kernels
from stages.engine.runner.fused_decode import FusedDecode
from stages.engine.runner.quant import cpu_flags
from stages.model_info import EMBEDDED_MODEL
from stages.transport.messages import SamplingParams

#: Largest |fused - per op| of one layer's output, as a share of its largest |value|.
LAYER_TOL = 1e-2

pytestmark = pytest.mark.skipif(kernels.decode_layers() is None, reason="the kernels do not build here")


@functools.cache
def engine(kv_cache_dtype: str = "auto") -> LLMEngine:
    return LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(
        num_threads=1, num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False))


def isas() -> list:
    have = cpu_flags()
    return [pytest.param("auto", id="auto"),
            pytest.param("avxvnni", id="avxvnni",
                         marks=pytest.mark.skipif(not {"avx2", "avx_vnni"} <= have, reason="no AVX-VNNI")),
            pytest.param("avx2", id="avx2", marks=pytest.mark.skipif("avx2" not in have, reason="no AVX2")),
            pytest.param("generic", id="generic")]


def compare_each_step(eng: LLMEngine, steps: int, rows: int, prompt_len: int = 24) -> int:
    """Greedy requests through ``eng``; in every step the fused path takes, each layer is run both
    ways on the per-op path's input to it, and the outputs compared. Returns the steps compared."""
    model = eng.runner.model
    fused = model.fused_decode
    assert fused is not None, "the default CPU config runs decode steps fused"
    forward = model.forward
    compared = 0

    def both(input_ids, meta, kv_caches):  # type: ignore[no-untyped-def]
        nonlocal compared
        if not fused.applies(meta, input_ids.shape[0]):
            return forward(input_ids, meta, kv_caches)
        x = model.embed_tokens(input_ids)
        cos, sin = model.rope(meta.positions, x.dtype)
        table = fused.table
        try:
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(model.layers, kv_caches, strict=True)):
                fused.table = table[i:i + 1].contiguous()
                got = x.clone()
                fused(got, cos, sin, meta)
                x = layer(x, cos, sin, meta, k_cache, v_cache)
                err = float((got - x).abs().max()) / float(x.abs().max())
                assert err < LAYER_TOL, f"layer {i}: fused output off by {err:.2e} of its magnitude"
        finally:
            fused.table = table
        compared += 1
        return forward(input_ids, meta, kv_caches)

    model.forward = both  # type: ignore[method-assign]
    try:
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        for i in range(rows):
            eng.add_request(f"r{i}", [1 + (13 * i + 7 * j) % 3000 for j in range(prompt_len + 5 * i)], params)
        while eng.has_unfinished():
            eng.step()
    finally:
        model.forward = forward  # type: ignore[method-assign]
    return compared


@pytest.mark.parametrize("isa", isas())
def test_fused_decode_matches_the_per_op_path(isa):
    """Each instruction set's build of the fused step (the per-op path keeps the native matmuls)."""
    eng = engine()
    model = eng.runner.model
    native = model.fused_decode
    model.fused_decode = FusedDecode(kernels.decode_layers(isa), model, eng.runner.kv_caches, native.max_rows)
    steps = 3 if isa == "generic" else 6  # plain C matmuls are slow: fewer steps say as much
    try:
        assert compare_each_step(eng, steps=steps, rows=3) >= steps - 1
    finally:
        model.fused_decode = native


def test_fused_decode_with_a_float32_cache_and_odd_batch_sizes():
    eng = engine("float32")
    assert eng.runner.model.fused_decode.cache_bf16 is False
    assert compare_each_step(eng, steps=4, rows=7, prompt_len=40) >= 3


def test_short_prompts_run_as_kernel_rows_through_the_fused_path_too():
    """A step of short prompts is all kernel rows (``prefill_kernel_max_len``): fused, and the same."""
    eng = engine()
    fused = eng.runner.model.fused_decode
    seen = []
    applies = fused.applies
    fused.applies = lambda meta, rows: seen.append(rows) or applies(meta, rows)  # type: ignore[method-assign]
    try:
        compare_each_step(eng, steps=2, rows=2, prompt_len=10)
    finally:
        del fused.applies
    assert any(r > 2 for r in seen), "the prompts' step was not offered to the fused path"


def test_fused_decode_is_off_where_a_matmul_is_not_on_the_block_kernel():
    eng = engine()
    model = eng.runner.model
    native = model.fused_decode
    down = model.layers[3].mlp.down_proj
    try:
        down.kind = "int4"
        assert not model.enable_fused_decode(kernels.decode_layers(), eng.runner.kv_caches)
        down.kind = "q4_1"
        assert not model.enable_fused_decode(None, eng.runner.kv_caches)
        assert model.enable_fused_decode(kernels.decode_layers(), eng.runner.kv_caches)
    finally:
        down.kind = "q4_1"
        model.fused_decode = native
