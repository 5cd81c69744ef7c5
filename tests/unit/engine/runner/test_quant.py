"""The quantised weight formats: GGUF block parsing, the Q4_1 -> int4pack mapping checked against
gguf's own dequantisation, int8 requantisation, the CPU kernels, and the ``weights`` switch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from stages.engine.runner.loader import resolve_weights, split_q4_1, split_q8_0, unpermute_rows
from stages.engine.runner.quant import GROUP, ChannelInt8, GroupInt4, QuantLinear, int4_kernels_available

needs_int4 = pytest.mark.skipif(not int4_kernels_available(), reason="no CPU int4 kernels in torch")


def _q4_1(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random weights quantised by gguf to Q4_1: (raw rows, gguf's dequantisation)."""
    w = np.random.default_rng(seed).normal(0, 0.05, size=(n, k)).astype(np.float32)
    w[0, :GROUP] = 0.25  # a constant block (d = 0)
    raw = quantize(w, QT.Q4_1)
    return raw, dequantize(raw, QT.Q4_1)


def test_q4_1_blocks_split_into_gguf_dequantisation():
    raw, ref = _q4_1(8, 128)
    q, d, m = split_q4_1(raw)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and q.shape == (8, 128)
    w = (q.float().view(8, 4, GROUP) * d[..., None] + m[..., None]).view(8, 128)
    assert torch.equal(w, torch.from_numpy(ref))  # exactly gguf's d * q + m


def test_q4_1_maps_onto_int4_scale_zero_convention():
    """(q - 8) * scale + zero with scale = d, zero = m + 8 d is gguf's d * q + m: in float32 it
    differs only by the rounding of m + 8 d; with the kernel's bfloat16 scale/zero, by that rounding."""
    raw, ref = _q4_1(16, 256, seed=1)
    g = GroupInt4.from_q4_1(*split_q4_1(raw))
    ref_t = torch.from_numpy(ref)
    n, k = g.q.shape
    exact = ((g.q.float().view(n, -1, GROUP) - 8) * g.scale[..., None] + g.zero[..., None]).view(n, k)
    assert (exact - ref_t).abs().max() <= 1e-6
    # The kernel's weights: bfloat16 scale (relative 2^-9) times |q - 8| <= 8, plus bf16(zero).
    scale, zero = g.kernel_scale_zero()
    bound = (8 * g.scale.abs() * 2.0**-8 + g.zero.abs() * 2.0**-8).repeat_interleave(GROUP, dim=1)
    assert ((g.dequantize() - ref_t).abs() <= bound + 1e-7).all()
    assert torch.equal(scale, g.scale.bfloat16().float()) and torch.equal(zero, g.zero.bfloat16().float())


@needs_int4
def test_int4_kernel_computes_with_the_dequantised_weights():
    raw, _ = _q4_1(96, 192, seed=2)
    g = GroupInt4.from_q4_1(*split_q4_1(raw))
    layer = QuantLinear(g, None, dense_min_rows=16)
    x = torch.randn(3, 192)
    want = x.bfloat16().float() @ g.dequantize().t()
    got = layer(x)  # 3 rows: the int4 kernel
    assert got.dtype == torch.float32
    # bfloat16 output rounding (relative 2^-8) plus float32 accumulation-order noise.
    assert ((got - want).abs() <= want.abs() * 2.0**-8 + 1e-4).all()
    dense = layer(torch.randn(32, 192))  # 32 rows: the dense copy
    assert dense.shape == (32, 96)


def test_q8_0_blocks_split_into_gguf_dequantisation():
    w = np.random.default_rng(3).normal(0, 0.05, size=(4, 64)).astype(np.float32)
    raw = quantize(w, QT.Q8_0)
    q, d = split_q8_0(raw)
    got = (q.float().view(4, 2, GROUP) * d[..., None]).view(4, 64)
    assert torch.equal(got, torch.from_numpy(dequantize(raw, QT.Q8_0)))


def test_int8_requantisation_and_kernel():
    w = torch.randn(64, 96) * 0.05
    c = ChannelInt8.quantize(w)
    assert c.q.dtype == torch.int8 and c.scale.shape == (64,)
    assert ((c.dequantize() - w).abs() <= c.scale[:, None] / 2 + 1e-7).all()
    layer = QuantLinear(c, torch.ones(64), dense_min_rows=16)
    x = torch.randn(2, 96)
    want = x.bfloat16().float() @ c.dequantize().t()
    # The bias is added in float32 after the kernel's bfloat16 output.
    assert ((layer(x) - 1 - want).abs() <= want.abs() * 2.0**-8 + 1e-4).all()


