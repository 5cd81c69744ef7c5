"""Weight-only quantised linear layers for CPU: int4 (group 32) and int8 (per output channel).

Two torch CPU kernels do the work:

- ``aten._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zeros)``: 4-bit weights in groups of 32
  along the input dimension, dequantised as ``(q - 8) * scale + zero``.
- ``aten._weight_int8pack_mm(x, w8, scales)``: int8 weights with one scale per output channel.

Both are only vectorised for bfloat16 activations on CPU (measured on AVX-512: with float32 or
float16 activations they run 15-60x slower than a float32 GEMM), so a quantised linear layer casts
its input to bfloat16 and its output back. Scales and zeros are bfloat16 for the same reason.

GGUF Q4_1 (blocks of 32, ``w = d * q + m``, ``q`` in 0..15) is exactly this int4 format with
``scale = d`` and ``zero = m + 8 * d``: ``(q - 8) * d + m + 8 * d = d * q + m``. Rounding ``d`` and
``m + 8 d`` to bfloat16 is the only change to the weights, and :meth:`GroupInt4.dequantize` returns
the weights the kernel actually uses (the parity tests' reference holds exactly those).

The quantised kernels are a memory-bound win at small batch and compute-bound at large batch (torch's
int4 kernel at 32 rows costs about twice a bfloat16 GEMM on the dense weights). Steps with
``dense_min_rows`` rows or more (prefill chunks, big decode batches) therefore run a dense GEMM on
the *dequantised* weights, in the dtype :func:`dense_dtype` picks (bfloat16 where the CPU has native
bfloat16 dot products, float32 elsewhere). Layers on the block kernel unpack their blocks into a
per-thread scratch buffer just before that GEMM (``kernels/dequant.cpp``), so the process holds one
layer's dense weights, not a copy of the model: a prompt chunk pays the unpacking (a few percent of
its time) instead of the process holding twice the model's bytes. Layers on torch's kernels (where
no compiler built ours) keep a dense copy: their packing cannot be unpacked cheaply.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32
#: Inner-k tiles of the int4 packing; 2 is what the CPU kernel's packing routine expects here.
_INNER_K_TILES = 2


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_fast_bf16() -> bool:
    """True when the CPU has native bfloat16 dot products (AVX512-BF16 or AMX)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def dense_dtype() -> torch.dtype:
    """The dtype of a quantised layer's dense weights (used for many-row steps)."""
    return torch.bfloat16 if has_fast_bf16() else torch.float32


