"""A deterministic fake model runner for engine-core tests, plus an oracle and invariant checks.

The fake keeps a per-slot "KV cache": the value written for position ``p`` is a chained state over
every token up to ``p`` (like real K/V, which depend on the whole prefix), and the next token is a
function of the state it *reads back from the cache* at the last position. So a wrong prefix-cache
hit, a block shared while being written, or a bad recomputation after preemption changes the
output, and in ``strict`` mode the fake also asserts every slot it reads holds the expected state.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from stages.config import EngineSettings
from stages.engine.core.block_manager import BlockManager
from stages.engine.core.engine import LLMEngine
from stages.engine.core.request import RequestStatus
from stages.engine.core.scheduler import ScheduledRequest
from stages.transport.messages import SamplingParams, TokenLogprob

VOCAB = 50
#: The fake never generates ``EOS`` unless it is given ``gen_vocab=VOCAB``.
EOS = VOCAB - 1
_MOD = (1 << 61) - 1
_ROOT_STATE = 1_234_567


def mix(state: int, token: int, pos: int) -> int:
    """The 'K/V' at position ``pos``: a chained state over the whole prefix."""
    return (state * 1_000_003 + token * 7_919 + pos + 1) % _MOD


def next_token(state: int, pos: int, gen_vocab: int) -> int:
    """The token sampled after the state of the last position (``pos``: its index)."""
    return (state * 31 + pos) % gen_vocab


def states(tokens: list[int]) -> list[int]:
    out, s = [], _ROOT_STATE
    for p, t in enumerate(tokens):
        s = mix(s, t, p)
        out.append(s)
    return out


def reference(prompt: list[int], n: int, gen_vocab: int = VOCAB - 1) -> list[int]:
    """The ``n`` tokens a correct engine produces for ``prompt`` (no stopping)."""
    tokens = list(prompt)
    s = states(tokens)[-1]
    out = []
    for _ in range(n):
        t = next_token(s, len(tokens) - 1, gen_vocab)
        out.append(t)
        s = mix(s, t, len(tokens))
        tokens.append(t)
    return out


class FakeRunner:
    """Implements the runner contract: ``num_blocks`` and ``execute(batch)``."""

    def __init__(self, num_blocks: int, block_size: int, gen_vocab: int = VOCAB - 1,
                 strict: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.gen_vocab = gen_vocab
        self.strict = strict
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.block_manager: BlockManager | None = None
        #: One entry per call: ``[(request_id, start, num_new_tokens, samples), ...]``.
        self.calls: list[list[tuple[str, int, int, bool]]] = []

    def _slot(self, table: list[int], pos: int) -> tuple[int, int]:
        return table[pos // self.block_size], pos % self.block_size

    def execute(self, batch: list[ScheduledRequest]) -> dict[str, tuple[int, TokenLogprob | None]]:
        self.calls.append([(s.request.request_id, s.start, s.num_new_tokens, s.samples) for s in batch])
        ids = [s.request.request_id for s in batch]
        assert len(ids) == len(set(ids)), f"request scheduled twice in one batch: {ids}"
        bm = self.block_manager
        out: dict[str, tuple[int, TokenLogprob | None]] = {}
        for s in batch:
            req = s.request
            start, n = s.start, s.num_new_tokens
            tokens = req.all_token_ids
            table = req.block_table
            assert req.status is RequestStatus.RUNNING, req.status
            assert 1 <= n and start + n <= len(tokens), (req.request_id, start, n)
            assert len(table) * self.block_size >= start + n, (req.request_id, table, start, n)
            if self.strict and start > 0:
                expected = states(tokens[:start])
                for p in range(start):
                    b, o = self._slot(table, p)
                    assert self.kv[b][o] == expected[p], f"{req.request_id}: wrong KV at position {p}"
            if start > 0:
                b, o = self._slot(table, start - 1)
                state = self.kv[b][o]
                assert state is not None, f"{req.request_id}: reads an unwritten slot"
            else:
                state = _ROOT_STATE
            for p in range(start, start + n):
                b, o = self._slot(table, p)
                if bm is not None:
                    blk = bm.blocks[b]
                    assert blk.ref_count == 1, f"writes into shared block {b} (ref {blk.ref_count})"
                    assert blk.block_hash is None, f"writes into cached block {b}"
                state = mix(state, tokens[p], p)
                self.kv[b][o] = state
            if s.samples:
                out[req.request_id] = (next_token(state, start + n - 1, self.gen_vocab), None)
        return out


def make_engine(num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_num_seqs: int = 16,
                threshold: int = 0, max_model_len: int = 0, model_max_len: int = 256,
                prefix_caching: bool = True, eos: tuple[int, ...] = (EOS,),
                gen_vocab: int = VOCAB - 1, strict: bool = True, **settings: Any) -> LLMEngine:
    runner = FakeRunner(num_blocks, block_size, gen_vocab, strict)
    config = EngineSettings(block_size=block_size, num_kv_blocks=num_blocks, max_num_batched_tokens=budget,
                            max_num_seqs=max_num_seqs, long_prefill_token_threshold=threshold,
                            max_model_len=max_model_len, enable_prefix_caching=prefix_caching, **settings)
    engine = LLMEngine(config, runner, list(eos), VOCAB, model_max_len)
    runner.block_manager = engine.block_manager
    return engine


def params(max_tokens: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def check_engine(engine: LLMEngine) -> None:
    """Every bookkeeping invariant of the block manager and scheduler, for the engine's live requests."""
    bm = engine.block_manager
    sched = engine.scheduler
    live = list(engine.requests.values())
    assert {r.request_id for r in [*sched.running, *sched.waiting]} == set(engine.requests)
    assert len(sched.running) + len(sched.waiting) == len(live)
    check_block_manager(bm, live)
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.block_table == [] and r.num_computed_tokens == 0
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert len(r.block_table) * bm.block_size >= r.num_computed_tokens
        assert len(r.block_table) <= bm.blocks_needed(r.num_tokens)
    assert len(sched.running) <= sched.config.max_num_seqs


