"""Attention of a prompt chunk over its context: one tiled SDPA call per chunk and layer.

A chunk's context (its request's earlier positions plus its own) is gathered from the paged cache
once per layer, a copy linear in the context, and torch's flash-attention kernel then tiles queries
and keys with an online softmax, so no query row re-reads the whole context on its own (the decode
kernel's way, which makes a long prompt's reads quadratic). Chunks after the first see their
context through an additive mask built once per step in the compute dtype (a boolean one is
converted inside every call).

On CPU the compute dtype is measured once at load: bfloat16 when the cache already holds bfloat16
and torch's bfloat16 kernel beats float32 on this CPU (AMX or AVX512-BF16 run it natively, about 3x
float32; without them it is emulated and slower), else the model's dtype. Rounding the queries to
bfloat16 adds an error of the size the bfloat16 cache already puts on the keys.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

#: The shape the dtypes are timed on: a 256-token chunk whose context ends at 1,024 tokens.
PROBE_ROWS, PROBE_CONTEXT = 256, 1024


def chunk_mask(start: int, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Additive ``[rows, start + rows]`` mask of a chunk whose first query sits at position ``start``
    (query ``i`` sees context positions ``<= start + i``); None for a chunk from position 0, which
    runs as plain causal attention."""
    if start == 0:
        return None
    q_pos = torch.arange(start, start + rows, device=device)[:, None]
    hidden = torch.arange(start + rows, device=device)[None, :] > q_pos
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """``q`` ``[rows, heads, d]`` over ``k``/``v`` ``[context, kv_heads, d]`` (the context in position
    order, the chunk's own rows last), all in the compute dtype; returns ``[rows, heads, d]``."""
    qp = q.transpose(0, 1).unsqueeze(0)
    kp = k.transpose(0, 1).unsqueeze(0)
    vp = v.transpose(0, 1).unsqueeze(0)
    if mask is None:
        # Torch's flash kernel skips the masked half of a causal square; an explicit mask costs ~2x.
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def fastest_dtype(model_dtype: torch.dtype, cache_dtype: torch.dtype, heads: int, kv_heads: int,
                  head_dim: int, threads: int, repeats: int = 3) -> torch.dtype:
    """The dtype prompt chunks' attention runs fastest in on this CPU: bfloat16 or ``model_dtype``
    (timed on a :data:`PROBE_ROWS`-row chunk, each side as the step would run it: the float side
    converts the bfloat16 cache rows first). Only a bfloat16 cache under a float32 model has a
    choice."""
    if cache_dtype != torch.bfloat16 or model_dtype != torch.float32:
        return model_dtype
    gen = torch.Generator().manual_seed(0)
    start = PROBE_CONTEXT - PROBE_ROWS
    q = torch.randn(PROBE_ROWS, heads, head_dim, generator=gen)
    k = torch.randn(PROBE_CONTEXT, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v = torch.randn(PROBE_CONTEXT, kv_heads, head_dim, generator=gen).to(cache_dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timings = {}
        for dtype in (torch.bfloat16, model_dtype):
            mask = chunk_mask(start, PROBE_ROWS, dtype, q.device)
            runs = []
            for _ in range(repeats + 1):  # the first call warms the kernel up
                t0 = time.perf_counter()
                chunk_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, head_dim ** -0.5).to(model_dtype)
                runs.append(time.perf_counter() - t0)
            timings[dtype] = statistics.median(runs[1:])
    finally:
        torch.set_num_threads(before)
    return min(timings, key=timings.__getitem__)
