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

The int4 kernel is a memory-bound win at small batch and compute-bound at large batch (at 32 rows it
costs about twice a bfloat16 GEMM on the dense weights). Each quantised layer therefore also keeps a
dense copy of its *dequantised* weights for steps with more than ``dense_min_rows`` rows (prefill
chunks, big decode batches); :func:`dense_dtype` picks bfloat16 where the CPU has native bfloat16
dot products and float32 elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

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
    """The dtype of a quantised layer's dense copy (used for many-row steps)."""
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

    @classmethod
    def from_q4_1(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> GroupInt4:
        """From GGUF Q4_1 (``w = d * q + m`` per block of 32)."""
        return cls(q, d.float(), m.float() + 8 * d.float())

    @classmethod
    def quantize(cls, w: torch.Tensor) -> GroupInt4:
        """Asymmetric min/max quantisation of float weights ``[N, K]`` (K a multiple of 32)."""
        n, k = w.shape
        g = w.float().reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
        return cls(q.reshape(n, k), scale, lo + 8 * scale)

    @staticmethod
    def cat(parts: list[GroupInt4]) -> GroupInt4:
        """Stack along the output dimension (fused q/k/v and gate/up projections)."""
        return GroupInt4(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                         torch.cat([p.zero for p in parts]))

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


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` on quantised ``W``: the quantised kernel up to ``dense_min_rows`` rows,
    a dense GEMM on the dequantised weights above it."""

    def __init__(self, weight: GroupInt4 | ChannelInt8, bias: torch.Tensor | None,
                 dense_min_rows: int = 16, keep_dense: bool = True, cast_output: bool = True) -> None:
        super().__init__()
        #: False: return the kernel's own dtype (bfloat16), for a caller that adds the result to a
        #: float32 tensor anyway (a residual): ``x + y`` promotes exactly, one op instead of two.
        self.cast_output = cast_output
        self.out_features, self.in_features = weight.q.shape
        self.kind = "int4" if isinstance(weight, GroupInt4) else "int8"
        if isinstance(weight, GroupInt4):
            if self.in_features % GROUP:
                raise ValueError(f"int4 needs in_features divisible by {GROUP}")
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32),
                                                                        _INNER_K_TILES)
            sz = torch.stack([weight.scale.t(), weight.zero.t()], dim=-1).bfloat16().contiguous()
            self.register_buffer("qweight", packed)
            self.register_buffer("scales", sz)  # [K/32, N, 2]
        else:
            self.register_buffer("qweight", weight.q.contiguous())
            self.register_buffer("scales", weight.scale.bfloat16())
        self.register_buffer("bias", bias.float() if bias is not None else None)
        self.dense_min_rows = dense_min_rows if keep_dense else 1 << 62
        dense = weight.dequantize().to(dense_dtype()) if keep_dense else None
        self.register_buffer("dense", dense)
        self._source = weight

    @property
    def reference_weight(self) -> torch.Tensor:
        """The float32 weights the quantised kernel computes with (for parity references)."""
        return self._source.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.dense_min_rows:
            assert self.dense is not None
            y = F.linear(x.to(self.dense.dtype), self.dense)
        elif self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.qweight, GROUP,
                                                           self.scales)
        else:
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales)
        if self.bias is not None:
            return y.to(x.dtype) + self.bias
        return y.to(x.dtype) if self.cast_output else y

    def weight_bytes(self, rows: int = 1) -> int:
        """Bytes of weights a forward over ``rows`` rows reads."""
        if rows >= self.dense_min_rows and self.dense is not None:
            return self.dense.numel() * self.dense.element_size()
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 2

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, {self.kind}, dense>={self.dense_min_rows} rows"


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
