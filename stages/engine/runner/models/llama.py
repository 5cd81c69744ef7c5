"""The Llama family (Llama 2/3, SmolLM2, Mistral-style, Qwen2) over a paged KV cache.

Reads a Hugging Face state dict. The forward pass works on a *flattened* batch: the new tokens of
every scheduled sequence are concatenated into one ``[T, hidden]`` tensor, so every linear layer is
one matmul for the whole step whatever the mix of prefill chunks and decodes. Only attention needs
per-sequence structure, which :class:`AttentionMetadata` describes: where each token's K/V goes in
the cache (``slot_mapping``) and which cache slots each query may read.

Numerics deliberately follow transformers' implementation (float32 RMSNorm, rotate-half RoPE from
``position * inv_freq``) so greedy outputs match it token for token on CPU in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stages.engine.runner.prefill_attention import chunk_attention


@dataclass
class LlamaArgs:
    """The architecture numbers, read from a transformers config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf_config(cls, config: Any) -> LlamaArgs:
        """From a transformers config, or ``config.json`` read as attributes (then a key the file
        leaves out takes the default transformers' Llama, Mistral and Qwen2 classes share)."""
        rope_params = getattr(config, "rope_parameters", None) or {}
        rope_scaling = getattr(config, "rope_scaling", None) or (
            rope_params if rope_params.get("rope_type", "default") != "default" else None)
        theta = rope_params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
        heads = config.num_attention_heads
        model_type = getattr(config, "model_type", "llama")
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=getattr(config, "rms_norm_eps", None) or 1e-6,
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=getattr(config, "max_position_embeddings", None) or 2048,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without saying so in ``attention_bias``.
            attention_bias=bool(getattr(config, "attention_bias", False)) or model_type == "qwen2",
        )


