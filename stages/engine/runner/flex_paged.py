"""Paged decode attention through FlexAttention: torch's own route to a paged kernel on any device.

Each decode row's block table becomes the row of a ``BlockMask`` over the *physical* cache: the
cache ``[slots, kv_heads, d]`` is viewed (not copied) as one batch-1 sequence ``[1, kv_heads,
slots, d]``, and row ``b`` lists the physical blocks it may read. FlexAttention then visits only
those blocks, so no per-layer gather of every block is made; on CUDA it compiles to a Triton
(flex-decoding) kernel, on CPU to inductor's C++ template.

The blocks of a row split in two, as FlexAttention wants them:

- *full* blocks (every slot is context): listed in ``full_kv_indices``, read with no mask;
- the last block when the context ends inside it: listed in ``kv_indices``, read through a
  ``mask_mod``. Only that one block pays for the mask.

The ``mask_mod`` is exact on its own: it reads a ``[rows, blocks]`` table of how many slots of
each physical block row ``b`` may see (``block_size`` for its full blocks, the context's tail for
its last one, 0 for every block it does not own). The block lists are only the sparsity that lets
the compiled kernel skip the rest. That matters because uncompiled FlexAttention (torch falls back
to it silently, e.g. past dynamo's recompile limit) ignores the block lists and applies the
``mask_mod`` to every slot of the cache: a mask that only looked at the slot within a block would
then let each row read every request's blocks.

A block shared by several rows (the prefix cache) is simply listed by each of them.

Every index tensor lives in a buffer sized for ``max_rows``, and each step writes into it in
place. That is what a CUDA graph needs (:mod:`stages.engine.runner.decode_graphs`): a graph captured
over these buffers reads whatever the step wrote there. Rows past a step's real ones (a batch
padded up to a captured size) read one slot of the scratch block, which no request owns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention


class FlexPagedAttention:
    """Block masks over a paged KV cache, and the compiled FlexAttention call that reads them.

    ``num_blocks`` counts every block of the cache tensor, the scratch block included;
    ``scratch_block`` is the one that padded rows read (and that padded tokens' K/V go to)."""

    def __init__(self, num_blocks: int, block_size: int, scratch_block: int, max_rows: int,
                 device: torch.device, compile: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_rows = max_rows
        self.device = device
        i32 = {"dtype": torch.int32, "device": device}
        # FlexAttention's CPU lowering wants the index tensors as wide as the whole (physical)
        # KV length, so each row has room for every block; a step writes only its tables' width.
        self.full_num = torch.zeros(max_rows, 1, 1, **i32)
        self.full_idx = torch.zeros(max_rows, 1, 1, num_blocks, **i32)
        self.part_num = torch.zeros(max_rows, 1, 1, **i32)
        self.part_idx = torch.zeros(max_rows, 1, 1, num_blocks, **i32)
        # Slots of each physical block a row may read (see the module docstring); one column more
        # than the cache has blocks, where the fill scatters what belongs to no block.
        self.visible = torch.zeros(max_rows, num_blocks + 1, **i32)
        self._cols = torch.arange(num_blocks, dtype=torch.int32, device=device)
        # Row counts are rounded up to a few sizes (:meth:`rows_for`) and the kernel is compiled
        # static for each: the sizes are the CUDA graphs' own, and (torch 2.13) with a dynamic
        # batch inductor's CPU template emitted a bounds check naming a size it never declared.
        self.sizes = row_sizes(max_rows)
        if compile:
            # One compiled kernel per size (the query is made contiguous, so a strided view and a
            # padded copy do not compile twice). Dynamo's default limit of 8 per function is below
            # the sizes ``max_num_seqs`` 64 needs (11); past it torch falls back to uncompiled
            # FlexAttention, which is slow and, without an exact mask, was wrong. Only raised.
            import torch._dynamo.config as dynamo_config

            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, len(self.sizes) + 8)
        self._attend = torch.compile(flex_attention, dynamic=False) if compile else flex_attention
        # On CUDA, the general Triton kernel with a KV tile of one cache block. It needs the block
        # mask's KV block (one cache block, 16 slots) to be a multiple of its KV tile, and its
        # default tiles on sm_90 are 32-128. The flex-decoding kernel is forced off because it
        # cannot serve: it takes only power-of-two query heads per KV head (SmolLM2 has 9 / 3),
        # and it skips every config whose tile does not divide the block, which can leave none.
        # The older knob, not ``BACKEND``, which the lent machine's torch 2.11 may not know. CPU
        # keeps its template's own choice.
        self._kernel_options = ({"BLOCK_N": block_size, "FORCE_USE_FLEX_ATTENTION": True}
                                if device.type == "cuda" else None)
        self._masks: dict[int, BlockMask] = {}

    def rows_for(self, n: int) -> int:
        """The padded row count for ``n`` decode rows: the smallest size ``>= n``."""
        for size in self.sizes:
            if size >= n:
                return size
        raise ValueError(f"{n} decode rows: at most {self.max_rows}")

    def mask(self, rows: int) -> BlockMask:
        """The block mask over the first ``rows`` rows of the buffers (one object per row count,
        views of the same storage, so a captured graph sees later writes)."""
        if rows not in self._masks:
            visible, bs = self.visible, self.block_size

            def partial_block(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return (kv_idx % bs) < visible[b, kv_idx // bs]

            # Query tiles of 128 (one tile holds the single query; the Triton kernels need the
            # query tile to be a multiple of their 16-row block), KV tiles of one cache block.
            self._masks[rows] = BlockMask.from_kv_blocks(
                self.part_num[:rows], self.part_idx[:rows], self.full_num[:rows], self.full_idx[:rows],
                BLOCK_SIZE=(128, bs), mask_mod=partial_block, seq_lengths=(1, self.num_blocks * bs),
                compute_q_blocks=False)  # inference only: no backward, so no transposed index
        return self._masks[rows]

    def fill(self, tables: list[list[int]], ctx_lens: list[int], rows: int | None = None) -> BlockMask:
        """Write the step's decode rows (``tables[b]``: physical block ids, ``ctx_lens[b]``: tokens
        of context including the new one) into the buffers; rows ``len(tables)..rows-1`` become
        padding that reads one slot of the scratch block. ``rows`` defaults to :meth:`rows_for`.
        Returns the mask for ``rows``."""
        n = len(tables)
        rows = self.rows_for(n) if rows is None else rows
        if not n <= rows <= self.max_rows:
            raise ValueError(f"{n} decode rows padded to {rows}: at most {self.max_rows}")
        bs, pad = self.block_size, rows - n
        tail = [c % bs for c in ctx_lens]  # tokens in a partial last block (0: none)
        width = max((len(t) for t in tables), default=1)
        # Built on the host as one tensor per field, then one copy each. A padded row has no full
        # block and reads one slot of the scratch block.
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad, dtype=torch.int32)
        full_num = torch.tensor([c // bs for c in ctx_lens] + [0] * pad, dtype=torch.int32)
        has_part = torch.tensor([int(r > 0) for r in tail] + [1] * pad, dtype=torch.int32)
        part = torch.tensor([t[c // bs] if r else 0 for t, c, r in zip(tables, ctx_lens, tail, strict=True)]
                            + [self.scratch_block] * pad, dtype=torch.int32)
        last = torch.tensor([r or bs for r in tail] + [1] * pad, dtype=torch.int32)
        self.full_num[:rows, 0, 0].copy_(full_num, non_blocking=True)
        self.full_idx[:rows, 0, 0, :width].copy_(table, non_blocking=True)
        self.part_num[:rows, 0, 0].copy_(has_part, non_blocking=True)
        self.part_idx[:rows, 0, 0, 0].copy_(part, non_blocking=True)
        self._fill_visible(rows, width, last.to(self.device, non_blocking=True))
        return self.mask(rows)

    def _fill_visible(self, rows: int, width: int, last: torch.Tensor) -> None:
        """Rebuild ``visible[:rows]`` from the index buffers just written and ``last`` (slots of
        each row's last block), on their device (a few small ops; no per-block host work). Table
        columns past a row's full blocks, and a row with no partial block, scatter into the spare
        last column."""
        spare = self.num_blocks
        vis = self.visible[:rows]
        vis.zero_()
        cols = self._cols[:width].unsqueeze(0)
        full = self.full_idx[:rows, 0, 0, :width]
        full = torch.where(cols < self.full_num[:rows, 0], full, spare)
        vis.scatter_(1, full.long(), self.block_size)
        part = torch.where(self.part_num[:rows, 0, 0] > 0, self.part_idx[:rows, 0, 0, 0], spare)
        vis.scatter_(1, part.long().unsqueeze(1), last.unsqueeze(1))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: BlockMask,
                 scale: float) -> torch.Tensor:
        """Attention of ``q`` ``[n, heads, d]`` (one query per row) over the cache ``[slots,
        kv_heads, d]`` as ``mask`` allows; returns ``[n, heads, d]`` in ``q``'s dtype. ``q`` may
        have fewer rows than ``mask`` (the padded count): the rest are computed on zeros and dropped."""
        n, rows = q.shape[0], mask.kv_num_blocks.shape[0]
        if n < rows:
            q = torch.cat([q, q.new_zeros((rows - n, *q.shape[1:]))])
        # FlexAttention wants one dtype: read a cache kept in another (bfloat16 under float32) as
        # q's, by rounding q instead of converting the whole cache. Contiguous either way: the
        # compiled kernel is specialised on strides too (see ``__init__``).
        q_in = q.to(k_cache.dtype).contiguous()
        k = k_cache.unsqueeze(0).transpose(1, 2)  # [1, kv_heads, slots, d], a view
        v = v_cache.unsqueeze(0).transpose(1, 2)
        out = self._attend(q_in.unsqueeze(2), k, v, block_mask=mask, scale=scale, enable_gqa=True,
                           kernel_options=self._kernel_options)
        return out.squeeze(2)[:n].to(q.dtype)


def row_sizes(max_rows: int) -> list[int]:
    """Padded decode-row counts up to ``max_rows``: 1, 2, 4, then every 8 (as vLLM captures)."""
    sizes = [s for s in (1, 2, 4) if s <= max_rows]
    sizes += list(range(8, max_rows + 1, 8))
    if not sizes or sizes[-1] != max_rows:
        sizes.append(max_rows)
    return sizes
