"""Token sampler: turns the last-position logits of a batch into one token id per row.

Order per step, as in vLLM: token restrictions (the structured-output bitmask, ``allowed_token_ids``,
``bad_words``, ``logit_bias``) -> penalties -> temperature -> top-k/top-p -> min-p -> sample. Each stage is vectorised with per-row parameter tensors over only the rows that need it,
so a batch of plain requests pays for none of it. An all-greedy batch without penalties or
logprobs (the common decode step) is one argmax and one ``.tolist()``. The engine samples through
:meth:`Sampler.sample_or_fail`: a row whose parameters make sampling raise fails alone.

Sampling uses the exponential race: ``argmax(probs / q)`` with ``q ~ Exponential(1)`` per token is
an exact draw from ``probs`` (and needs no normalisation, so masked probabilities can simply be
zeroed). A seeded request draws its ``q`` from its own generator, ``V`` numbers per step, seeded
afresh at each step from (seed, position in the output) (:func:`step_seed`): its tokens depend
only on its seed and its own logits, not on its batch neighbours, their order, or which replica
drew the earlier ones (a request moved to another replica after k tokens draws there what the
first would have drawn at k).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stages.engine.core.errors import SamplingError
from stages.transport.messages import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob

logger = logging.getLogger(__name__)

#: Temperatures below this are greedy (as in vLLM): dividing float32 logits by a near-zero
#: temperature overflows to inf and turns the softmax into NaN.
_SAMPLING_EPS = 1e-5


_MASK64 = (1 << 64) - 1


def step_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw for output token ``position``: SplitMix64 of
    the pair, so neighbouring positions and seeds get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SamplingContext:
    """One row of a sampling batch: its parameters, its tokens so far and its generator."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    #: The request's own generator (``Sampler.make_generator``); ``None`` when ``params.seed`` is
    #: ``None``. If a seeded row arrives without one, the sampler creates it and stores it here,
    #: and the caller must keep it for the next step.
    generator: torch.Generator | None = None
    #: The row follows a structured-output grammar (its bitmask row is applied).
    constrained: bool = False


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _SAMPLING_EPS


def _token_counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[n, vocab]`` float32 counts of each token id in each sequence."""
    width = max(1, max(len(s) for s in seqs))
    # Pad ragged rows with the out-of-vocab id ``vocab`` so one scatter_add handles them all; the
    # extra column that collects the padding is dropped.
    ids = torch.tensor([s + [vocab] * (width - len(s)) for s in seqs], dtype=torch.long, device=device)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingContext]) -> torch.Tensor:
    """Return a copy of ``logits`` ``[n, V]`` with each row's penalties applied.

    ``repetition_penalty`` (HF/CTRL) touches every token seen in the prompt or the output: positive
    logits are divided by it, negative ones multiplied. ``presence_penalty`` is subtracted once for
    each token present in the output, ``frequency_penalty`` times its count in the output (OpenAI:
    prompt tokens do not count for these two).
    """
    vocab, device = logits.shape[1], logits.device
    out_counts = _token_counts([r.output_token_ids for r in rows], vocab, device)
    out = logits.clone()
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[:, None]
        seen = (_token_counts([r.prompt_token_ids for r in rows], vocab, device) > 0) | (out_counts > 0)
        scale = torch.where(seen, rep, torch.ones_like(rep))
        out = torch.where(out > 0, out / scale, out * scale)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=device)[:, None]
    return out - freq * out_counts - pres * (out_counts > 0).float()


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to ``-inf`` the logits outside each row's top-k, then outside its top-p nucleus.

    ``top_k`` ``[n]`` long (``V`` disables), ``top_p`` ``[n]`` float (1.0 disables). The nucleus
    is the smallest set of most likely tokens (after top-k) whose probability reaches ``top_p``;
    the most likely token always survives. Ties at the k-th value are all kept, as in vLLM.
    """
    vocab = logits.shape[1]
    # One ascending sort serves both filters (the layout vLLM uses).
    sorted_logits, order = logits.sort(dim=-1)
    kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop a token when all the mass at or below it fits in 1 - top_p; keep the top one always.
    drop = cum <= (1.0 - top_p)[:, None]
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_token_restrictions(logits: torch.Tensor, rows: list[SamplingContext],
                             bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of ``logits`` ``[n, V]`` with each row's token restrictions applied.

    ``bitmask`` ``[n, ceil(V/32)]`` (structured outputs; all ones for free rows) masks first, then
    ``allowed_token_ids`` and ``bad_words`` mask to ``-inf``, then ``logit_bias`` is added (OpenAI:
    -100 effectively bans a token, 100 effectively forces it, among the tokens still allowed).
    """
    out = logits.clone()
    if bitmask is not None:
        from stages.engine.core.structured import apply_bitmask

        masked = [i for i, r in enumerate(rows) if r.constrained]
        if len(masked) == len(rows):
            apply_bitmask(out, bitmask)
        elif masked:  # only the constrained rows pay for unpacking and masking
            idx = torch.tensor(masked, device=out.device)
            out[idx] = apply_bitmask(out[idx], bitmask[masked])
    vocab, device = out.shape[1], out.device
    for i, r in enumerate(rows):
        p = r.params
        if not p.has_token_restrictions:
            continue
        if p.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=device)
            keep[torch.tensor([t for t in p.allowed_token_ids if 0 <= t < vocab], dtype=torch.long,
                              device=device)] = True
            out[i].masked_fill_(~keep, float("-inf"))
        banned = [seq[-1] for seq in p.bad_words_token_ids
                  if len(seq) == 1 or r.output_token_ids[-(len(seq) - 1):] == seq[:-1]]
        if banned:
            out[i, torch.tensor(_in_vocab(banned, vocab, "bad_words"), dtype=torch.long, device=device)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(_in_vocab(list(p.logit_bias), vocab, "logit_bias"), dtype=torch.long, device=device)
            out[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=out.dtype, device=device)
    return out


def _in_vocab(ids: list[int], vocab: int, what: str) -> list[int]:
    """``ids``, checked on the host before they index a device tensor: on CUDA an index out of
    range is a device-side assert that poisons the whole process, not an ``IndexError`` that
    :meth:`Sampler.sample_or_fail` confines to one request."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what} has token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}")
    return ids


