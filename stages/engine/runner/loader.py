"""Load a model's weights for the engine (safetensors or .bin) by their Hugging Face names.

Where a model lives, its tokenizer and config are :mod:`stages.model_info`, shared with the CPU
stages; this module holds only what needs torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.engine.runner.gguf_table import gguf_tensors
from stages.model_info import resolve_model_dir


def load_state_dict(model: str) -> dict[str, Any]:
    """All weight tensors of ``model`` by their Hugging Face names (safetensors or .bin)."""
    import torch
    from safetensors.torch import load_file

    model_dir = resolve_model_dir(model)
    if not Path(model_dir).is_dir():
        from huggingface_hub import snapshot_download

        model_dir = snapshot_download(str(model_dir), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    files = sorted(Path(model_dir).glob("*.safetensors"))
    state: dict[str, Any] = {}
    if files:
        for f in files:
            state.update(load_file(str(f)))
    else:
        for f in sorted(Path(model_dir).glob("pytorch_model*.bin")):
            state.update(torch.load(f, map_location="cpu", weights_only=True))
    if not state:
        raise FileNotFoundError(f"no weights found in {model_dir}")
    return state


# -- GGUF blocks, read directly for the quantised path ---------------------------------------------

#: GGUF tensor name pieces -> Hugging Face names (Llama layout).
_GGUF_LINEAR = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def split_q4_1(raw: Any) -> tuple[Any, Any, Any]:
    """GGUF Q4_1 rows ``[N, K/32 * 20]`` (uint8) -> ``q`` uint8 ``[N, K]`` in 0..15 and ``d``, ``m``
    float32 ``[N, K/32]``. A block is ``d`` (f16), ``m`` (f16), then 16 bytes whose low nibbles are
    elements 0..15 and high nibbles elements 16..31."""
    import numpy as np
    import torch

    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)
    return torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(m)


def split_q8_0(raw: Any) -> tuple[Any, Any]:
    """GGUF Q8_0 rows ``[N, K/32 * 34]`` -> ``q`` int8 ``[N, K]`` and ``d`` float32 ``[N, K/32]``."""
    import numpy as np
    import torch

    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, -1)
    return torch.from_numpy(q), torch.from_numpy(d)


def unpermute_rows(n_rows: int, n_head: int) -> Any:
    """Row order that undoes llama.cpp's Q/K interleaving (its converter permutes each head's rows
    for its rotary layout; transformers undoes it the same way when it reads a GGUF)."""
    import torch

    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


def read_gguf_linears(tensors: dict[str, Any], num_heads: int, num_kv_heads: int) -> dict[str, Any]:
    """The Q4_1 linear layers among a GGUF's ``tensors`` (:func:`~stages.engine.runner.gguf_table.gguf_tensors`) by Hugging Face name,
    as :class:`GroupInt4`, rows in Hugging Face order. Raises ``ValueError`` for any other block type
    (only Q4_1 maps exactly)."""
    from gguf import GGMLQuantizationType

    from stages.engine.runner.quant import GroupInt4

    out: dict[str, Any] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_LINEAR:
            continue
        if t.tensor_type != GGMLQuantizationType.Q4_1:
            raise ValueError(f"{name} is {t.tensor_type.name}; the int4 path maps Q4_1 only")
        q, d, m = split_q4_1(t.data)
        if parts[2] in ("attn_q", "attn_k"):
            perm = unpermute_rows(q.shape[0], num_heads if parts[2] == "attn_q" else num_kv_heads)
            q, d, m = q[perm], d[perm], m[perm]
        out[f"model.layers.{parts[1]}.{_GGUF_LINEAR[parts[2]]}.weight"] = GroupInt4.from_q4_1(q, d, m)
    return out


def read_gguf_q8_0(tensors: dict[str, Any], name: str = "token_embd.weight") -> Any | None:
    """A Q8_0 tensor among a GGUF's ``tensors`` as :class:`BlockInt8` (its own blocks, exact), or
    None when the file stores it otherwise."""
    from gguf import GGMLQuantizationType

    from stages.engine.runner.quant import BlockInt8

    t = tensors.get(name)
    if t is None or t.tensor_type != GGMLQuantizationType.Q8_0:
        return None
    return BlockInt8.from_q8_0(*split_q8_0(t.data))


def gguf_path(model: str) -> Path | None:
    """The GGUF file behind ``model`` when it is one (the embedded default), else None."""
    from stages.model_info import EMBEDDED_MODEL, embedded_gguf_path

    return embedded_gguf_path() if model == EMBEDDED_MODEL else None


def resolve_weights(weights: str, model: str, device: str) -> str:
    """``auto`` -> the GGUF's own quantisation (int4) for a GGUF model on CPU, else float32."""
    if weights not in ("auto", "float32", "int4", "int8"):
        raise ValueError(f"weights must be auto, float32, int4 or int8, not {weights!r}")
    if weights != "auto":
        if weights != "float32" and not device.startswith("cpu"):
            raise ValueError(f"weights={weights} runs on CPU only (the kernels are CPU kernels)")
        return weights
    if device.startswith("cpu") and gguf_path(model) is not None:
        from stages.engine.runner.quant import int4_kernels_available

        return "int4" if int4_kernels_available() else "float32"
    return "float32"


