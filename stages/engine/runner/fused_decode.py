"""A decode step's whole layer stack as one call into ``kernels/decode_layers.cpp``.

Chosen by :meth:`stages.engine.runner.models.llama.LlamaForCausalLM.enable_fused_decode` where every
matmul is on the block kernel; the model's forward hands it the steps whose rows are all
single-token queries over the paged kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.engine.runner.models.llama import AttentionMetadata


class FusedDecode:
    """The decoder layers of a step whose rows are all single-token queries over the paged kernel,
    as one call into ``decode_layers.cpp``: the same arithmetic as :class:`~stages.engine.runner.models.llama.DecoderLayer` op for op,
    without ~25 torch dispatches per layer. Keeps the address table of every weight and cache
    buffer it reads (the model and the runner keep the buffers)."""

    def __init__(self, kernel: Any, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_rows: int) -> None:
        args = model.args
        self.kernel = kernel
        #: Rows from which the matmuls switch to dense GEMMs: the per-op path runs those.
        self.max_rows = max_rows
        self.dims = (args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim, args.intermediate_size)
        self.eps = float(model.layers[0].input_layernorm.eps)
        self.scale = float(model.layers[0].self_attn.scale)
        self.cache_bf16 = kv_caches[0][0].dtype == torch.bfloat16

        def linear(m: Any) -> list[int]:
            return [m.qweight.data_ptr(), m.scales.data_ptr(), m.mins.data_ptr() if m.mins is not None else 0]

        rows = []
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            assert all(t.is_contiguous() for t in (k_cache, v_cache, layer.input_layernorm.weight))
            rows.append([layer.input_layernorm.weight.data_ptr(), *linear(attn.qkv_proj), *linear(attn.o_proj),
                         *linear(mlp.gate_up_proj), *linear(mlp.down_proj),
                         layer.post_attention_layernorm.weight.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()])
        self.table = torch.tensor(rows, dtype=torch.int64)
        if self.table.shape[1] != kernel.nptr:
            raise RuntimeError(f"decode_layers expects {kernel.nptr} addresses per layer, not {self.table.shape[1]}")

    def applies(self, meta: AttentionMetadata, rows: int) -> bool:
        return meta.paged_kernel is not None and meta.num_decodes == rows and rows < self.max_rows

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> None:
        """``x`` ``[rows, hidden]`` float32, in place; ``cos``/``sin`` as :meth:`~stages.engine.runner.models.llama.LlamaForCausalLM.rope`."""
        assert meta.decode_tables is not None and meta.decode_ctx_lens is not None
        t = x.shape[0]
        self.kernel(x, self.dims, self.table, self.eps, cos.reshape(t, -1).contiguous(),
                    sin.reshape(t, -1).contiguous(), meta.slot_mapping.contiguous(), self.cache_bf16,
                    meta.decode_tables, meta.decode_ctx_lens, meta.block_size, self.scale, meta.kernel_threads)