def _torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


class Sampler:
    """Picks the next token of every row of a batch; stateless apart from the target device."""

    def __init__(self, device: torch.device | str = "cpu",
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """``device`` is where lazily created generators live; logits may be on any device.
        ``argmax`` replaces ``x.argmax(dim=-1)`` (the engine passes its CPU kernel; it must give
        the same indices)."""
        self.device = torch.device(device)
        self._argmax = argmax or _torch_argmax

    @staticmethod
    def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
        """A fresh generator for one seeded request; the engine keeps it on the request."""
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        return generator

    def sample(self, logits: torch.Tensor, rows: list[SamplingContext], bitmask: torch.Tensor | None = None
               ) -> list[tuple[int, TokenLogprob | None]]:
        """Sample one token per row of ``logits`` ``[B, V]``; row ``i`` is described by ``rows[i]``.

        ``bitmask`` (structured outputs) is ``[B, ceil(V/32)]``, one bit per allowed token.
        Returns ``(token_id, logprob)`` per row; ``logprob`` is ``None`` unless the row asked for
        logprobs, which are the log-softmax of the raw logits (before any restriction, penalty or
        temperature, as vLLM reports them by default).
        """
        restricted = None
        if bitmask is not None or any(r.params.has_token_restrictions for r in rows):
            restricted = apply_token_restrictions(logits.float(), rows, bitmask)
        if all(_is_greedy(r.params) and r.params.logprobs is None and not r.params.has_penalties
               for r in rows):
            # Decode hot path: no per-row tensor work, one device sync.
            x = logits if restricted is None else restricted
            return [(t, None) for t in self._argmax(x).tolist()]
        return self._sample_general(logits, rows, restricted)

    def sample_or_fail(self, logits: torch.Tensor, rows: list[SamplingContext], bitmask: torch.Tensor | None = None
                       ) -> list[tuple[int, TokenLogprob | None] | SamplingError]:
        """:meth:`sample`, where one row's failure is that row's alone.

        Rows are independent, so when the batched call raises, each row is sampled on its own and
        only the rows that raise alone get a :class:`SamplingError` in their place. A seeded row
        sampled twice this way draws from its generator again, so its sequence differs from a run
        without the failure. Nothing extra is done while the batched call succeeds."""
        try:
            return self.sample(logits, rows, bitmask)
        except Exception:  # noqa: BLE001 - one row's parameters must not end its whole batch
            logger.warning("batched sampling failed for %d rows; sampling them one by one", len(rows),
                           exc_info=True)
        out: list[tuple[int, TokenLogprob | None] | SamplingError] = []
        for i, row in enumerate(rows):
            try:
                out.extend(self.sample(logits[i:i + 1], [row], None if bitmask is None else bitmask[i:i + 1]))
            except Exception as exc:  # noqa: BLE001 - becomes this request's error
                logger.exception("sampling failed for row %d of %d", i, len(rows))
                out.append(SamplingError(f"sampling failed for this request ({type(exc).__name__}: {exc})"))
        return out

    def _sample_general(self, logits: torch.Tensor, rows: list[SamplingContext],
                        restricted: torch.Tensor | None = None) -> list[tuple[int, TokenLogprob | None]]:
        raw = logits.float()
        device = raw.device
        x = raw if restricted is None else restricted
        penalised = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if penalised:
            idx = torch.tensor(penalised, device=device)
            x = x.clone()  # raw stays untouched: logprobs are reported on it
            x[idx] = apply_penalties(x[idx], [rows[i] for i in penalised])
        sampled = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
        if len(sampled) == len(rows):
            tokens = self._draw(x, rows)
        else:
            # Greedy rows take the argmax after penalties (top-k/p and min-p never remove it).
            tokens = self._argmax(x)
            if sampled:
                idx = torch.tensor(sampled, device=device)
                tokens[idx] = self._draw(x[idx], [rows[i] for i in sampled])
        token_ids: list[int] = tokens.tolist()
        return list(zip(token_ids, self._logprobs(raw, rows, token_ids), strict=True))

    def _draw(self, x: torch.Tensor, rows: list[SamplingContext]) -> torch.Tensor:
        """Temperature, top-k/top-p, min-p, then one categorical draw per row of ``x``."""
        n, vocab = x.shape
        device = x.device
        temperature = torch.tensor([r.params.temperature for r in rows], device=device)
        x = x / temperature[:, None]  # new tensor: the caller's x is not modified below
        # Sorting is the costly part, so only rows that filter are sorted.
        filtered = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab or r.params.top_p < 1.0]
        if filtered:
            idx = torch.tensor(filtered, device=device)
            # A top_k beyond the vocabulary keeps it all (and one beyond int64 must not reach a
            # tensor: it would raise in the step loop, failing every request of the engine).
            top_k = torch.tensor([min(rows[i].params.top_k, vocab) if rows[i].params.top_k > 0 else vocab
                                  for i in filtered], dtype=torch.long, device=device)
            top_p = torch.tensor([rows[i].params.top_p for i in filtered], device=device)
            x[idx] = apply_top_k_top_p(x[idx], top_k, top_p)
        probs = x.softmax(dim=-1)
        if any(r.params.min_p > 0.0 for r in rows):
            min_p = torch.tensor([r.params.min_p for r in rows], device=device)[:, None]
            # Zeroing is enough: the exponential race below does not need normalised weights.
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        q = self._exponentials(rows, n, vocab, device)
        return self._argmax(probs / q)

    def _exponentials(self, rows: list[SamplingContext], n: int, vocab: int,
                      device: torch.device) -> torch.Tensor:
        """``[n, vocab]`` Exp(1) noise; a seeded row's comes from its own generator only."""
        seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
        if not seeded:
            q = torch.empty(n, vocab, device=device).exponential_()
        else:
            q = torch.empty(n, vocab, device=device)
            unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
            if unseeded:  # unseeded rows share one draw from the default generator
                q[torch.tensor(unseeded, device=device)] = torch.empty(
                    len(unseeded), vocab, device=device).exponential_()
            for i in seeded:
                row = rows[i]
                if row.generator is None:
                    row.generator = self.make_generator(row.params.seed, self.device)
                row.generator.manual_seed(step_seed(row.params.seed, len(row.output_token_ids)))
                # Drawn on the generator's device (a CPU generator cannot feed a CUDA kernel),
                # always exactly ``vocab`` numbers, so the stream advances the same every step.
                q[i] = torch.empty(vocab, device=row.generator.device).exponential_(
                    generator=row.generator).to(device)
        # exponential_ may return 0 on some backends; 0/0 would be NaN, which argmax would pick.
        return q.clamp_min_(torch.finfo(q.dtype).tiny)

    @staticmethod
    def _logprobs(raw: torch.Tensor, rows: list[SamplingContext], token_ids: list[int]
                  ) -> list[TokenLogprob | None]:
        """Log-softmax of the raw logits, for the rows that asked only."""
        out: list[TokenLogprob | None] = [None] * len(rows)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not wanted:
            return out
        device, vocab = raw.device, raw.shape[1]
        logprobs = raw[torch.tensor(wanted, device=device)].log_softmax(dim=-1)
        chosen_ids = torch.tensor([token_ids[i] for i in wanted], device=device)[:, None]
        chosen = logprobs.gather(1, chosen_ids).squeeze(1).tolist()
        counts = [max(0, min(rows[i].params.logprobs, MAX_TOP_LOGPROBS, vocab)) for i in wanted]
        top_values: list[list[float]] = [[] for _ in wanted]
        top_ids: list[list[int]] = [[] for _ in wanted]
        if max(counts) > 0:  # one topk at the largest k asked; each row keeps its prefix
            values, ids = logprobs.topk(max(counts), dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        for j, i in enumerate(wanted):
            top = list(zip(top_ids[j][:counts[j]], top_values[j][:counts[j]], strict=True))
            out[i] = TokenLogprob(token_ids[i], chosen[j], top)
        return out
