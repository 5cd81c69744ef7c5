"""The block-quantised matmul kernel (stages/engine/runner/kernels/quant_matmul.cpp): GGUF Q4_1 / Q8_0 weights
in the kernel's tile layout, int8 activations, checked against the same arithmetic in float32."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from stages.engine.runner import kernels
from stages.engine.runner.gguf_table import gguf_tensors
from stages.engine.runner.loader import read_gguf_q8_0, split_q4_1, split_q8_0
from stages.engine.runner.quant import (
    GROUP,
    BlockInt8,
    GroupInt4,
    QuantLinear,
    cpu_flags,
    pack_q4_1,
    pack_q8_0,
)

kernel = kernels.quant_matmul()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler here: torch's int4/int8 kernels run")


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel rounds it: int8 per block of 32, one float scale each."""
    qx, dx = kernel.quantize_activations(x)
    return (qx.float().view(x.shape[0], -1, GROUP) * dx[..., None]).view(x.shape)


def test_activation_rounding_is_absmax_int8_per_block():
    x = torch.randn(3, 96) * torch.tensor([1.0, 100.0, 1e-3]).repeat_interleave(32)
    x[1, :GROUP] = 0.0  # an all-zero block: scale 0, no division by zero
    qx, dx = kernel.quantize_activations(x)
    assert qx.dtype == torch.int8 and int(qx.abs().max()) == 127
    want_d = x.view(3, 3, GROUP).abs().amax(-1) / 127
    torch.testing.assert_close(dx, want_d)
    assert (int8_blocks(x) - x).abs().le(dx.repeat_interleave(GROUP, 1) / 2 * 1.0001 + 1e-12).all()
    assert torch.equal(qx[1, :GROUP], torch.zeros(GROUP, dtype=torch.int8))


#: The narrower instruction sets whose builds the random-block tests check beside the native one,
#: where this CPU can run them (an AVX-512 machine then checks its AVX2 paths too).
NARROWER = {"avxvnni": "avx-vnni", "avx2": "avx2"}


@functools.cache
def narrower_kernel(isa: str) -> kernels.QuantMatmul | None:
    """The same source built for ``isa`` (``engine.cpu_isa``), or None where this CPU lacks it."""
    try:
        lib = ctypes.CDLL(str(kernels.build(march=kernels.march_for(isa))))
    except (OSError, RuntimeError, ValueError):
        return None
    return kernels.QuantMatmul(lib)


def both_builds() -> list:
    return [pytest.param("native", id="native")] + [pytest.param(isa, id=isa) for isa in NARROWER]


def build_of(which: str) -> kernels.QuantMatmul:
    if which == "native":
        return kernel
    k = narrower_kernel(which)
    if k is None:
        pytest.skip(f"no {which} build here")
    assert k.isa_name == NARROWER[which]
    return k


@pytest.mark.parametrize("which", both_builds())
def test_activation_rounding_is_exactly_round_half_even_of_x_over_scale(which):
    """The vectorised and the scalar quantisation must both be ``rint(x * (1 / d))`` in float32,
    ties to even: a tie-heavy input (multiples of d/2) pins that down exactly."""
    kern = build_of(which)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 128, generator=g)
    x[0, :32] = torch.arange(-16, 16) * 0.5            # amax 8: d = 8/127
    x[1, :32] = torch.arange(32) - 15.5                 # d = 1 exactly below: every value a tie
    x[1, 0] = 127.0
    x[2, 32:64] = 0.0
    qx, dx = kern.quantize_activations(x)
    xb = x.view(5, 4, GROUP).numpy()
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    want = np.rint(xb * inv[..., None]).astype(np.int8).reshape(5, 128)
    assert np.array_equal(qx.numpy(), want)
    assert np.array_equal(dx.numpy(), d)
    assert qx[1, 1:4].tolist() == [-14, -14, -12]  # -14.5, -13.5, -12.5: ties go to even


