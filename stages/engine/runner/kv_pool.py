"""The KV cache's tensors: every layer's K and V in one allocation.

On CPU the pool is one anonymous memory mapping: the kernel hands out its pages zeroed on first
write, so a pool of ``kv_cache_memory_gb`` costs resident memory only for the blocks requests have
used, and grows to the whole pool only once traffic has touched every block (the block manager
hands out never-used blocks before reclaiming cached ones, to keep prefixes findable longest).
``torch.zeros`` would write every page at start. Elsewhere the tensors are ``torch.zeros`` on the
device.
"""

from __future__ import annotations

import math
import mmap

import torch


def allocate(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_layers`` (K, V) pairs of zeroed ``shape`` tensors."""
    if device.type != "cpu":
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)]
    per_tensor = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(1, 2 * num_layers * per_tensor))  # anonymous: zero pages, committed on write
    flat = torch.frombuffer(pages, dtype=torch.uint8)  # the tensor keeps the mapping alive
    tensors = [flat[i * per_tensor:(i + 1) * per_tensor].view(dtype).view(shape) for i in range(2 * num_layers)]
    return list(zip(tensors[0::2], tensors[1::2], strict=True))
