"""The engine core driven directly with a deterministic fake runner: stopping, abort from every state,
preemption and prefix caching (outputs must not change), timestamps, validation, and a Hypothesis
state machine checking the KV bookkeeping after every operation."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from stages.engine.core.engine import LLMEngine
from stages.engine.core.errors import EngineError
from stages.engine.core.request import EventType, RequestStatus
from tests.fakes import VOCAB, check_engine, make_engine, params, reference, run_all


def prompt(n: int, first: int = 0, alphabet: int = 40) -> list[int]:
    return [(first + 3 * i) % alphabet for i in range(n)]


def first_new_token(ref: list[int], start: int = 1) -> tuple[int, int]:
    """An index ``k >= start`` and the token there, such that the token does not occur before it."""
    for k in range(start, len(ref)):
        if ref[k] not in ref[:k]:
            return k, ref[k]
    raise AssertionError("no fresh token in the reference")


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.block_manager.usage == 0.0
    check_engine(engine)


# -- stopping -------------------------------------------------------------------------------------
def test_outputs_match_the_reference_and_stop_on_max_tokens():
    engine = make_engine()
    for i, n in enumerate([1, 5, 17, 30]):
        engine.add_request(f"r{i}", prompt(n, i), params(max_tokens=6 + i))
    tokens, reasons = run_all(engine)
    for i, n in enumerate([1, 5, 17, 30]):
        assert tokens[f"r{i}"] == reference(prompt(n, i), 6 + i)
        assert reasons[f"r{i}"] == "length"
    stats = engine.stats()
    assert stats.finished_total == {"stop": 0, "length": 4, "abort": 0}
    assert stats.generation_tokens_total == sum(6 + i for i in range(4))
    assert stats.prompt_tokens_total == 1 + 5 + 17 + 30
    assert_idle(engine)


def test_stops_on_eos_and_reports_it():
    p = prompt(9)
    k, eos = first_new_token(reference(p, 40))
    engine = make_engine(eos=(eos,))
    engine.add_request("r", p, params(max_tokens=40))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert [t for o in outs for t in o.new_token_ids] == reference(p, k + 1)
    final = outs[-1]
    assert final.finished and final.finish_reason == "stop" and final.stop_token_id == eos
    assert all(not o.finished for o in outs[:-1])
    assert engine.stats().finished_total["stop"] == 1
    assert_idle(engine)


def test_ignore_eos_runs_to_max_tokens():
    p = prompt(9)
    k, eos = first_new_token(reference(p, 40))
    engine = make_engine(eos=(eos,))
    engine.add_request("r", p, params(max_tokens=k + 5, ignore_eos=True))
    tokens, reasons = run_all(engine)
    assert tokens["r"] == reference(p, k + 5) and eos in tokens["r"]
    assert reasons["r"] == "length"


def test_stops_on_stop_token_ids_even_with_ignore_eos():
    p = prompt(11, 2)
    k, stop = first_new_token(reference(p, 40), start=2)
    engine = make_engine()
    engine.add_request("r", p, params(max_tokens=40, stop_token_ids=[stop], ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert [t for o in outs for t in o.new_token_ids] == reference(p, k + 1)
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_token_id == stop


def test_stops_at_max_model_len():
    engine = make_engine(max_model_len=20)
    assert engine.max_model_len == 20
    engine.add_request("r", prompt(15), params(max_tokens=100))
    tokens, reasons = run_all(engine)
    assert tokens["r"] == reference(prompt(15), 5)
    assert reasons["r"] == "length"
    assert_idle(engine)


def test_max_model_len_is_capped_by_the_pool():
    engine = make_engine(num_blocks=5, block_size=4, model_max_len=100)
    assert engine.max_model_len == 20
    engine.add_request("r", prompt(19), params(max_tokens=10))
    tokens, reasons = run_all(engine)
    assert tokens["r"] == reference(prompt(19), 1) and reasons["r"] == "length"


def test_finish_reasons_map_to_openai_names():
    from stages.engine.core.request import FINISH_REASONS
    assert FINISH_REASONS == {RequestStatus.FINISHED_STOPPED: "stop",
                              RequestStatus.FINISHED_LENGTH: "length",
                              RequestStatus.FINISHED_ABORTED: "abort"}
    assert all(s.is_finished for s in FINISH_REASONS)
    assert not any(s.is_finished for s in (RequestStatus.WAITING, RequestStatus.PREEMPTED,
                                           RequestStatus.RUNNING))


# -- abort ------------------------------------------------------------------------------------------
def check_aborted(engine: LLMEngine, rid: str, streamed: list[int]) -> None:
    """After ``abort(rid)``: its blocks are free now and the next step carries its final output."""
    assert rid not in engine.requests
    check_engine(engine)
    outs = engine.step()
    mine = [o for o in outs if o.request_id == rid]
    assert len(mine) == 1
    assert mine[0].finish_reason == "abort" and mine[0].new_token_ids == []
    assert "engine_total" in mine[0].timings
    assert streamed == reference(prompt(30), len(streamed))
    assert engine.stats().finished_total["abort"] == 1
    rest, reasons = run_all(engine)
    assert rid not in rest  # nothing after the final output
    assert_idle(engine)


def test_abort_waiting_request():
    engine = make_engine()
    engine.add_request("r", prompt(30), params())
    assert engine.abort("r") is True
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    check_aborted(engine, "r", [])


def test_abort_mid_prefill():
    engine = make_engine(budget=8)
    other = prompt(3, 7)
    engine.add_request("r", prompt(30), params())
    engine.add_request("other", other, params(max_tokens=12))
    assert engine.step() == []
    r = engine.requests["r"]
    assert r.status is RequestStatus.RUNNING and r.num_computed_tokens == 8 and r.block_table
    held = len(r.block_table)
    free_before = engine.block_manager.num_free_blocks
    assert engine.abort("r") is True
    assert engine.block_manager.num_free_blocks == free_before + held
    check_engine(engine)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs][0] == ("r", "abort")
    tokens, _ = run_all(engine)
    streamed = [t for o in outs if o.request_id == "other" for t in o.new_token_ids] + tokens["other"]
    assert streamed == reference(other, 12)
    assert_idle(engine)


def test_abort_decoding_request():
    engine = make_engine()
    engine.add_request("r", prompt(30), params(max_tokens=50))
    streamed = []
    for _ in range(4):
        streamed += [t for o in engine.step() for t in o.new_token_ids]
    assert len(streamed) == 4
    assert engine.abort("r") is True
    check_aborted(engine, "r", streamed)


def test_abort_preempted_request():
    engine = make_engine(num_blocks=12, block_size=4)
    engine.add_request("old", prompt(10, 1), params(max_tokens=25))
    engine.add_request("r", prompt(30), params(max_tokens=15))
    streamed: dict[str, list[int]] = {"old": [], "r": []}
    for _ in range(100):
        for o in engine.step():
            streamed[o.request_id] += o.new_token_ids
        if engine.requests["r"].status is RequestStatus.PREEMPTED:
            break
    r = engine.requests["r"]
    assert r.status is RequestStatus.PREEMPTED and r.block_table == []
    assert engine.stats().num_preemptions >= 1
    assert engine.abort("r") is True
    assert r.status is RequestStatus.FINISHED_ABORTED
    assert r not in engine.scheduler.waiting
    check_aborted(engine, "r", streamed["r"])


def test_abort_unknown_and_finished_ids_are_no_ops():
    engine = make_engine()
    assert engine.abort("nope") is False
    assert engine.step() == [] and not engine.has_unfinished()
    engine.add_request("r", prompt(5), params(max_tokens=2))
    run_all(engine)
    assert engine.abort("r") is False
    assert engine.step() == []
    assert engine.stats().finished_total == {"stop": 0, "length": 1, "abort": 0}
    # Aborting twice: the second call is a no-op and only one final output comes.
    engine.add_request("s", prompt(5), params(max_tokens=20))
    engine.step()
    assert engine.abort("s") is True
    assert engine.abort("s") is False
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("s", "abort")]
    assert engine.stats().finished_total["abort"] == 1
    assert_idle(engine)


# -- preemption and prefix caching keep outputs ----------------------------------------------------
WORKLOAD = [(prompt(23, 0), 18), (prompt(17, 5), 20), (prompt(30, 2), 9), (prompt(9, 11), 20),
            (prompt(23, 0)[:20] + [1, 2], 15), (prompt(6, 3), 20)]


def run_workload(engine: LLMEngine, staggered: bool = False):
    pending = list(enumerate(WORKLOAD))
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while pending or engine.has_unfinished():
        if pending:
            i, (p, n) = pending.pop(0)
            engine.add_request(f"r{i}", p, params(max_tokens=n))
            if not staggered:
                continue
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        check_engine(engine)
    return tokens, reasons


@pytest.mark.parametrize("staggered", [False, True])
def test_tiny_pool_preempts_but_outputs_are_identical(staggered):
    big = make_engine(num_blocks=200, budget=32)
    tiny = make_engine(num_blocks=13, budget=32)  # capacity 52 tokens >= the longest request
    expected = run_workload(big, staggered)
    got = run_workload(tiny, staggered)
    assert big.stats().num_preemptions == 0
    assert tiny.stats().num_preemptions > 0
    assert got == expected
    for i, (p, n) in enumerate(WORKLOAD):
        assert expected[0][f"r{i}"] == reference(p, n)
    assert_idle(tiny)


def test_prefix_cache_hit_gives_same_outputs():
    shared = prompt(26, 4)
    second = shared[:24] + [7, 8, 9]
    outputs = {}
    for caching in (False, True):
        engine = make_engine(prefix_caching=caching)
        engine.add_request("a", shared, params(max_tokens=10))
        run_all(engine)
        engine.add_request("b", second, params(max_tokens=10))
        outs = []
        while engine.has_unfinished():
            outs.extend(engine.step())
            check_engine(engine)
        outputs[caching] = [t for o in outs for t in o.new_token_ids]
        cached = {o.num_cached_tokens for o in outs}
        if caching:
            assert cached == {24}
            assert engine.stats().prefix_cache_hits == 24
            assert engine.stats().prefix_cache_queries == 26 + 27
        else:
            assert cached == {0}
            assert engine.stats().prefix_cache_hits == 0
        assert_idle(engine)
    assert outputs[True] == outputs[False] == reference(second, 10)


def test_concurrent_requests_share_prefix_blocks():
    engine = make_engine(budget=64)
    shared = prompt(16, 9)
    engine.add_request("a", shared + [1], params(max_tokens=20))
    engine.step()
    engine.add_request("b", shared + [2], params(max_tokens=20))
    engine.step()
    a, b = engine.requests["a"], engine.requests["b"]
    assert b.num_cached_tokens == 16
    assert a.block_table[:4] == b.block_table[:4]
    assert all(engine.block_manager.blocks[x].ref_count == 2 for x in a.block_table[:4])
    run_all(engine)
    assert a.output_token_ids == reference(shared + [1], 20)
    assert b.output_token_ids == reference(shared + [2], 20)
    assert_idle(engine)


# -- timestamps ---------------------------------------------------------------------------------------
def test_events_are_ordered_and_timings_non_negative():
    engine = make_engine(budget=8)
    engine.add_request("r", prompt(30), params(max_tokens=5))
    req = engine.requests["r"]
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    types = [e.type for e in req.events]
    assert types == ([EventType.ARRIVED, EventType.QUEUED, EventType.SCHEDULED]
                     + [EventType.PREFILL_CHUNK] * 4 + [EventType.FIRST_TOKEN]
                     + [EventType.DECODE_STEP] * 4 + [EventType.FINISHED])
    stamps = [e.timestamp for e in req.events]
    assert stamps == sorted(stamps)
    assert [e.data["tokens"] for e in req.events if e.type is EventType.PREFILL_CHUNK] == [8, 8, 8, 6]
    t = req.timings()
    for key in ("queue", "prefill", "decode", "engine_total"):
        assert t[key] >= 0
    assert t["decode_steps"] == 4 and t["prefill_chunks"] == 4 and t["num_preemptions"] == 0
    assert "prefill" in outs[0].timings  # the first-token output carries timings
    assert outs[-1].timings["engine_total"] == t["engine_total"]


def test_preempted_request_events():
    engine = make_engine(num_blocks=12, budget=64)
    engine.add_request("old", prompt(20, 1), params(max_tokens=25))
    engine.add_request("new", prompt(20, 2), params(max_tokens=25))
    new = engine.requests["new"]
    run_all(engine)
    types = [e.type for e in new.events]
    assert EventType.PREEMPTED in types and EventType.RESUMED in types
    assert types.count(EventType.SCHEDULED) == 1 and types.count(EventType.FIRST_TOKEN) == 1
    assert types.index(EventType.PREEMPTED) < types.index(EventType.RESUMED)
    stamps = [e.timestamp for e in new.events]
    assert stamps == sorted(stamps)
    assert new.timings()["num_preemptions"] == new.num_preemptions >= 1
    assert new.output_token_ids == reference(prompt(20, 2), 25)


# -- validation --------------------------------------------------------------------------------------
def test_add_request_rejects_bad_requests():
    engine = make_engine(max_model_len=32)
    with pytest.raises(EngineError, match="empty"):
        engine.add_request("a", [], params())
    with pytest.raises(EngineError):
        engine.add_request("a", prompt(32), params())
    engine.add_request("ok", prompt(31), params(max_tokens=1))  # the longest accepted
    with pytest.raises(EngineError, match="token ids"):
        engine.add_request("b", [1, VOCAB], params())
    with pytest.raises(EngineError, match="token ids"):
        engine.add_request("b", [-1, 2], params())
    with pytest.raises(EngineError, match="max_tokens"):
        engine.add_request("b", [1, 2], params(max_tokens=0))
    with pytest.raises(EngineError, match="already in use"):
        engine.add_request("ok", [1, 2], params())
    assert set(engine.requests) == {"ok"}
    assert len(engine.scheduler.waiting) == 1
    run_all(engine)
    engine.add_request("ok", [1, 2], params(max_tokens=1))  # a finished id may be reused
    run_all(engine)
    assert_idle(engine)


# -- property test --------------------------------------------------------------------------------------
BASES = [[i % 3 for i in range(80)], [(i * 7) % 5 for i in range(80)], [1] * 80]


class EngineMachine(RuleBasedStateMachine):
    """Random adds, steps and aborts against a small pool; bookkeeping checked after each one."""

    @initialize(num_blocks=st.integers(12, 40), budget=st.sampled_from([4, 7, 16, 33]),
                max_num_seqs=st.integers(1, 6), threshold=st.sampled_from([0, 0, 3, 8]),
                caching=st.booleans())
    def setup(self, num_blocks, budget, max_num_seqs, threshold, caching):
        # gen_vocab=VOCAB: the fake sometimes samples EOS, so "stop" happens too.
        self.engine = make_engine(num_blocks=num_blocks, block_size=4, budget=budget,
                                  max_num_seqs=max_num_seqs, threshold=threshold, model_max_len=100,
                                  prefix_caching=caching, gen_vocab=VOCAB)
        self.prompts: dict[str, tuple[list[int], int]] = {}
        self.streamed: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.aborted_pending: set[str] = set()
        self.next_id = 0

    @rule(requests=st.lists(st.tuples(st.integers(0, len(BASES) - 1), st.integers(0, 80),
                                      st.lists(st.integers(0, 3), max_size=12), st.integers(1, 20)),
                            min_size=1, max_size=3))
    def add(self, requests):
        for base, cut, tail, max_tokens in requests:
            self.add_one((BASES[base][:cut] + tail)[:80] or [2], max_tokens)

    def add_one(self, p, max_tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        if len(p) >= self.engine.max_model_len:
            with pytest.raises(EngineError):
                self.engine.add_request(rid, p, params(max_tokens=max_tokens))
            return
        self.engine.add_request(rid, p, params(max_tokens=max_tokens))
        self.prompts[rid] = (p, max_tokens)
        self.streamed[rid] = []

    @rule(n=st.integers(1, 4))
    def steps(self, n):
        for _ in range(n):
            self.step()

    def step(self):
        outs = self.engine.step()
        for o in outs:
            rid = o.request_id
            assert rid not in self.finished, f"output after the final one for {rid}"
            self.streamed[rid] += o.new_token_ids
            if o.finished:
                self.finished[rid] = o.finish_reason
        for rid in self.aborted_pending:
            assert self.finished.get(rid) == "abort"
        self.aborted_pending.clear()
        event(f"preemptions>0: {self.engine.stats().num_preemptions > 0}")
        event(f"prefix hits>0: {self.engine.stats().prefix_cache_hits > 0}")

    @precondition(lambda self: self.engine.requests)
    @rule(data=st.data())
    def abort_live(self, data):
        rid = data.draw(st.sampled_from(sorted(self.engine.requests)))
        assert self.engine.abort(rid) is True
        self.aborted_pending.add(rid)

    @rule(data=st.data())
    def abort_dead_or_unknown(self, data):
        rid = data.draw(st.sampled_from(["nope", *sorted(self.finished), *sorted(self.aborted_pending)]))
        assert self.engine.abort(rid) is False

    @rule()
    def drain(self):
        for _ in range(3000):
            if not self.engine.has_unfinished():
                break
            self.step()
            self.check()
        assert not self.engine.has_unfinished(), "engine did not go idle"
        bm = self.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert set(self.finished) == set(self.prompts)

    @invariant()
    def check(self):
        check_engine(self.engine)
        eos = set(self.engine.eos_token_ids)
        for rid, toks in self.streamed.items():
            p, max_tokens = self.prompts[rid]
            assert toks == reference(p, len(toks), VOCAB)
            req = self.engine.requests.get(rid)
            if req is not None:
                assert req.output_token_ids == toks
            reason = self.finished.get(rid)
            if reason == "length":
                assert len(toks) == max_tokens or len(p) + len(toks) == self.engine.max_model_len
            elif reason == "stop":
                assert toks[-1] in eos and eos.isdisjoint(toks[:-1])
            elif reason is None:
                assert eos.isdisjoint(toks) and len(toks) < max_tokens

    def teardown(self):
        if hasattr(self, "engine"):
            self.drain()


EngineMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_engine_state_machine = EngineMachine.TestCase
