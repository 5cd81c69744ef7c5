"""Unit tests of the continuous-batching scheduler (no model: tests advance requests by hand)."""

from __future__ import annotations

import random

import pytest

from stages.config import EngineSettings
from stages.engine.core.block_manager import BlockManager
from stages.engine.core.request import EventType, Request, RequestStatus
from stages.engine.core.scheduler import Scheduler, SchedulerOutput
from stages.transport.messages import SamplingParams
from tests.fakes import check_block_manager

BS = 4


def make(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 64, threshold: int = 0,
         caching: bool = True) -> Scheduler:
    return Scheduler(EngineSettings(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                    long_prefill_token_threshold=threshold),
                     BlockManager(num_blocks, BS, caching))


def add(sched: Scheduler, rid: str, n: int, first: int = 0) -> Request:
    r = Request(rid, [(first + i) % 40 for i in range(n)], SamplingParams())
    sched.add(r)
    return r


def advance(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does after the model ran: count computed tokens, cache blocks, sample."""
    for s in out.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
        sched.block_manager.cache_full_blocks(s.request)
        if s.request.num_computed_tokens == s.request.num_tokens:
            s.request.append_output(token, None)


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    advance(sched, out)
    check(sched)
    return out


def check(sched: Scheduler) -> None:
    check_block_manager(sched.block_manager, [*sched.running, *sched.waiting])
    assert len(sched.running) <= sched.config.max_num_seqs
    for r in sched.waiting:
        assert r.block_table == [] and r.num_computed_tokens == 0


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


# -- budget and ordering ----------------------------------------------------------------------------
@pytest.mark.parametrize("threshold", [0, 5])
def test_token_budget_respected_every_step(threshold):
    rng = random.Random(threshold)
    sched = make(num_blocks=48, budget=16, max_num_seqs=6, threshold=threshold)
    n = 0
    for _ in range(150):
        if rng.random() < 0.3:
            add(sched, f"r{n}", rng.randint(1, 60), first=rng.randint(0, 3))
            n += 1
        out = sched.schedule()
        assert out.num_batched_tokens <= 16
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        for s in out.scheduled:
            assert s.num_new_tokens >= 1
            if threshold and s.num_new_tokens > 1:
                assert s.num_new_tokens <= threshold
            assert s.start + s.num_new_tokens <= s.request.num_tokens
            assert len(s.request.block_table) * BS >= s.start + s.num_new_tokens
        advance(sched, out)
        for r in list(sched.running):
            if r.num_output_tokens >= 5:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
        check(sched)
    assert n > 20


def test_running_decodes_go_before_new_prefills():
    sched = make(budget=8)
    d = add(sched, "d", 3)
    assert plan(step(sched)) == [("d", 3)]
    long = add(sched, "long", 20)
    out = step(sched)
    assert plan(out) == [("d", 1), ("long", 7)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    assert d.num_output_tokens == 2 and long.num_computed_tokens == 7


@pytest.mark.parametrize("threshold", [0, 8])
def test_long_prompt_is_chunked_and_decodes_never_stall(threshold):
    sched = make(budget=16, threshold=threshold)
    d = add(sched, "d", 4)
    step(sched)
    long = add(sched, "long", 100, first=5)
    chunks = []
    while long.num_output_tokens == 0:
        before = d.num_output_tokens
        out = step(sched)
        assert out.num_batched_tokens <= 16
        assert out.scheduled[0].request is d and out.scheduled[0].num_new_tokens == 1
        assert d.num_output_tokens == before + 1  # the decode got its token this step
        assert [s.request for s in out.scheduled] == [d, long]
        chunks.append(out.scheduled[1].num_new_tokens)
    assert sum(chunks) == 100
    assert max(chunks) == (threshold or 15)
    assert len(chunks) == -(-100 // (threshold or 15))


def test_prefill_admitted_first_leaves_room_for_later_decodes():
    """A prefill capped by the threshold leaves budget; a later request then decodes every step."""
    sched = make(budget=16, threshold=8)
    long = add(sched, "long", 100)
    short = add(sched, "short", 3, first=20)
    out = step(sched)
    assert plan(out) == [("long", 8), ("short", 3)]
    steps = 0
    while long.num_output_tokens == 0:
        before, remaining = short.num_output_tokens, 100 - long.num_computed_tokens
        assert plan(step(sched)) == [("long", min(8, remaining)), ("short", 1)]
        assert short.num_output_tokens == before + 1
        steps += 1
    assert steps == -(-92 // 8)


def test_max_num_seqs_caps_running_requests():
    sched = make(max_num_seqs=2)
    reqs = [add(sched, f"r{i}", 3, first=i) for i in range(5)]
    out = step(sched)
    assert plan(out) == [("r0", 3), ("r1", 3)]
    assert sched.running == reqs[:2] and list(sched.waiting) == reqs[2:]
    assert plan(step(sched)) == [("r0", 1), ("r1", 1)]
    sched.finish(reqs[0], RequestStatus.FINISHED_STOPPED)
    assert plan(step(sched)) == [("r1", 1), ("r2", 3)]


def test_fifo_head_that_does_not_fit_blocks_the_queue():
    sched = make(num_blocks=8)
    big = add(sched, "big", 20)  # 5 blocks
    head = add(sched, "head", 16, first=20)  # 4 blocks: does not fit in the 3 left
    small = add(sched, "small", 2, first=5)  # 1 block: would fit, but must not overtake
    out = step(sched)
    assert plan(out) == [("big", 20)]
    assert list(sched.waiting) == [head, small]
    assert head.block_table == [] and head.num_computed_tokens == 0
    assert head.status is RequestStatus.WAITING and small.status is RequestStatus.WAITING
    assert plan(step(sched)) == [("big", 1)]
    sched.finish(big, RequestStatus.FINISHED_LENGTH)
    assert plan(step(sched)) == [("head", 16), ("small", 2)]


def test_admission_needs_blocks_for_the_next_chunk_only():
    sched = make(num_blocks=8, budget=8)
    big = add(sched, "big", 20)
    for _ in range(3):
        step(sched)  # big: 8 + 8 + 4 tokens -> 5 blocks
    assert big.num_output_tokens == 1 and len(big.block_table) == 5
    head = add(sched, "head", 16, first=20)  # 4 blocks in all, but its first chunk (7 tokens) needs 2
    out = step(sched)
    assert plan(out) == [("big", 1), ("head", 7)]
    assert len(head.block_table) == 2


def test_no_admission_without_budget():
    sched = make(budget=4)
    add(sched, "a", 10)
    b = add(sched, "b", 2)
    assert plan(step(sched)) == [("a", 4)]
    assert list(sched.waiting) == [b]


# -- preemption -------------------------------------------------------------------------------------
def test_preempts_newest_running_request_to_front_of_queue():
    sched = make(num_blocks=6)
    r1 = add(sched, "r1", 7)
    add(sched, "r2", 6, first=10)
    r3 = add(sched, "r3", 7, first=20)
    assert plan(step(sched)) == [("r1", 7), ("r2", 6), ("r3", 7)]  # 2 blocks each: pool full
    late = add(sched, "late", 2, first=30)  # one block: fits after the preemption, yet waits
    out = step(sched)  # r1 (8 tokens) fits; then r1 needs a 3rd block at 9
    assert plan(out) == [("r1", 1), ("r2", 1), ("r3", 1)]
    out = step(sched)
    assert out.preempted == [r3]
    assert plan(out) == [("r1", 1), ("r2", 1)]
    assert r3.status is RequestStatus.PREEMPTED
    assert r3.num_computed_tokens == 0 and r3.block_table == []
    assert r3.num_preemptions == 1 and sched.num_preemptions == 1
    assert r3.output_token_ids == [7, 7]  # kept: recomputed later, not re-sampled
    assert list(sched.waiting) == [r3, late]  # front of the queue; no admission this step
    assert sched.block_manager.num_free_blocks == 1
    assert r3.last_event(EventType.PREEMPTED) is not None
    # Next step it is admitted again, first, and recomputes prompt + output tokens (its cached
    # blocks were reclaimed meanwhile); the pool is then full again, so ``late`` still waits.
    sched.finish(r1, RequestStatus.FINISHED_LENGTH)
    queries = sched.block_manager.stats.queries
    out = step(sched)
    assert plan(out) == [("r2", 1), ("r3", 9)]
    assert sched.block_manager.stats.queries == queries + 9  # each admission looks up all its tokens
    assert list(sched.waiting) == [late]
    assert r3.status is RequestStatus.RUNNING
    assert [e.type for e in r3.events].count(EventType.RESUMED) == 1
    assert [e.type for e in r3.events].count(EventType.SCHEDULED) == 1
    assert r3.output_token_ids == [7, 7, 7]


def test_several_victims_newest_first_and_self_preemption():
    sched = make(num_blocks=4, budget=16, threshold=8)
    r1 = add(sched, "r1", 16)
    r2 = add(sched, "r2", 3, first=10)
    r3 = add(sched, "r3", 3, first=20)
    assert plan(step(sched)) == [("r1", 8), ("r2", 3), ("r3", 3)]
    out = step(sched)  # r1 needs 2 more blocks: preempts r3, then r2
    assert out.preempted == [r3, r2]
    assert plan(out) == [("r1", 8)]
    assert list(sched.waiting) == [r2, r3]  # the older victim first
    assert sched.num_preemptions == 2
    # r1 now needs a 5th block; nobody newer is left, so it preempts itself.
    out = step(sched)
    assert out.preempted == [r1] and out.scheduled == []
    assert list(sched.waiting) == [r1, r2, r3]
    assert sched.running == [] and sched.block_manager.num_free_blocks == 4
    assert sched.num_preemptions == 3


def test_preemption_with_shared_prefix_blocks_keeps_ref_counts():
    sched = make(num_blocks=7)
    a = add(sched, "a", 9)
    step(sched)
    b = add(sched, "b", 9)  # same prompt: 2 cached blocks shared
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    for _ in range(12):
        step(sched)  # grows until the pool is exhausted and b is preempted
        if sched.num_preemptions:
            break
    assert b.status is RequestStatus.PREEMPTED
    assert all(sched.block_manager.blocks[x].ref_count == 1 for x in a.block_table)
    assert b.num_cached_tokens == 8  # first admission's value is kept


# -- chunk limits ------------------------------------------------------------------------------------
def test_long_prefill_token_threshold():
    sched = make(budget=32, threshold=5)
    add(sched, "d", 2)
    assert plan(step(sched)) == [("d", 2)]
    add(sched, "a", 12, first=3)
    add(sched, "b", 12, first=9)
    assert plan(step(sched)) == [("d", 1), ("a", 5), ("b", 5)]
    assert plan(step(sched)) == [("d", 1), ("a", 5), ("b", 5)]
    assert plan(step(sched)) == [("d", 1), ("a", 2), ("b", 2)]
    assert plan(step(sched)) == [("d", 1), ("a", 1), ("b", 1)]


def test_prefix_hit_at_admission_skips_cached_tokens_and_counts_stats():
    sched = make()
    a = add(sched, "a", 18)
    step(sched)
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    bm = sched.block_manager
    assert (bm.stats.queries, bm.stats.hits) == (18, 0)
    b = add(sched, "b", 18)
    out = sched.schedule()
    assert plan(out) == [("b", 2)]
    assert out.scheduled[0].start == 16
    advance(sched, out)
    assert b.num_cached_tokens == 16
    assert (bm.stats.queries, bm.stats.hits) == (36, 16)
    assert b.first_event(EventType.SCHEDULED) is not None


def test_finish_from_waiting_and_running_frees_blocks():
    sched = make(num_blocks=8, budget=4)
    a = add(sched, "a", 10)
    b = add(sched, "b", 3)
    step(sched)
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert list(sched.waiting) == [] and b.status is RequestStatus.FINISHED_ABORTED
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert sched.running == [] and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 8
    sched.finish(a, RequestStatus.FINISHED_STOPPED)  # already finished: no-op, no double free
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert [e.type for e in a.events].count(EventType.FINISHED) == 1
    check(sched)


def test_config_validation():
    with pytest.raises(ValueError):
        EngineSettings(max_num_batched_tokens=0)
    with pytest.raises(ValueError):
        EngineSettings(max_num_seqs=0)
