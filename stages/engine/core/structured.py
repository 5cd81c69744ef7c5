"""Structured outputs in the engine: one llguidance matcher per request, one token bitmask per step.

Preprocess compiled and validated the grammar (:mod:`stages.preprocess.grammar`); what arrives is a
:class:`~stages.transport.messages.GrammarSpec`. :meth:`GrammarBackend.build_in_background` builds
the matcher for it on a worker thread, off both the event loop and the step loop, and keeps that
*template* by the spec's key; each choice then gets its own copy (``deep_copy`` costs about a
microsecond). The step thread never compiles: a request whose template is missing is rejected with
a clear error.

Each step the runner asks :func:`fill_bitmask` for the rows that sample, while the model runs
(llguidance fills the rows on its own thread pool, without the GIL); the sampler masks the logits
with it; the engine then advances each matcher with the token it kept. A matcher that reaches the
end of its grammar finishes the request with ``stop``.

Preemption recomputes a request's KV cache but keeps its tokens, so the matcher stays valid;
:meth:`GrammarState.sync` still checks, before every mask, that the matcher has consumed exactly
the request's output tokens, and rolls back or replays to match when it has not.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np
import torch
from llguidance import LLMatcher

from stages.engine.core.errors import EngineError, RequestRejectedError
from stages.preprocess.grammar import make_llg_tokenizer, tokenizer_digest, tokenizer_json
from stages.transport.messages import GrammarSpec

logger = logging.getLogger(__name__)

class GrammarState:
    """One request's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher: LLMatcher, kind: str) -> None:
        self.matcher = matcher
        self.kind = kind
        self.num_consumed = 0

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher's state that of ``output_token_ids`` (no-op in the normal case)."""
        n = len(output_token_ids)
        if self.num_consumed > n:
            self.matcher.rollback(self.num_consumed - n)
            self.num_consumed = n
        elif self.num_consumed < n:
            self.matcher.consume_tokens(output_token_ids[self.num_consumed:])
            self.num_consumed = n

    def accept(self, token_id: int) -> bool:
        """Advance with a sampled token; ``False`` if the grammar did not allow it."""
        ok = self.matcher.consume_token(token_id)
        if ok:
            self.num_consumed += 1
        return ok

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


#: Upper bounds (seconds) of the per-step mask-fill histogram.
MASK_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)


