"""Load a model's weights for the engine (safetensors or .bin) by their Hugging Face names.

Where a model lives, its tokenizer and config are :mod:`stages.model_info`, shared with the CPU
stages; this module holds only what needs torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
