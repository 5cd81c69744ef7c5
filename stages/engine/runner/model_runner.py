"""Turns a scheduler decision into tensors, runs the model over the paged KV cache, samples.

Owns the model weights and the KV-cache tensors (one K and one V tensor per layer, shaped
``[num_blocks * block_size, num_kv_heads, head_dim]``: slot ``b * block_size + i`` holds token ``i``
of block ``b``). Knows nothing about queues or request lifecycles.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import Counter
from typing import Any

import torch

from stages.config import EngineSettings
from stages.engine.core.errors import SamplingError
from stages.engine.core.sampler import Sampler, SamplingContext
from stages.engine.core.scheduler import ScheduledRequest
from stages.engine.runner import kv_pool
from stages.engine.runner.decode_graphs import DecodeGraphs
from stages.engine.runner.flex_paged import FlexPagedAttention
from stages.engine.runner.loader import quantized_weights, resolve_weights
from stages.engine.runner.models.llama import ARCHITECTURES, AttentionMetadata, LlamaArgs, LlamaForCausalLM
from stages.engine.runner.prefill_attention import chunk_mask, fastest_dtype
from stages.engine.runner.uninitialised import no_param_init
from stages.heap import trim_now
from stages.transport.messages import TokenLogprob

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    """``auto`` as a concrete device: ``cuda`` when torch sees one, else ``cpu``."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The weights' and activations' dtype: ``auto`` is bfloat16 on CUDA, float32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def cache_dtype(kv_cache_dtype: str, weights: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype given the resolved ``weights`` and model ``dtype``: ``auto`` is bfloat16
    for quantised weights on CPU (their activations are rounded to int8 anyway; llama.cpp's cache
    is 16-bit too), else the model's dtype (float32 weights keep their exact parity)."""
    if kv_cache_dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"kv_cache_dtype must be auto, float32 or bfloat16, not {kv_cache_dtype!r}")
    if kv_cache_dtype != "auto":
        return getattr(torch, kv_cache_dtype)
    if weights != "float32" and device.type != "cuda" and dtype == torch.float32:
        return torch.bfloat16
    return dtype