@dataclass
class MaskStats:
    """Cumulative cost of filling masks (read by the engine's stats), with a per-step histogram."""

    steps: int = 0
    rows: int = 0
    seconds: float = 0.0
    counts: list[int] = field(default_factory=lambda: [0] * (len(MASK_BUCKETS) + 1))

    def observe(self, rows: int, seconds: float) -> None:
        self.steps += 1
        self.rows += rows
        self.seconds += seconds
        self.counts[bisect.bisect_left(MASK_BUCKETS, seconds)] += 1

    def buckets(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count)]`` including ``+Inf``."""
        total, out = 0, []
        for bound, count in zip([*map(str, MASK_BUCKETS), "+Inf"], self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


class GrammarBackend:
    """The engine's llguidance tokenizer, its matcher templates, and the mask executor."""

    def __init__(self, tokenizer: Any, n_vocab: int, eos_token_ids: list[int], *, max_templates: int = 256,
                 compile_timeout_s: float = 10.0, mask_threads: int | None = None) -> None:
        tok_json = tokenizer_json(tokenizer)
        hash_vocab = max(n_vocab, len(tokenizer))
        self.tokenizer_hash = tokenizer_digest(tok_json, hash_vocab)
        self.n_vocab = n_vocab
        self._tok_args = (tok_json, hash_vocab, list(eos_token_ids))
        self._llg: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._templates: OrderedDict[str, LLMatcher] = OrderedDict()
        self.max_templates = max_templates
        self.compile_timeout_s = compile_timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar-build")
        self.executor = llguidance.LLExecutor(mask_threads)
        self.mask_stats = MaskStats()
        self.templates_built = 0
        self.eos_token_ids = list(eos_token_ids)

    def _eos_only(self) -> torch.Tensor:
        return _eos_mask(self.n_vocab, self.eos_token_ids)

    @classmethod
    def for_model(cls, model: str, n_vocab: int, eos_token_ids: list[int]) -> GrammarBackend:
        """Backend for ``model``'s tokenizer (the same tokenizer Preprocess compiles against)."""
        from stages.model_info import load_cpu_tokenizer

        backend = cls(load_cpu_tokenizer(model), n_vocab, eos_token_ids)
        # The llguidance tokenizer takes ~0.3 s to build: do it now, beside model loading.
        threading.Thread(target=lambda: backend.llg_tokenizer, name="grammar-warm-up", daemon=True).start()
        return backend

    @property
    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._llg is None:
                self._llg = make_llg_tokenizer(*self._tok_args)
            return self._llg

    # -- templates ------------------------------------------------------------------------------
    def lookup(self, spec: GrammarSpec) -> LLMatcher | None:
        """The built template for ``spec``, or ``None`` (the step thread's only access)."""
        with self._lock:
            template = self._templates.get(spec.key)
            if template is not None:
                self._templates.move_to_end(spec.key)
            return template

    def build(self, spec: GrammarSpec) -> LLMatcher:
        """Build (or find) the template for ``spec``: blocking, never call it on the step thread."""
        if spec.tokenizer_hash != self.tokenizer_hash:
            raise RequestRejectedError("the grammar was compiled for a different tokenizer than this engine's")
        template = self.lookup(spec)
        if template is not None:
            return template
        template = LLMatcher(self.llg_tokenizer, spec.grammar, log_level=0)
        if template.is_error():
            raise RequestRejectedError(f"the {spec.kind} grammar failed to build: {template.get_error()}")
        with self._lock:
            self._templates[spec.key] = template
            self.templates_built += 1
            while len(self._templates) > self.max_templates:
                self._templates.popitem(last=False)
        return template

    def build_in_background(self, spec: GrammarSpec,
                            done: Callable[[LLMatcher | None, EngineError | None], None]) -> None:
        """Build ``spec``'s template on the backend's worker threads, then call ``done(template,
        None)`` or ``done(None, error)`` there. A build slower than ``compile_timeout_s`` fails too:
        its template is kept for the next request, but this one has waited long enough."""

        def run() -> None:
            started = time.monotonic()
            try:
                template = self.build(spec)
                if time.monotonic() - started > self.compile_timeout_s:
                    raise RequestRejectedError(f"building the {spec.kind} grammar took longer "
                                               f"than {self.compile_timeout_s:g} s")
            except EngineError as exc:
                done(None, exc)
            except Exception as exc:  # noqa: BLE001 - a broken grammar ends its request only
                done(None, RequestRejectedError(f"the grammar failed to build: {exc}"))
            else:
                done(template, None)

        self._pool.submit(run)

    def new_state(self, spec: GrammarSpec, template: LLMatcher | None = None) -> GrammarState:
        """A fresh matcher for one request; raises when the template was not prepared."""
        template = template if template is not None else self.lookup(spec)
        if template is None:
            raise RequestRejectedError(
                f"the {spec.kind} grammar is not built on this engine (build it first); "
                "the step loop never compiles")
        return GrammarState(template.deep_copy(), spec.kind)

    # -- per step -------------------------------------------------------------------------------
    def fill_bitmask(self, states: list[GrammarState | None], output_ids: list[list[int]]) -> torch.Tensor | None:
        """``[rows, ceil(V/32)]`` int32 masks, all ones for unconstrained rows; ``None`` when no
        row is constrained. ``output_ids[i]`` are row ``i``'s tokens so far (to check its matcher)."""
        rows = [(s, i) for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        t0 = time.perf_counter()
        width = (self.n_vocab + 31) // 32
        bitmask = torch.full((len(states), width), -1, dtype=torch.int32)
        try:
            for state, i in rows:
                state.sync(output_ids[i])
            self.executor.unsafe_compute_mask_ptr([(s.matcher, i) for s, i in rows], bitmask.data_ptr(),
                                                  width * 4, len(states))
        except Exception:  # noqa: BLE001 - never take the step loop down: end these requests instead
            logger.exception("filling structured-output masks failed; the constrained rows may only end")
            bitmask[[i for _, i in rows]] = self._eos_only()
        self.mask_stats.observe(len(rows), time.perf_counter() - t0)
        return bitmask


def _eos_mask(n_vocab: int, eos_token_ids: list[int]) -> torch.Tensor:
    """One bitmask row allowing only the EOS tokens."""
    row = torch.zeros((n_vocab + 31) // 32, dtype=torch.int64)
    for t in eos_token_ids:
        row[t // 32] |= 1 << (t % 32)
    return row.to(torch.int32)  # bit 31 wraps to the sign bit, as the int32 words hold it


def unpack_bitmask(bitmask: torch.Tensor, vocab: int, *, invert: bool = False) -> torch.Tensor:
    """``[n, vocab]`` bool (True: allowed; with ``invert``, True: masked out) from ``[n, W]`` int32
    words, bit ``i % 32`` of word ``i // 32`` for token ``i``. numpy's ``unpackbits`` does this in one
    C loop (little-endian bytes, little bit order); torch shift-and-mask ops were 1.5-2.5x slower here."""
    words = bitmask.cpu().numpy()
    if invert:
        words = ~words  # 1/32 of the work of inverting the unpacked mask
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=min(vocab, words.shape[1] * 32), bitorder="little")
    out = torch.from_numpy(bits.view(np.bool_))
    if out.shape[1] < vocab:  # logits wider than the tokenizer: the padding ids are never allowed
        out = torch.nn.functional.pad(out, (0, vocab - out.shape[1]), value=invert)
    return out


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to ``-inf``, in place, every logit of ``[n, V]`` whose bit is 0 in ``bitmask`` ``[n, W]``."""
    masked = unpack_bitmask(bitmask, logits.shape[1], invert=True).to(logits.device, non_blocking=True)
    return logits.masked_fill_(masked, float("-inf"))
