"""Unpacking GGUF blocks to dense weights (stages/engine/runner/kernels/dequant.cpp), the weights a
prompt chunk's GEMM reads: bit for bit what ``quant.unpack_q4_1`` / ``unpack_q8_0`` give, cast to
bfloat16 or float32 as torch casts, on every instruction set this CPU can run."""

from __future__ import annotations

import ctypes
import functools
import threading

import pytest
import torch
import torch.nn.functional as F

from stages.engine.runner import kernels
from stages.engine.runner.quant import (
    BlockInt8,
    GroupInt4,
    QuantLinear,
    _scratch,
    cpu_flags,
    pack_q4_1,
    pack_q8_0,
    unpack_q4_1,
    unpack_q8_0,
)

kernel = kernels.quant_matmul()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler here: torch's int4/int8 kernels run")

#: ``-march`` per path, with the flags it needs: the native build, AVX-512 without native bfloat16
#: rounding (Skylake's set: the integer rounding path), AVX2 and plain C.
MARCHES = {
    "native": ("native", set()),
    "avx512-no-bf16": ("skylake-avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx2": ("haswell", {"avx2", "fma", "f16c"}),
    "generic": ("", set()),
}


@functools.cache
def built(path: str) -> kernels.QuantMatmul:
    march, needs = MARCHES[path]
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU lacks {needs - cpu_flags()}")
    return kernels.QuantMatmul(ctypes.CDLL(str(kernels.build(march=march))))


def q4_1_blocks(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]  # scales across 4 decades
    q = GroupInt4.quantize(w)
    return pack_q4_1(q.q, *q.q4_1_fp16())


def q8_0_blocks(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b = BlockInt8.quantize(torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None])
    return pack_q8_0(b.q, b.d)


SHAPES = [(1, 32), (5, 64), (16, 32), (17, 96), (48, 576), (577, 64)]  # tails of a 16-row tile


@pytest.mark.parametrize("path", list(MARCHES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_unpack_is_the_reference_bit_for_bit(path, dtype, n, k):
    lib = built(path)
    wq, wd, wm = q4_1_blocks(n, k, seed=n * k)
    out = torch.full((n, k), float("nan"), dtype=dtype)
    assert lib.unpack(wq, wd, wm, out, 2) is out
    assert torch.equal(out, unpack_q4_1(wq, wd, wm, n).to(dtype))
    bq, bd = q8_0_blocks(n, k, seed=n + k)
    out = torch.full((n, k), float("nan"), dtype=dtype)
    lib.unpack(bq, bd, None, out, 1)
    assert torch.equal(out, unpack_q8_0(bq, bd, n).to(dtype))


@pytest.mark.parametrize("path", list(MARCHES))
def test_bfloat16_ties_round_to_even(path):
    """d = 1 + 2^-8 is halfway between two bfloat16 values: q = 1 must give 1.0 (even), and
    -(1 + 3 * 2^-8) must round away to the even -1.015625."""
    lib = built(path)
    n, k = 16, 32
    q = torch.ones(n, k, dtype=torch.int8)
    q[1] = -1
    d = torch.full((n, 1), 1 + 2**-8)
    d[1] = 1 + 3 * 2**-8
    bq, bd = pack_q8_0(q, d)
    out = torch.empty(n, k, dtype=torch.bfloat16)
    lib.unpack(bq, bd, None, out, 1)
    assert out[0, 0].item() == 1.0 and out[1, 0].item() == -1.015625
    assert torch.equal(out, unpack_q8_0(bq, bd, n).bfloat16())


def test_unpack_refuses_a_buffer_of_the_wrong_shape_or_dtype():
    wq, wd, wm = q4_1_blocks(32, 64, seed=0)
    for out in (torch.empty(32, 96, dtype=torch.bfloat16), torch.empty(33, 64, dtype=torch.bfloat16),
                torch.empty(32, 64, dtype=torch.float16), torch.empty(64, 32, dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError):
            kernel.unpack(wq, wd, wm, out, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_dense_step_keeps_no_copy_and_gives_the_copys_result(monkeypatch, dtype):
    """A block-kernel layer from ``dense_min_rows`` rows: the GEMM on its unpacked weights, exactly
    what the same GEMM on a stored copy gives, with no dense tensor held by the layer."""
    from stages.engine.runner import quant

    monkeypatch.setattr(quant, "dense_dtype", lambda: dtype)
    layers = [QuantLinear(GroupInt4.quantize(torch.randn(n, k) * 0.05), None, dense_min_rows=8, block_kernel=kernel)
              for n, k in ((96, 64), (40, 32), (96, 64))]  # a smaller layer between two larger ones
    for layer in layers:
        assert layer.dense is None and layer.has_dense
        assert all(b.dtype != dtype for b in layer.buffers())  # only the blocks and their scales
        x = torch.randn(9, layer.in_features)
        want = F.linear(x.to(dtype), layer.reference_weight.to(dtype)).float()
        assert torch.equal(layer(x), want)
        small = torch.randn(3, layer.in_features)  # under dense_min_rows: the block kernel
        assert torch.equal(layer(small), layer.quant_matmul(small))


def test_each_thread_unpacks_into_its_own_buffer():
    here = _scratch(16, 32, torch.bfloat16)
    there: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: there.append(_scratch(16, 32, torch.bfloat16)))
    t.start()
    t.join()
    assert here.data_ptr() != there[0].data_ptr()
    assert _scratch(8, 32, torch.bfloat16).data_ptr() == here.data_ptr()  # reused, not reallocated