@dataclass
class AttentionMetadata:
    """Per-step layout of the flattened batch, built by the model runner.

    Tokens are ordered: first every single-token query (decodes), then each multi-token prefill
    chunk. ``decode_slots[b]`` lists the cache slots of decode ``b``'s whole context (padded;
    ``decode_mask`` marks the real ones). Each prefill is ``(q_start, q_end, ctx_slots, mask)``
    where ``mask`` is the additive mask of :func:`~stages.engine.runner.prefill_attention.chunk_mask`
    in ``prefill_dtype`` (None: causal from position 0).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    #: Set when the only decode's context is the consecutive slots ``decode_range ..
    #: decode_range + width - 1`` (then attention reads the cache in place; ``decode_mask`` is None).
    decode_range: int | None = None
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    #: The paged decode-attention kernel (:mod:`stages.engine.runner.kernels`) when the runner uses it: then
    #: decodes read the cache through ``decode_tables`` (``[B, blocks]`` int32) and
    #: ``decode_ctx_lens`` (``[B]`` int32) in place, and ``decode_slots``/``decode_mask`` are unset.
    #: In a step whose prompts are all short, every prompt token is such a row too (one per token,
    #: its request's table, context = its position + 1): ``num_decodes`` is then every token and
    #: ``prefills`` is empty (``engine.prefill_kernel_max_len``).
    paged_kernel: Any = None
    decode_tables: torch.Tensor | None = None
    decode_ctx_lens: torch.Tensor | None = None
    block_size: int = 16
    kernel_threads: int = 1
    #: FlexAttention over the paged cache (:mod:`stages.engine.runner.flex_paged`) when the runner uses
    #: it: decodes read the blocks ``flex_mask`` lists for their row, in place.
    flex: Any = None
    flex_mask: Any = None
    #: The dtype prompt chunks' attention computes in (None: the model's;
    #: :func:`~stages.engine.runner.prefill_attention.fastest_dtype`).
    prefill_dtype: torch.dtype | None = None
    #: Flattened indices of the tokens whose logits are wanted (one per sampling sequence).
    logits_indices: torch.Tensor | None = None


def _rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = args.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        # Llama 3.1 frequency-dependent scaling, as published with the model.
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_mid, mid, scaled)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One Python call instead of seven; the same float32 arithmetic in the same order
            # (bit-identical to the expression below, checked in the parity tests).
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE as ``x * cos + roll(x, d/2) * [-sin, sin]``: ``roll`` gives ``[x2, x1]`` and
    the signed sine turns it into transformers' ``cat(-x2, x1) * sin`` (a sign flip is exact), in
    four ops instead of seven."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin_signed


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim ** -0.5
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # Queries and keys rotate together: one RoPE over [T, heads + kv_heads, d].
        qk = _apply_rope(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        # Write this step's K/V first so every query reads its own token from the cache too.
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

        nd = meta.num_decodes
        if nd == t:  # decodes only (the steady state): no output buffer to scatter into
            return self.o_proj(self._decode(q, meta, k_cache, v_cache).view(t, self.q_size))
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], meta, k_cache, v_cache)
        dt = meta.prefill_dtype or q.dtype
        for start, end, ctx_slots, mask in meta.prefills:
            # (A cache in another dtype than the compute dtype, e.g. float32 over bfloat16: convert.)
            kp = k_cache.index_select(0, ctx_slots).to(dt)
            vp = v_cache.index_select(0, ctx_slots).to(dt)
            out[start:end] = chunk_attention(q[start:end].to(dt), kp, vp, mask, self.scale)
        return self.o_proj(out.view(t, self.q_size))

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """Attention of the single-token queries ``q`` ``[B, H, d]`` over their cached contexts."""
        if meta.flex is not None:
            return meta.flex(q, k_cache, v_cache, meta.flex_mask, self.scale)
        if meta.paged_kernel is not None:
            out = meta.paged_kernel(q, k_cache, v_cache, meta.decode_tables, meta.decode_ctx_lens,
                                    meta.block_size, self.scale, meta.kernel_threads)
            return out if out.dtype == q.dtype else out.to(q.dtype)  # float32 out; a bfloat16 model casts
        assert meta.decode_slots is not None
        b, width = meta.decode_slots.shape
        if meta.decode_range is not None:
            # One sequence whose context is one run of consecutive slots: read the cache in place.
            start = meta.decode_range
            kd = k_cache[start:start + width].to(q.dtype).transpose(0, 1).unsqueeze(0)
            vd = v_cache[start:start + width].to(q.dtype).transpose(0, 1).unsqueeze(0)
        else:
            flat = meta.decode_slots.view(-1)
            # index_select on the flat slot list is ~4x cheaper than advanced indexing here.
            kd = k_cache.index_select(0, flat).to(q.dtype).view(b, width, self.num_kv_heads, self.head_dim).transpose(1, 2)
            vd = v_cache.index_select(0, flat).to(q.dtype).view(b, width, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # The query heads sharing a KV head become rows of one attention problem per KV head
        # ([B, kvh, group, d]), so no K/V is repeated (head h reads KV head h // group).
        qd = q.view(b, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=self.scale)
        return od.reshape(b, self.num_heads, self.head_dim)  # CUDA kernels may return it strided


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.intermediate = args.intermediate_size
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer whose attention reads and writes a paged KV cache."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", _rope_inv_freq(args), persistent=False)
        self.tie_and_init_buffers()
        #: The whole layer stack of a decode-only step in one kernel call, where it applies
        #: (:meth:`enable_fused_decode`).
        self.fused_decode: Any = None  # a stages.engine.runner.fused_decode.FusedDecode

    def enable_fused_decode(self, kernel: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Run decode-only steps through ``kernel`` (:func:`stages.engine.runner.kernels.decode_layers`)
        when every layer's matmuls are on the block kernel (Q4_1 / Q8_0, no bias) and the caches are
        float32 or bfloat16; returns whether it does."""
        from stages.engine.runner.quant import QuantLinear

        self.fused_decode = None
        mods = [m for layer in self.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                       layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if kernel is None or not all(isinstance(m, QuantLinear) and m.kind in ("q4_1", "q8_0") and m.bias is None
                                     for m in mods):
            return False
        dtypes = {c.dtype for pair in kv_caches for c in pair}
        if self.layers[0].input_layernorm.weight.dtype != torch.float32 or len(dtypes) != 1 or \
                not dtypes <= {torch.float32, torch.bfloat16}:
            return False
        from stages.engine.runner.fused_decode import FusedDecode

        self.fused_decode = FusedDecode(kernel, self, kv_caches, min(m.dense_min_rows for m in mods))
        return True

    def tie_and_init_buffers(self) -> None:
        """Tie the LM head to the embedding when configured and (re)compute RoPE frequencies
        in float32 (the model's cast to its dtype may have rounded them)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        device = self.embed_tokens.weight.device
        self.inv_freq = _rope_inv_freq(self.args).to(device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and *signed* sin (``[-sin, sin]``, see :func:`_apply_rope`) for each position,
        shaped ``[T, 1, head_dim]`` to broadcast over heads."""
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : sin.shape[1] // 2].neg_()
        return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits ``[S, vocab]`` for the tokens at ``meta.logits_indices`` (all tokens if None)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(meta.positions, x.dtype)
        if self.fused_decode is not None and self.fused_decode.applies(meta, x.shape[0]):
            self.fused_decode(x, cos, sin, meta)
        else:
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
                x = layer(x, cos, sin, meta, k_cache, v_cache)
        if meta.logits_indices is not None:
            x = x[meta.logits_indices]  # norm and lm_head only where a token is sampled
        return self.lm_head(self.norm(x))

    def quantize_(self, linears: dict[str, Any], lm_head: Any | None, dense_min_rows: int,
                  block_kernel: Any = None) -> None:
        """Swap every linear layer for a :class:`~stages.engine.runner.quant.QuantLinear` built from
        ``linears`` (quantised weights by Hugging Face name: ``GroupInt4`` or ``ChannelInt8``), fusing
        q/k/v and gate/up as the float layers are fused; ``lm_head`` likewise when given. The
        embedding stays a float table: a step reads only its own tokens' rows."""
        from stages.engine.runner.quant import BlockInt8, DenseLinear, HeadEmbedding, QuantLinear

        def fused(names: list[str], bias: nn.Linear | None = None, residual: bool = False) -> QuantLinear:
            parts = [linears[n] for n in names]
            weight = type(parts[0]).cat(parts) if len(parts) > 1 else parts[0]
            b = bias.bias.detach() if bias is not None and bias.bias is not None else None
            # A layer whose output only feeds the float32 residual add skips its own cast.
            return QuantLinear(weight, b, dense_min_rows, cast_output=not residual, block_kernel=block_kernel)

        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            attn.qkv_proj = fused([p + f"self_attn.{n}_proj.weight" for n in "qkv"], attn.qkv_proj)
            attn.o_proj = fused([p + "self_attn.o_proj.weight"], residual=True)
            layer.mlp.gate_up_proj = fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            layer.mlp.down_proj = fused([p + "mlp.down_proj.weight"], residual=True)
        if isinstance(lm_head, torch.Tensor):  # a bfloat16 table: dense, no requantisation
            self.lm_head = DenseLinear(lm_head)
        elif lm_head is not None:
            # A Q8_0 head on the block kernel never runs dense: it sees one row per sequence that
            # samples, and dense wins only from 64 rows (a full batch), by ~3 ms a step, for 54 MB
            # (bfloat16) or 108 MB (float32) of dense weights, stored or unpacked.
            block_head = block_kernel is not None and isinstance(lm_head, BlockInt8)
            self.lm_head = QuantLinear(lm_head, None, dense_min_rows, keep_dense=not block_head,
                                       block_kernel=block_kernel)
            if self.args.tie_word_embeddings and self.lm_head.kind == "q8_0":
                shared = HeadEmbedding(self.lm_head)
                if torch.equal(shared.weight, self.embed_tokens.weight):
                    # The table is the head's Q8_0 blocks exactly: look rows up there, drop the copy.
                    self.embed_tokens = shared
        if dense_min_rows <= 0:
            self.calibrate_dense_min_rows()

    def calibrate_dense_min_rows(self) -> dict[str, int | None]:
        """Measure, on this machine, where a dense GEMM on the dequantised weights starts to beat
        the quantised kernel: once for the decoder layers' linears and once for the LM head; set
        ``dense_min_rows`` on all of them, and keep a group whose kernel wins at every size tried
        on that kernel (None in the result). Returns the values found."""
        from stages.engine.runner.calibration import (
            BLOCK_CALIBRATION_ROWS,
            CALIBRATION_ROWS,
            calibrate_dense_min_rows,
        )
        from stages.engine.runner.quant import QuantLinear

        linears = [m for layer in self.layers
                   for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                             layer.mlp.down_proj) if isinstance(m, QuantLinear)]
        head = self.lm_head
        groups = {"linears": linears,
                  "lm_head": [head] if isinstance(head, QuantLinear) and head.has_dense else []}
        found: dict[str, int | None] = {}
        for name, mods in groups.items():
            if not mods:
                continue
            block = mods[0].kind in ("q4_1", "q8_0")
            rows = BLOCK_CALIBRATION_ROWS if block else CALIBRATION_ROWS
            found[name] = at = calibrate_dense_min_rows(mods, rows, repeats=3)
            for m in mods:
                if at is not None:
                    m.dense_min_rows = at
                elif block:
                    m.drop_dense()
                else:  # torch's kernels lose to a dense GEMM on prefill-sized chunks: stay dense there
                    m.dense_min_rows = max(rows) * 2
        self.dense_min_rows = found
        return found

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy weights from transformers names, fusing q/k/v and gate/up projections."""
        def take(name: str) -> torch.Tensor:
            return state[name]

        with torch.no_grad():
            self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
            self.norm.weight.copy_(take("model.norm.weight"))
            if not self.args.tie_word_embeddings:
                self.lm_head.weight.copy_(take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                attn = layer.self_attn
                attn.qkv_proj.weight.copy_(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                if attn.qkv_proj.bias is not None:
                    attn.qkv_proj.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                attn.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
                layer.mlp.gate_up_proj.weight.copy_(
                    torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
                layer.mlp.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
                layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))


#: transformers architecture names this module serves.
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