@pytest.mark.parametrize("n,k", [(96, 64), (40, 1536), (7, 32)])  # 40 and 7: padded tiles
# The kernel runs rows 4 at a time, then 2, then 1, against pairs of tiles then a last single tile
# (40 outputs: 3 tiles); these row counts reach every combination.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9, 11, 33])
def test_q4_1_matches_dequantised_weights_times_rounded_activations(n, k, rows):
    g = torch.Generator().manual_seed(n * 100 + rows)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // GROUP, generator=g) * 0.01).half()
    m = (-torch.rand(n, k // GROUP, generator=g) * 0.05).half()
    w = (q.float().view(n, -1, GROUP) * d.float()[..., None] + m.float()[..., None]).view(n, k)
    x = torch.randn(rows, k, generator=g)
    packed = pack_q4_1(q, d, m)
    got = kernel.q4_1(x, *packed, n, 1)
    want = int8_blocks(x) @ w.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(kernel.q4_1(x, *packed, n, 2), got)  # threads split tiles, not sums


@pytest.mark.parametrize("rows,k", [(64, 1536), (200, 576)])  # 3,072 and 3,600 blocks: quantised on two threads
def test_a_prompt_steps_activations_quantise_on_the_matmuls_threads_with_the_same_result(rows, k):
    n = 48
    g = torch.Generator().manual_seed(rows + k)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // GROUP, generator=g) * 0.01).half()
    m = (-torch.rand(n, k // GROUP, generator=g) * 0.05).half()
    w = (q.float().view(n, -1, GROUP) * d.float()[..., None] + m.float()[..., None]).view(n, k)
    x = torch.randn(rows, k, generator=g)
    packed = pack_q4_1(q, d, m)
    two = kernel.q4_1(x, *packed, n, 2)
    torch.testing.assert_close(two, int8_blocks(x) @ w.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(two, kernel.q4_1(x, *packed, n, 1))


@pytest.mark.parametrize("which", both_builds())
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_each_narrower_build_computes_what_the_native_one_does(which, rows):
    """Both builds against the float32 arithmetic on their own rounded activations (the rounding
    itself is pinned above), Q4_1 and Q8_0, with padded tiles."""
    kern = build_of(which)
    g = torch.Generator().manual_seed(rows)
    n, k = 40, 576
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // GROUP, generator=g) * 0.01).half()
    m = (-torch.rand(n, k // GROUP, generator=g) * 0.05).half()
    w = (q.float().view(n, -1, GROUP) * d.float()[..., None] + m.float()[..., None]).view(n, k)
    x = torch.randn(rows, k, generator=g)
    qx, dx = kern.quantize_activations(x)
    xr = (qx.float().view(rows, -1, GROUP) * dx[..., None]).view(rows, k)
    torch.testing.assert_close(kern.q4_1(x, *pack_q4_1(q, d, m), n, 1), xr @ w.T, rtol=1e-5, atol=1e-5)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    w8 = (q8.float().view(n, -1, GROUP) * d.float()[..., None]).view(n, k)
    torch.testing.assert_close(kern.q8_0(x, *pack_q8_0(q8, d), n, 1), xr @ w8.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k", [(64, 64), (33, 576)])
@pytest.mark.parametrize("rows", [1, 4, 6])
def test_q8_0_matches_dequantised_weights_times_rounded_activations(n, k, rows):
    g = torch.Generator().manual_seed(n + rows)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    d = (torch.rand(n, k // GROUP, generator=g) * 0.01).half()
    w = (q.float().view(n, -1, GROUP) * d.float()[..., None]).view(n, k)
    x = torch.randn(rows, k, generator=g)
    got = kernel.q8_0(x, *pack_q8_0(q, d), n, 1)
    torch.testing.assert_close(got, int8_blocks(x) @ w.T, rtol=1e-5, atol=1e-5)


def test_gguf_q4_1_blocks_run_exactly_as_the_file_stores_them():
    w = np.random.default_rng(0).normal(0, 0.05, size=(48, 128)).astype(np.float32)
    raw = quantize(w, QT.Q4_1)
    g = GroupInt4.from_q4_1(*split_q4_1(raw))
    # fp16 d and m are the file's own: the kernel's weights are gguf's dequantisation, bit for bit.
    assert torch.equal(g.dequantize_q4_1(), torch.from_numpy(dequantize(raw, QT.Q4_1)))
    layer = QuantLinear(g, None, dense_min_rows=1 << 30, keep_dense=False, block_kernel=kernel)
    assert layer.kind == "q4_1"
    x = torch.randn(3, 128)
    torch.testing.assert_close(layer(x), int8_blocks(x) @ g.dequantize_q4_1().T, rtol=1e-5, atol=1e-5)


def test_block_int8_quantisation_gives_a_q8_0_table_back():
    w = np.random.default_rng(1).normal(0, 0.05, size=(16, 64)).astype(np.float32)
    raw = quantize(w, QT.Q8_0)
    q, d = split_q8_0(raw)
    again = BlockInt8.quantize(torch.from_numpy(dequantize(raw, QT.Q8_0)))
    assert torch.equal(again.q, q) and torch.equal(again.d, d)
    layer = QuantLinear(again, torch.ones(16), dense_min_rows=1 << 30, keep_dense=False, block_kernel=kernel)
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), int8_blocks(x) @ again.dequantize().T + 1, rtol=1e-5, atol=1e-5)


def test_embedded_gguf_lm_head_is_its_own_q8_0_table():
    from stages.engine.runner.loader import load_state_dict
    from stages.model_info import EMBEDDED_MODEL, embedded_gguf_path

    head = read_gguf_q8_0(gguf_tensors(embedded_gguf_path()))
    assert head is not None
    table = load_state_dict(EMBEDDED_MODEL)["model.embed_tokens.weight"]  # transformers' dequantisation
    assert torch.equal(head.dequantize(), table.float())


def test_block_weights_without_the_kernel_or_with_ragged_blocks_are_refused():
    with pytest.raises(ValueError):
        QuantLinear(BlockInt8.quantize(torch.randn(16, 64)), None)
    ragged = BlockInt8(torch.zeros(4, 40, dtype=torch.int8), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="divisible by 32"):
        QuantLinear(ragged, None, block_kernel=kernel)


def test_runner_falls_back_to_torch_kernels_without_a_compiler(monkeypatch, tmp_path):
    from stages.engine.runner.model_runner import ModelRunner

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("LIFECYCLE_KERNEL_CACHE", str(tmp_path / "cache"))
    kernels._load_kernel.cache_clear()
    try:
        assert ModelRunner._block_kernel("auto", "auto") is None
        with pytest.raises(RuntimeError):
            ModelRunner._block_kernel("native", "auto")
    finally:
        kernels._load_kernel.cache_clear()
    assert ModelRunner._block_kernel("torch", "auto") is None


def test_isa_is_what_this_cpu_has():
    flags = cpu_flags()
    expected = ("avx512-vnni" if {"avx512_vnni", "avx512bw"} <= flags else
                "avx-vnni" if {"avx2", "avx_vnni"} <= flags else "avx2" if "avx2" in flags else "scalar")
    assert kernel.isa_name == expected


def test_quant_linear_block_kernel_agrees_with_float_within_int8_noise():
    w = torch.randn(64, 256) * 0.05
    layer = QuantLinear(GroupInt4.quantize(w), None, dense_min_rows=1 << 30, keep_dense=False, block_kernel=kernel)
    x = torch.randn(4, 256)
    exact = F.linear(x, layer.reference_weight)
    rel = (layer(x) - exact).norm() / exact.norm()
    assert rel < 0.02, rel  # int8 activations: about 0.5% relative error


@pytest.mark.parametrize(("isa", "name", "needs"), [
    ("avx512", "avx512-vnni", {"avx512f", "avx512bw", "avx512_vnni"}),
    ("avxvnni", "avx-vnni", {"avx2", "fma", "f16c", "avx_vnni"}),
    ("avx2", "avx2", {"avx2", "fma", "f16c"}),
    ("generic", "scalar", set()),
])
def test_engine_cpu_isa_forces_each_path_this_cpu_has(isa, name, needs):
    """``engine.cpu_isa`` builds the library for that set, and its matmul agrees with the native one:
    to the last bit on the vector paths (the same fused multiply-adds per block), to float rounding
    on the plain C one (a multiply and an add where they fuse)."""
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU lacks {needs - cpu_flags()}")
    forced = kernels.quant_matmul(isa)
    assert forced is not None and forced.isa_name == name
    w = torch.randn(48, 96) * 0.05
    native = QuantLinear(GroupInt4.quantize(w), None, dense_min_rows=1 << 30, keep_dense=False, block_kernel=kernel)
    other = QuantLinear(GroupInt4.quantize(w), None, dense_min_rows=1 << 30, keep_dense=False, block_kernel=forced)
    x = torch.randn(5, 96)
    if name == "scalar":
        torch.testing.assert_close(other(x), native(x), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(native(x), other(x))


def test_a_cpu_isa_this_cpu_lacks_fails_at_once(monkeypatch):
    from stages.engine.runner import quant

    monkeypatch.setattr(quant, "cpu_flags", lambda: frozenset({"sse2"}))
    with pytest.raises(ValueError, match="lacks avx2"):
        kernels.march_for("avx2")
    with pytest.raises(ValueError, match="cpu_isa must be one of"):
        kernels.march_for("neon")
    assert kernels.march_for("generic") == "" and kernels.march_for("auto") == "native"