def int4_kernels_available() -> bool:
    """Whether this torch build has the CPU int4 kernels."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


@dataclass
class GroupInt4:
    """4-bit weights in groups of 32 along K: ``w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]``
    with ``g = k // 32``. ``q`` is uint8 in 0..15, ``scale`` and ``zero`` are float32 here and
    rounded to bfloat16 when packed."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    #: The Q4_1 offset ``m`` itself (``w = scale * q + m``), kept exact for the block kernel.
    m: torch.Tensor | None = None

    @classmethod
    def from_q4_1(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> GroupInt4:
        """From GGUF Q4_1 (``w = d * q + m`` per block of 32)."""
        return cls(q, d.float(), m.float() + 8 * d.float(), m.float())

    @classmethod
    def quantize(cls, w: torch.Tensor) -> GroupInt4:
        """Asymmetric min/max quantisation of float weights ``[N, K]`` (K a multiple of 32)."""
        n, k = w.shape
        g = w.float().reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
        return cls(q.reshape(n, k), scale, lo + 8 * scale, lo)

    @staticmethod
    def cat(parts: list[GroupInt4]) -> GroupInt4:
        """Stack along the output dimension (fused q/k/v and gate/up projections)."""
        ms = [p.m for p in parts]
        return GroupInt4(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                         torch.cat([p.zero for p in parts]),
                         torch.cat(ms) if all(m is not None for m in ms) else None)  # type: ignore[misc]

    def q4_1_fp16(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``d`` and ``m`` as the block kernel stores them (fp16; exact for a GGUF's own Q4_1)."""
        m = self.m if self.m is not None else self.zero - 8 * self.scale
        return self.scale.half(), m.half()

    def dequantize_q4_1(self) -> torch.Tensor:
        """The float32 weights the block kernel computes with (fp16 ``d`` and ``m``)."""
        d, m = (v.float() for v in self.q4_1_fp16())
        n, k = self.q.shape
        return (self.q.float().reshape(n, k // GROUP, GROUP) * d[..., None] + m[..., None]).reshape(n, k)

    def kernel_scale_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero as the kernel sees them (bfloat16), as float32."""
        return self.scale.bfloat16().float(), self.zero.bfloat16().float()

    def dequantize(self) -> torch.Tensor:
        """The float32 weights the int4 kernel computes with (bfloat16-rounded scale and zero)."""
        scale, zero = self.kernel_scale_zero()
        n, k = self.q.shape
        q = self.q.float().reshape(n, k // GROUP, GROUP)
        return ((q - 8) * scale[..., None] + zero[..., None]).reshape(n, k)


@dataclass
class ChannelInt8:
    """int8 weights with one scale per output channel: ``w[n, k] = q[n, k] * scale[n]``."""

    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def quantize(cls, w: torch.Tensor) -> ChannelInt8:
        """Symmetric per-channel quantisation of float weights ``[N, K]``; the scale is rounded to
        bfloat16 *before* rounding the weights, so the kernel's scale is the one they were fit to."""
        w = w.float()
        scale = (w.abs().amax(-1) / 127).clamp_min(1e-12).bfloat16().float()
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale)

    @staticmethod
    def cat(parts: list[ChannelInt8]) -> ChannelInt8:
        """Stack along the output dimension."""
        return ChannelInt8(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))

    def dequantize(self) -> torch.Tensor:
        """The float32 weights the int8 kernel computes with."""
        return self.q.float() * self.scale[:, None]


@dataclass
class BlockInt8:
    """int8 weights in blocks of 32 along K, one fp16 scale each (GGUF Q8_0):
    ``w[n, k] = q[n, k] * d[n, k // 32]``. Only the block kernel (``kernels/quant_matmul.cpp``) runs it."""

    q: torch.Tensor
    d: torch.Tensor

    @classmethod
    def from_q8_0(cls, q: torch.Tensor, d: torch.Tensor) -> BlockInt8:
        return cls(q, d.float())

    @classmethod
    def quantize(cls, w: torch.Tensor) -> BlockInt8:
        """Symmetric per-block quantisation (the scale rounded to fp16 first, as it is stored). For
        weights that are a Q8_0 table's exact dequantisation this gives the table back wherever a
        block reaches ±127, which llama.cpp's own quantiser makes every non-zero block do."""
        n, k = w.shape
        g = w.float().reshape(n, k // GROUP, GROUP)
        d = (g.abs().amax(-1) / 127).half().float()
        q = torch.round(g / d.clamp_min(1e-30)[..., None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.reshape(n, k), d)

    @staticmethod
    def cat(parts: list[BlockInt8]) -> BlockInt8:
        return BlockInt8(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]))

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return (self.q.float().reshape(n, k // GROUP, GROUP) * self.d.half().float()[..., None]).reshape(n, k)


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` on quantised ``W``: the quantised kernel up to ``dense_min_rows`` rows,
    a dense GEMM on the dequantised weights above it."""

    def __init__(self, weight: GroupInt4 | ChannelInt8 | BlockInt8, bias: torch.Tensor | None,
                 dense_min_rows: int = 16, keep_dense: bool = True, cast_output: bool = True,
                 block_kernel: Any = None) -> None:
        """``block_kernel`` (:func:`stages.engine.runner.kernels.quant_matmul`): run ``GroupInt4`` and
        ``BlockInt8`` weights on the block kernel (int8 activations, integer dot products) instead
        of torch's int4 kernel (bfloat16 activations)."""
        super().__init__()
        #: False: return the kernel's own dtype (bfloat16), for a caller that adds the result to a
        #: float32 tensor anyway (a residual): ``x + y`` promotes exactly, one op instead of two.
        self.cast_output = cast_output
        self.out_features, self.in_features = weight.q.shape
        self._block = block_kernel
        if isinstance(weight, BlockInt8) and block_kernel is None:
            raise ValueError("BlockInt8 weights need the block kernel")
        if self.in_features % GROUP and not isinstance(weight, ChannelInt8):
            raise ValueError(f"block-quantised weights need in_features divisible by {GROUP}, not {self.in_features}")
        if block_kernel is not None and isinstance(weight, GroupInt4 | BlockInt8):
            self.kind = "q4_1" if isinstance(weight, GroupInt4) else "q8_0"
            if isinstance(weight, GroupInt4):
                wq, wd, wm = pack_q4_1(weight.q, *weight.q4_1_fp16())
            else:
                (wq, wd), wm = pack_q8_0(weight.q, weight.d), None
            self.register_buffer("qweight", wq)
            self.register_buffer("scales", wd)
            self.register_buffer("mins", wm)
        elif isinstance(weight, GroupInt4):
            self.kind = "int4"
            if self.in_features % GROUP:
                raise ValueError(f"int4 needs in_features divisible by {GROUP}")
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32),
                                                                        _INNER_K_TILES)
            sz = torch.stack([weight.scale.t(), weight.zero.t()], dim=-1).bfloat16().contiguous()
            self.register_buffer("qweight", packed)
            self.register_buffer("scales", sz)  # [K/32, N, 2]
        else:
            self.kind = "int8"
            self.register_buffer("qweight", weight.q.contiguous())
            self.register_buffer("scales", weight.scale.bfloat16())
        self.register_buffer("bias", bias.float() if bias is not None else None)
        self.dense_min_rows = dense_min_rows if keep_dense else 1 << 62
        self.dense_dtype = dense_dtype()
        # The block kernel's buffers hold everything (reference_weight unpacks them); torch's int4
        # packing is opaque, so those layers keep their source, and a dense copy when they may use one.
        self._source = None if self.kind in ("q4_1", "q8_0") else weight
        stored = keep_dense and self._block is None
        self.register_buffer("dense", self.reference_weight.to(self.dense_dtype) if stored else None)

    @property
    def reference_weight(self) -> torch.Tensor:
        """The float32 weights the quantised kernel computes with (for parity references)."""
        if self.kind == "q4_1":
            return unpack_q4_1(self.qweight, self.scales, self.mins, self.out_features)
        if self.kind == "q8_0":
            return unpack_q8_0(self.qweight, self.scales, self.out_features)
        assert self._source is not None
        return self._source.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense_matmul(x) if x.shape[0] >= self.dense_min_rows else self.quant_matmul(x)
        if self.bias is not None:
            return y.to(x.dtype) + self.bias
        return y.to(x.dtype) if self.cast_output else y

    def quant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` by the quantised kernel (bfloat16 out, float32 from the block kernel; no bias)."""
        if self.kind == "q4_1":
            return self._block.q4_1(x.float().contiguous(), self.qweight, self.scales, self.mins,
                                    self.out_features, torch.get_num_threads())
        if self.kind == "q8_0":
            return self._block.q8_0(x.float().contiguous(), self.qweight, self.scales, self.out_features,
                                    torch.get_num_threads())
        if self.kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.qweight, GROUP,
                                                              self.scales)
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales)

    @property
    def has_dense(self) -> bool:
        """Whether steps of ``dense_min_rows`` rows or more run a dense GEMM."""
        return self.dense_min_rows < 1 << 62

    def drop_dense(self) -> None:
        """Always the quantised kernel (frees a stored dense copy)."""
        self.dense = None
        self.dense_min_rows = 1 << 62

    def dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` on the dequantised weights (no bias): unpacked into this thread's scratch
        buffer for the block kernel's layers, the stored copy for torch's."""
        if self.dense is not None:
            return F.linear(x.to(self.dense.dtype), self.dense)
        assert self._block is not None, "dense_matmul on a layer without dense weights"
        w = _scratch(self.out_features, self.in_features, self.dense_dtype)
        self._block.unpack(self.qweight, self.scales, self.mins, w, torch.get_num_threads())
        return F.linear(x.to(w.dtype), w)

    def weight_bytes(self, rows: int = 1) -> int:
        """Bytes of weights a forward over ``rows`` rows reads from memory."""
        if rows >= self.dense_min_rows and self.dense is not None:
            return self.dense.numel() * self.dense.element_size()
        extra = self.mins.numel() * 2 if getattr(self, "mins", None) is not None else 0
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 2 + extra

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, {self.kind}, dense>={self.dense_min_rows} rows"


_thread = threading.local()


def _scratch(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer for one layer's unpacked weights, ``[n, k]`` of ``dtype``: reused by
    every layer (the GEMM that reads it returns before the next layer unpacks), grown to the
    largest layer. Per thread, so two engines in one process never share it."""
    buf = getattr(_thread, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < n * k:
        buf = _thread.buf = torch.empty(n * k, dtype=dtype)
    return buf[: n * k].view(n, k)


def release_scratch() -> None:
    """Drop this thread's unpack buffer (the loading thread's, after calibration: the step thread
    grows its own)."""
    _thread.buf = None


class DenseLinear(nn.Module):
    """A bias-free linear layer on bfloat16 weights with float32 in and out (an LM head kept dense
    but at half the bytes of float32; no requantisation)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.bfloat16().contiguous())
        self.out_features, self.in_features = weight.shape

    @property
    def reference_weight(self) -> torch.Tensor:
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)


class HeadEmbedding(nn.Module):
    """The token embedding read from a tied Q8_0 LM head's own blocks: a step's rows are unpacked as
    they are looked up, so the model holds no float32 copy of the table (the embedded model's is
    113 MB). Only where that is exact: :meth:`LlamaForCausalLM.quantize_` checks the whole table."""

    def __init__(self, head: QuantLinear) -> None:
        super().__init__()
        assert head.kind == "q8_0"
        self.head = [head]  # not a submodule: its buffers belong to the LM head
        self.embedding_dim = head.in_features

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, unpacked (for checks; a forward unpacks only its rows)."""
        head = self.head[0]
        return unpack_q8_0(head.qweight, head.scales, head.out_features)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        t, nb = head.qweight.shape[:2]
        tile, row = ids // TILE, ids % TILE
        q = head.qweight.view(t, nb, 8, TILE, 4)[tile, :, :, row, :]           # [rows, nb, 8, 4]
        d = head.scales[tile, :, row].float()                                    # [rows, nb]
        return (q.reshape(len(ids), nb, GROUP).float() * d[..., None]).reshape(len(ids), nb * GROUP)


#: Output rows per tile of the block-quantised kernels (``kernels/quant_matmul.cpp``).
TILE = 16


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """Pad dim 0 of ``t`` to a multiple of :data:`TILE` with zeros."""
    pad = -t.shape[0] % TILE
    return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 ``q`` uint8 ``[N, K]`` (0..15), ``d`` and ``m`` ``[N, K/32]`` -> the kernel's tile layout:
    nibbles ``[T, K/32, 4, 64]`` (chunk c, byte 4n+i: element 4c+i low, 16+4c+i high) and fp16
    ``d``, ``m`` ``[T, K/32, 16]``."""
    q, d, m = _tiles(q), _tiles(d), _tiles(m)
    n, k = q.shape
    g = q.view(n // TILE, TILE, k // GROUP, 8, 4)
    packed = g[:, :, :, :4] | (g[:, :, :, 4:] << 4)                      # [T, 16, nb, 4, 4]
    packed = packed.permute(0, 2, 3, 1, 4).reshape(n // TILE, k // GROUP, 4, 64).contiguous()

    def scales(v: torch.Tensor) -> torch.Tensor:
        return v.half().view(n // TILE, TILE, k // GROUP).permute(0, 2, 1).contiguous()

    return packed, scales(d), scales(m)


def pack_q8_0(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 ``q`` int8 ``[N, K]``, ``d`` ``[N, K/32]`` -> int8 ``[T, K/32, 8, 64]`` (chunk g, byte
    4n+i: element 4g+i) and fp16 ``d`` ``[T, K/32, 16]``."""
    q, d = _tiles(q), _tiles(d)
    n, k = q.shape
    packed = q.view(n // TILE, TILE, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4).reshape(n // TILE, k // GROUP, 8, 64)
    return packed.contiguous(), d.half().view(n // TILE, TILE, k // GROUP).permute(0, 2, 1).contiguous()


def unpack_q4_1(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 weights ``[n, K]`` of :func:`pack_q4_1`'s layout: ``q * d + m`` per block, exactly
    :meth:`GroupInt4.dequantize_q4_1`."""
    t, nb = packed.shape[:2]
    g = packed.view(t, nb, 4, TILE, 4).permute(0, 3, 1, 2, 4)               # [T, 16, nb, 4, 4]
    q = torch.cat([g & 0x0F, g >> 4], dim=3).reshape(t * TILE, nb, GROUP)   # groups 0-3 low, 4-7 high
    w = q.float() * _unscale(d)[..., None] + _unscale(m)[..., None]
    return w.reshape(t * TILE, nb * GROUP)[:n]


def unpack_q8_0(packed: torch.Tensor, d: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 weights ``[n, K]`` of :func:`pack_q8_0`'s layout, exactly :meth:`BlockInt8.dequantize`."""
    t, nb = packed.shape[:2]
    q = packed.view(t, nb, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(t * TILE, nb, GROUP)
    return (q.float() * _unscale(d)[..., None]).reshape(t * TILE, nb * GROUP)[:n]


def _unscale(v: torch.Tensor) -> torch.Tensor:
    """fp16 scales ``[T, nb, 16]`` -> float32 ``[T*16, nb]``."""
    t, nb, _ = v.shape
    return v.permute(0, 2, 1).reshape(t * TILE, nb).float()