def test_group_int4_quantise_float_weights():
    w = torch.randn(8, 64)
    g = GroupInt4.quantize(w)
    assert int(g.q.max()) <= 15
    err = (g.dequantize() - w).abs().view(8, 2, GROUP)
    assert (err <= g.scale[..., None] * 0.51 + w.abs().max() * 2.0**-7).all()


def test_unpermute_rows_inverts_llama_cpp_interleave():
    # llama.cpp's converter: w.reshape(heads, 2, dim/2, ...).swapaxes(1, 2); ours must undo it.
    heads, rows = 3, 3 * 8
    hf = torch.arange(rows)
    gguf_order = hf.reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
    assert torch.equal(gguf_order[unpermute_rows(rows, heads)], hf)


def test_embedded_gguf_blocks_match_the_converted_float_weights():
    """The embedded model's own Q4_1 blocks, read directly (rows un-permuted for q/k), dequantise to
    exactly the float weights transformers converted from the same file."""
    from safetensors import safe_open

    from stages.engine.runner.gguf_table import gguf_tensors
    from stages.engine.runner.loader import read_gguf_linears
    from stages.model_info import EMBEDDED_MODEL, embedded_gguf_path, resolve_model_dir

    linears = read_gguf_linears(gguf_tensors(embedded_gguf_path()), num_heads=9, num_kv_heads=3)
    assert len(linears) == 30 * 7
    with safe_open(str(resolve_model_dir(EMBEDDED_MODEL) / "model.safetensors"), "pt") as f:
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                     "model.layers.29.mlp.down_proj.weight"):
            g = linears[name]
            n, k = g.q.shape
            m = g.zero - 8 * g.scale
            w = (g.q.float().view(n, -1, GROUP) * g.scale[..., None] + m[..., None]).view(n, k)
            assert torch.allclose(w, f.get_tensor(name), rtol=0, atol=1e-6), name


def test_resolve_weights():
    from stages.model_info import EMBEDDED_MODEL

    assert resolve_weights("auto", EMBEDDED_MODEL, "cpu") == ("int4" if int4_kernels_available() else "float32")
    assert resolve_weights("auto", EMBEDDED_MODEL, "cuda") == "float32"
    assert resolve_weights("auto", "/some/hf/dir", "cpu") == "float32"
    assert resolve_weights("int8", "/some/hf/dir", "cpu") == "int8"
    with pytest.raises(ValueError):
        resolve_weights("int3", EMBEDDED_MODEL, "cpu")
    with pytest.raises(ValueError):
        resolve_weights("int4", EMBEDDED_MODEL, "cuda")


def test_bf16_lm_head_option():
    from stages.engine.runner.quant import DenseLinear

    w = torch.randn(40, 64)
    head = DenseLinear(w)
    x = torch.randn(3, 64)
    want = x.bfloat16().float() @ w.bfloat16().float().t()
    got = head(x)
    assert got.dtype == torch.float32
    assert ((got - want).abs() <= want.abs() * 2.0**-8 + 1e-4).all()
    assert torch.equal(head.reference_weight, w.bfloat16().float())


@pytest.mark.parametrize("n", [16, 45])
def test_block_layers_unpack_their_own_buffers_to_the_exact_reference(n):
    """A block-kernel layer keeps no copy of its source weights: ``reference_weight`` unpacks the
    kernel's tiles, bit for bit what the source dequantised to (tail tile included)."""
    from stages.engine.runner.quant import BlockInt8, pack_q4_1, pack_q8_0, unpack_q4_1, unpack_q8_0

    w = torch.randn(n, 96) * 0.05
    g = GroupInt4.quantize(w)
    assert torch.equal(unpack_q4_1(*pack_q4_1(g.q, *g.q4_1_fp16()), n), g.dequantize_q4_1())
    b = BlockInt8.quantize(w)
    assert torch.equal(unpack_q8_0(*pack_q8_0(b.q, b.d), n), b.dequantize())