def quantized_weights(weights: str, model: str, args: Any, state: dict[str, Any],
                      lm_head: str = "auto", block_kernel: bool = False) -> tuple[dict[str, Any], Any | None]:
    """The quantised linear layers (by Hugging Face name) and LM head for ``weights`` int4/int8.

    int4 takes a GGUF's own Q4_1 blocks where there are some, else quantises the float weights
    (group 32, min/max). int8 requantises the float weights (for a GGUF model those are its exact
    dequantisation): in blocks of 32 for the block kernel (``block_kernel``), per output channel for
    torch's. The LM head, when quantised, is the GGUF's own Q8_0 table for ``q8_0`` (block-quantised
    from the float head where there is none) and requantised from the float head otherwise.
    """
    from stages.engine.runner.quant import BlockInt8, ChannelInt8, GroupInt4

    names = [n for n in state if n.startswith("model.layers.") and n.endswith("_proj.weight")]
    gguf = gguf_path(model)
    tensors = gguf_tensors(gguf) if gguf is not None else {}
    if weights == "int4" and gguf is not None:
        linears = read_gguf_linears(tensors, args.num_heads, args.num_kv_heads)
    else:
        fmt = GroupInt4 if weights == "int4" else (BlockInt8 if block_kernel else ChannelInt8)
        linears = {n: fmt.quantize(state[n]) for n in names}
    head_fmt = lm_head if lm_head != "auto" else lm_head_default(weights, block_kernel)
    if head_fmt == "q8_0" and not block_kernel:
        raise ValueError("lm_head=q8_0 needs the block kernel (quant_kernel native)")
    head = None
    if head_fmt != "float":
        w = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        if head_fmt == "q8_0":
            tied = "lm_head.weight" not in state or args.tie_word_embeddings
            head = (read_gguf_q8_0(tensors) if tied else None) or BlockInt8.quantize(w)
        elif head_fmt == "bf16":
            head = w.bfloat16()
        else:
            head = (GroupInt4 if head_fmt == "int4" else ChannelInt8).quantize(w)
    return linears, head


#: LM head format per weight format with torch's kernels (the faster of the two on CPU).
LM_HEAD_DEFAULT = {"int4": "int8", "int8": "int8"}


def lm_head_default(weights: str, block_kernel: bool) -> str:
    """The LM head's format by default: with the block kernel, Q8_0 (for the embedded GGUF its own
    table, exact, and the fastest head measured); otherwise :data:`LM_HEAD_DEFAULT`."""
    return "q8_0" if block_kernel else LM_HEAD_DEFAULT[weights]
