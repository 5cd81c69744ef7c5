"""Decode steps replayed from CUDA graphs captured at fixed batch sizes.

A decode step of a small model on a GPU is launch-bound: ~400 kernels of a few microseconds
each, every one launched from Python. Captured once per batch size into a CUDA graph, the whole
forward is one launch. A graph replays fixed addresses and shapes, so:

- its inputs live in static buffers (token ids, positions, cache slots here; the attention's
  block tables in :class:`~stages.engine.runner.flex_paged.FlexPagedAttention`'s buffers), which each
  step overwrites before the replay;
- a step of ``n`` decodes runs the graph of the smallest captured size ``>= n``; the extra rows
  are padding that writes its K/V into the scratch block and reads one slot of it;
- steps with prompt tokens run eagerly.

``mode="static"`` runs the same padded, static-buffer forward without capturing: the CPU tests
check with it that padding and buffer reuse leave every real row's logits as the eager step's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from stages.engine.runner.flex_paged import FlexPagedAttention
from stages.engine.runner.models.llama import AttentionMetadata

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """Replays decode-only steps from graphs captured (``mode="cuda"``) or run eagerly over the
    same static buffers (``mode="static"``)."""

    def __init__(self, model: Callable[..., torch.Tensor], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 flex: FlexPagedAttention, device: torch.device, mode: str = "cuda") -> None:
        if mode not in ("cuda", "static"):
            raise ValueError(f"decode graph mode must be cuda or static, not {mode!r}")
        if mode == "cuda" and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.kv_caches = kv_caches
        self.flex = flex
        #: Captured sizes: the attention's own padded row counts (1, 2, 4, then every 8), so a
        #: replayed step and an eager one use the same compiled kernels.
        self.sizes = flex.sizes
        self.max_size = flex.max_rows
        self.mode = mode
        self.device = device
        long = {"dtype": torch.long, "device": device}
        self.input_ids = torch.zeros(self.max_size, **long)
        self.positions = torch.zeros(self.max_size, **long)
        self.slot_mapping = torch.zeros(self.max_size, **long)
        #: Where padded tokens write their K/V: the first slot of the scratch block.
        self.pad_slot = flex.scratch_block * flex.block_size
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        #: Steps replayed, by size (for the benchmark and the tests).
        self.replays: dict[int, int] = {}

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
                                 num_decodes=size, flex=self.flex, flex_mask=self.flex.mask(size))
        return self.model(self.input_ids[:size], meta, self.kv_caches)

    def _load(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
              ctx_lens: list[int], size: int) -> None:
        n = len(ids)
        pad = size - n
        host = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [self.pad_slot] * pad], dtype=torch.long)
        self.input_ids[:size].copy_(host[0], non_blocking=True)
        self.positions[:size].copy_(host[1], non_blocking=True)
        self.slot_mapping[:size].copy_(host[2], non_blocking=True)
        self.flex.fill(tables, ctx_lens, rows=size)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size (largest first, sharing one memory pool); returns the seconds taken.
        Each size runs twice first, which also compiles FlexAttention for it."""
        if self.mode != "cuda":
            return 0.0
        t0 = time.monotonic()
        pool = None
        for size in reversed(self.sizes):
            self._load([], [], [], [], [], size)  # every row padding: writes only the scratch block
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        seconds = time.monotonic() - t0
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1fs", self.sizes, seconds)
        return seconds

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            ctx_lens: list[int]) -> torch.Tensor:
        """Logits ``[n, vocab]`` of a decode-only step of ``n <= max_size`` rows."""
        n = len(ids)
        size = self.flex.rows_for(n)
        self._load(ids, positions, slots, tables, ctx_lens, size)
        if self.mode == "cuda":
            self.graphs[size].replay()
            logits = self.outputs[size]
        else:
            logits = self._forward(size)
        self.replays[size] = self.replays.get(size, 0) + 1
        # A view of the graph's output buffer: the sampler reads it before the next replay.
        return logits[:n]