def check_block_manager(bm: BlockManager, live: list) -> None:
    bm.check_invariants(live)
    bs = bm.block_size
    holders: dict[int, list[tuple[Any, int]]] = defaultdict(list)
    for r in live:
        for i, b in enumerate(r.block_table):
            holders[b].append((r, i))
    for b, hs in holders.items():
        blk = bm.blocks[b]
        assert blk.ref_count == len(hs)
        if len(hs) > 1:  # only a cached, fully computed prefix block may be shared, at one position
            assert blk.block_hash is not None, (b, [(r.request_id, i) for r, i in hs])
            assert len({i for _, i in hs}) == 1, (b, [(r.request_id, i) for r, i in hs])
            for r, i in hs:
                assert (i + 1) * bs <= r.num_computed_tokens
                assert tuple(r.all_token_ids[i * bs:(i + 1) * bs]) == blk.token_ids
    free = list(bm._free)
    assert len(free) == len(set(free)) == bm.num_free_blocks
    assert set(free) == {blk.block_id for blk in bm.blocks if blk.ref_count == 0}
    assert all(blk.ref_count >= 0 for blk in bm.blocks)
    registered = {blk.block_hash: blk.block_id for blk in bm.blocks if blk.block_hash is not None}
    assert registered == bm._hash_to_block
    for blk in bm.blocks:
        assert (blk.block_hash is None) == (blk.token_ids == ())
        assert (blk.block_hash is None) == (blk.parent_block_id is None)
        if blk.block_hash is not None:
            assert len(blk.token_ids) == bs
    assert bm.usage == 1.0 - bm.num_free_blocks / bm.num_blocks


def run_all(engine: LLMEngine, max_steps: int = 10_000, check: bool = True
            ) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Step until idle; returns ``(tokens per request, finish reason per request)``."""
    tokens: dict[str, list[int]] = defaultdict(list)
    reasons: dict[str, str] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.request_id not in reasons, f"output after the final one for {out.request_id}"
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if check:
            check_engine(engine)
    else:
        raise AssertionError("engine did not go idle")
    return dict(tokens), reasons