class ModelRunner:
    """Runs one engine step's forward pass and sampling."""

    def __init__(self, config: EngineSettings, hf_config: object, state_dict: dict[str, torch.Tensor], *,
                 model: str = "", lm_head: str = "auto", dense_min_rows: int = 0) -> None:
        """``config`` is the ``engine`` section (``device: auto`` is resolved here). ``model`` names
        the model whose ``state_dict`` this is, to find a GGUF's own quantised blocks ("": none).
        Two knobs no config sets, for experiments: ``lm_head``, the LM head under quantised weights
        (auto: :func:`loader.lm_head_default` | float | bf16 | int4 | int8 | q8_0), and
        ``dense_min_rows``, the row count from which quantised layers use a dense GEMM (0: measured
        at load, :func:`calibration.calibrate_dense_min_rows`)."""
        self.config = config
        self.device = torch.device(resolve_device(config.device))
        # Checked before any weight is touched, so a bad setting fails at once.
        self.attention = self._attention(config.attention)
        graph_mode = self._graph_mode(config.decode_graphs)
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        #: Intra-op threads of an ordinary step, and of one that prefills many tokens (CPU only).
        self.step_threads = torch.get_num_threads()
        self.prefill_threads = (config.prefill_threads or self.step_threads) if self.device.type == "cpu" else self.step_threads
        #: Steps run at each intra-op thread count (``/metrics``: how often ``prefill_threads`` is taken).
        self.steps_by_threads: Counter[int] = Counter()
        arch = (getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]
        if arch not in ARCHITECTURES:
            raise NotImplementedError(f"architecture {arch} is not supported (have {ARCHITECTURES})")
        self.dtype = model_dtype(config.dtype, self.device)
        self.args = LlamaArgs.from_hf_config(hf_config)
        t0 = time.monotonic()
        # Built in place, uninitialised: every weight is loaded right after.
        with torch.device(self.device), no_param_init():
            llama = LlamaForCausalLM(self.args)
        llama = llama.to(self.dtype)
        llama.tie_and_init_buffers()
        llama.load_hf_state_dict(state_dict)
        self.weights = resolve_weights(config.weights, model, str(self.device))
        self.block_kernel = None
        if self.weights != "float32":
            self.block_kernel = self._block_kernel(config.quant_kernel, config.cpu_isa)
            linears, head = quantized_weights(self.weights, model, self.args, state_dict,
                                              lm_head, block_kernel=self.block_kernel is not None)
            llama.quantize_(linears, head, dense_min_rows, self.block_kernel)
        self.model = llama.eval()
        logger.info("model %s loaded on %s/%s, %s weights (%s kernel, dense from %s rows), in %.1fs", arch,
                    self.device, self.dtype, self.weights,
                    self.block_kernel.isa_name if self.block_kernel is not None else "torch",
                    getattr(llama, "dense_min_rows", "-"), time.monotonic() - t0)

        self.cache_dtype = cache_dtype(config.kv_cache_dtype, self.weights, self.device, self.dtype)
        #: The dtype prompt chunks' attention computes in, measured on this CPU.
        self.prefill_dtype = (fastest_dtype(self.dtype, self.cache_dtype, self.args.num_heads, self.args.num_kv_heads,
                                            self.args.head_dim, self.prefill_threads)
                              if self.device.type == "cpu" else self.dtype)
        logger.info("prompt attention in %s", str(self.prefill_dtype).removeprefix("torch."))
        self.block_size = config.block_size
        self.num_blocks = config.num_kv_blocks or self._blocks_for_memory(config.kv_cache_memory_gb)
        # FlexAttention's padded rows need a block no request owns: one more than the block
        # manager hands out (``num_blocks`` is what it gets).
        cache_blocks = self.num_blocks + (1 if self.attention == "flex" else 0)
        shape = (cache_blocks * self.block_size, self.args.num_kv_heads, self.args.head_dim)
        self.kv_caches = kv_pool.allocate(self.args.num_layers, shape, self.cache_dtype, self.device)
        self.paged_kernel = self._decode_kernel(config.attention) if self.attention == "paged_kernel" else None
        if self.attention == "paged_kernel" and self.paged_kernel is None:
            self.attention = "sdpa"  # auto, and the kernel did not build
        if self.paged_kernel is not None and self.block_kernel is not None:
            from stages.engine.runner.kernels import decode_layers

            self.model.enable_fused_decode(decode_layers(config.cpu_isa), self.kv_caches)
        self.flex: FlexPagedAttention | None = None
        self.graphs: DecodeGraphs | None = None
        if self.attention == "flex":
            self.flex = FlexPagedAttention(cache_blocks, self.block_size, scratch_block=self.num_blocks,
                                           max_rows=config.max_num_seqs, device=self.device)
            if graph_mode != "off":
                self.graphs = DecodeGraphs(self.model, self.kv_caches, self.flex, self.device, graph_mode)
                self.graphs.capture()
        from stages.engine.runner.kernels import row_argmax

        # Greedy decoding's argmax as one vector scan per row on CPU (torch's: ~1 ns an element).
        self.sampler = Sampler(self.device, argmax=row_argmax(config.cpu_isa) if self.device.type == "cpu" else None)
        self._masks: concurrent.futures.ThreadPoolExecutor | None = None
        # Loading freed the float state dict and the repacking's temporaries: give that back.
        trim_now()

    @staticmethod
    def _block_kernel(choice: str, isa: str) -> Any:
        """The block-quantised matmul kernel, or None for torch's int4/int8 kernels."""
        if choice not in ("auto", "native", "torch"):
            raise ValueError(f"quant_kernel must be auto, native or torch, not {choice!r}")
        if choice == "torch":
            return None
        from stages.engine.runner.kernels import quant_matmul

        kernel = quant_matmul(isa)
        if kernel is None and choice == "native":
            raise RuntimeError("quant_kernel=native: the kernel could not be built (see the log)")
        return kernel

    def _attention(self, choice: str) -> str:
        """The decode attention this runner uses: paged_kernel | flex | sdpa."""
        if choice not in ("auto", "paged_kernel", "flex", "sdpa"):
            raise ValueError(f"attention must be auto, paged_kernel, flex or sdpa, not {choice!r}")
        if choice != "auto":
            return choice
        # On CPU the C++ kernel (one call per layer, no compile); elsewhere FlexAttention.
        return "paged_kernel" if self.device.type == "cpu" else "flex"

    def _graph_mode(self, choice: str) -> str:
        """How decode-only steps run under flex attention: cuda | static | off."""
        if choice not in ("auto", "cuda", "static", "off"):
            raise ValueError(f"decode_graphs must be auto, cuda, static or off, not {choice!r}")
        if choice == "auto":
            return "cuda" if self.device.type == "cuda" and self.attention == "flex" else "off"
        if choice == "cuda" and self.device.type != "cuda":
            raise ValueError("decode_graphs=cuda needs a CUDA device")
        if choice != "off" and self.attention != "flex":
            # The replayed step reads its block tables from the flex buffers.
            raise ValueError(f"decode_graphs={choice} needs attention=flex")
        return choice

    def _decode_kernel(self, choice: str) -> Any:
        """The paged decode-attention kernel for ``choice`` auto or paged_kernel (checked by
        :meth:`_attention`), or None for gather + SDPA."""
        if self.device.type != "cpu" or self.cache_dtype not in (torch.float32, torch.bfloat16):
            if choice == "paged_kernel":
                raise ValueError("attention=paged_kernel needs the CPU with float32 or bfloat16")
            return None
        from stages.engine.runner.kernels import paged_attention

        kernel = paged_attention(self.config.cpu_isa)
        if kernel is None and choice == "paged_kernel":
            raise RuntimeError("attention=paged_kernel: the kernel could not be built (see the log)")
        return kernel

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V across all layers for one token."""
        elem = torch.tensor([], dtype=self.cache_dtype).element_size()
        return 2 * self.args.num_layers * self.args.num_kv_heads * self.args.head_dim * elem

    def _blocks_for_memory(self, gb: float) -> int:
        return max(1, int(gb * (1 << 30)) // (self.kv_bytes_per_token * self.block_size))

    # -- step -------------------------------------------------------------------------------------
    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _context_slots(self, tables: torch.Tensor, width: int) -> torch.Tensor:
        """``[B, width]`` cache slots of positions ``0..width-1`` given ``[B, blocks]`` tables."""
        pos = torch.arange(width)
        return tables[:, pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, AttentionMetadata, list[ScheduledRequest]]:
        """Flatten the batch (single-token queries first) and build the attention metadata.

        Returns the input ids, the metadata, and the batch in the order used (logits follow it).
        """
        decodes = [s for s in batch if s.num_new_tokens == 1]
        prefills = [s for s in batch if s.num_new_tokens > 1]
        ordered = decodes + prefills
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_idx: list[int] = []
        for s in ordered:
            req, start, end = s.request, s.start, s.start + s.num_new_tokens
            ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slots(req.block_table, start, end))
            if s.samples:
                logits_idx.append(len(ids) - 1)
        dev = self.device
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=dev),
        )
        if self.prefill_dtype != self.dtype:
            meta.prefill_dtype = self.prefill_dtype
        limit = self.config.prefill_kernel_max_len
        if (prefills and self.paged_kernel is not None and limit > 0
                and all(s.start + s.num_new_tokens <= limit for s in prefills)):
            # Every prompt token is a query row like a decode's, with its own context length
            # (position + 1) over its request's blocks: the whole step is one kernel call per layer.
            # Safe because the step's K/V are written to the cache before any attention reads it.
            nb = max(-(-(s.start + s.num_new_tokens) // self.block_size) for s in ordered)
            per_request = torch.tensor(_padded_tables(ordered, nb), dtype=torch.int32)
            meta.num_decodes = len(ids)
            meta.decode_tables = per_request.repeat_interleave(
                torch.tensor([s.num_new_tokens for s in ordered]), dim=0).contiguous()
            meta.decode_ctx_lens = torch.tensor(positions, dtype=torch.int32) + 1
            meta.paged_kernel = self.paged_kernel
            meta.block_size = self.block_size
            meta.kernel_threads = torch.get_num_threads()
            return torch.tensor(ids, dtype=torch.long, device=dev), meta, ordered
        if decodes and self.flex is not None:
            # FlexAttention reads each row's blocks in place, as the block table lists them.
            meta.num_decodes = len(decodes)
            meta.flex = self.flex
            *_, tables, ctx_lens = self._decode_inputs(decodes)
            meta.flex_mask = self.flex.fill(tables, ctx_lens)
        elif decodes and self.paged_kernel is not None:
            # The kernel walks each sequence's block table itself: no slot lists, no mask.
            nb = max(-(-(s.start + 1) // self.block_size) for s in decodes)
            meta.num_decodes = len(decodes)
            meta.decode_tables = torch.tensor(_padded_tables(decodes, nb), dtype=torch.int32)
            meta.decode_ctx_lens = torch.tensor([s.start + 1 for s in decodes], dtype=torch.int32)
            meta.paged_kernel = self.paged_kernel
            meta.block_size = self.block_size
            meta.kernel_threads = torch.get_num_threads()
        elif decodes:
            # Context slots of every decode, vectorised: slot(p) = table[p // bs] * bs + p % bs.
            ctx_lens = torch.tensor([s.start + 1 for s in decodes])
            width = int(ctx_lens.max())
            nb = -(-width // self.block_size)
            tables = torch.tensor(_padded_tables(decodes, nb), dtype=torch.long)
            meta.num_decodes = len(decodes)
            meta.decode_slots = self._context_slots(tables, width).to(dev)
            table = decodes[0].request.block_table[:nb]
            if len(decodes) == 1 and table == list(range(table[0], table[0] + nb)):
                # One sequence in consecutive blocks (common at batch 1: the block pool hands out
                # free blocks in order): attention reads the cache in place, no gather, no mask.
                meta.decode_range = table[0] * self.block_size
            else:
                pad = torch.arange(width)[None, :] >= ctx_lens[:, None]
                mask = torch.zeros(pad.shape, dtype=self.dtype).masked_fill_(pad, float("-inf"))
                meta.decode_mask = mask[:, None, None, :].to(dev)  # additive: cheaper than a bool mask
        offset = len(decodes)
        for s in prefills:
            start, n = s.start, s.num_new_tokens
            nb = -(-(start + n) // self.block_size)
            table = torch.tensor([s.request.block_table[:nb]], dtype=torch.long)
            ctx = self._context_slots(table, start + n)[0].to(dev)
            meta.prefills.append((offset, offset + n, ctx, chunk_mask(start, n, self.prefill_dtype, dev)))
            offset += n
        return torch.tensor(ids, dtype=torch.long, device=dev), meta, ordered

    def threads_for(self, batch: list[ScheduledRequest]) -> int:
        """Intra-op threads for ``batch``: ``prefill_threads`` when its prompt chunks hold at least
        ``prefill_threads_min_tokens`` tokens, else the ordinary step's. A decode step keeps
        ``num_threads``: given the second core of a 2-core machine it measured slower through the
        app, since each token's hops through the other stages need that core within the step."""
        prompt = sum(s.num_new_tokens for s in batch if s.num_new_tokens > 1)
        if prompt >= self.config.prefill_threads_min_tokens:
            return self.prefill_threads
        return self.step_threads

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest], grammars: Any = None
                ) -> dict[str, tuple[int, TokenLogprob | None] | SamplingError]:
        """Run the forward pass for ``batch`` and sample for every sequence whose chunk ends its
        known tokens. Returns ``{request_id: (token_id, logprob)}``, or a :class:`SamplingError`
        for a request whose own sampling failed (:meth:`Sampler.sample_or_fail`).

        ``grammars`` (a :class:`~stages.engine.core.structured.GrammarBackend`) fills the structured-output
        masks of the sampling rows while the model runs (llguidance works without the GIL)."""
        threads = self.step_threads
        if self.prefill_threads != self.step_threads:
            threads = self.threads_for(batch)
            if threads != torch.get_num_threads():  # cheap; the OpenMP pools keep their threads
                torch.set_num_threads(threads)
        self.steps_by_threads[threads] += 1
        graph_step = self.graphs is not None and self._graph_step(batch)
        if graph_step:
            ordered = batch
        else:
            input_ids, meta, ordered = self.prepare(batch)
        samplers = [s.request for s in ordered if s.samples]
        mask_future = None
        if grammars is not None and any(r.grammar is not None for r in samplers):
            mask_future = self._mask_pool().submit(grammars.fill_bitmask, [r.grammar for r in samplers],
                                                   [r.output_token_ids for r in samplers])
        if graph_step:
            assert self.graphs is not None
            logits = self.graphs.run(*self._decode_inputs(batch))
        else:
            logits = self.model(input_ids, meta, self.kv_caches)
        bitmask = mask_future.result() if mask_future is not None else None
        if not samplers:
            return {}
        rows = []
        for req in samplers:
            if req.params.seed is not None and req.generator is None:
                req.generator = Sampler.make_generator(req.params.seed, self.device)
            rows.append(SamplingContext(req.params, req.prompt_token_ids, req.output_token_ids, req.generator,
                                        constrained=req.grammar is not None))
        sampled = self.sampler.sample_or_fail(logits.float(), rows, bitmask)
        return {req.request_id: out for req, out in zip(samplers, sampled, strict=True)}

    def _graph_step(self, batch: list[ScheduledRequest]) -> bool:
        """Whether ``batch`` replays a decode graph: decodes only, each sampling (never more than
        ``max_num_seqs`` rows, the largest captured size)."""
        return all(s.num_new_tokens == 1 and s.samples for s in batch)

    def _decode_inputs(self, decodes: list[ScheduledRequest]
                       ) -> tuple[list[int], list[int], list[int], list[list[int]], list[int]]:
        """Token ids, positions, cache slots, block tables and context lengths of decode rows."""
        bs = self.block_size
        ids, positions, slots, tables, ctx = [], [], [], [], []
        for s in decodes:
            req, pos = s.request, s.start
            ids.append(req.all_token_ids[pos])
            positions.append(pos)
            slots.append(req.block_table[pos // bs] * bs + pos % bs)
            tables.append(req.block_table[:pos // bs + 1])
            ctx.append(pos + 1)
        return ids, positions, slots, tables, ctx

    def _mask_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._masks is None:
            self._masks = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._masks


def _padded_tables(decodes: list[Any], nb: int) -> list[list[int]]:
    """The first ``nb`` block ids of each decode's table, padded with block 0 (never read: each
    sequence's context length bounds what is looked at)."""
    return [(table := s.request.block_table[:nb]) + [0] * (nb - len(table)) for s in decodes]
