"""A request moved off a lost replica, as the engine sees it: ``add_request(..., output_token_ids=...)``
takes the tokens generated elsewhere as its own output and goes on as if it had sampled them, with the
fake runner (exact, KV-checked) and with a tiny random-weight model (the real runner and sampler,
where a seeded request's draw depends only on its seed and position: ``sampler.step_seed``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.config import EngineSettings
from stages.engine.core.engine import LLMEngine
from stages.engine.core.errors import RequestRejectedError
from stages.engine.core.sampler import step_seed
from stages.transport.messages import SamplingParams
from tests.fakes import VOCAB, check_engine, make_engine, params, reference, run_all

PROMPT = [(3 * i + 1) % 40 for i in range(9)]


# -- the fake runner ----------------------------------------------------------------------------------
def test_carried_tokens_are_the_start_of_the_output_and_are_not_sent_again():
    """Before any step the request's output is the carried tokens; the engine then emits only new ones."""
    ref = reference(PROMPT, 10)
    engine = make_engine()
    req = engine.add_request("r", PROMPT, params(max_tokens=10), output_token_ids=ref[:4])
    assert req.output_token_ids == ref[:4] and req.all_token_ids == PROMPT + ref[:4]
    assert req.num_prompt_tokens == len(PROMPT)
    tokens, reasons = run_all(engine)
    assert tokens["r"] == ref[4:10] and reasons["r"] == "length"
    assert req.output_token_ids == ref
    assert engine.stats().generation_tokens_total == 6
    check_engine(engine)


@pytest.mark.parametrize("k", [1, 5, 9])
def test_a_continued_greedy_request_gives_the_uninterrupted_rest_and_stops_at_max_tokens(k: int):
    """Continued from its own first k tokens: exactly max_tokens - k more, the same as the whole run."""
    whole = make_engine()
    whole.add_request("r", PROMPT, params(max_tokens=10))
    full, _ = run_all(whole)
    rest = make_engine()
    rest.add_request("r", PROMPT, params(max_tokens=10), output_token_ids=full["r"][:k])
    tokens, reasons = run_all(rest)
    assert tokens["r"] == full["r"][k:] and len(tokens["r"]) == 10 - k and reasons["r"] == "length"


def test_a_continued_request_under_preemption_still_gives_the_uninterrupted_rest():
    """Carried tokens survive a preemption by recompute in a tiny pool (they are part of the sequence)."""
    engine = make_engine(num_blocks=12, block_size=4, budget=16, max_num_seqs=4)
    for i in range(4):
        p = PROMPT[i:] + [i]
        engine.add_request(f"r{i}", p, params(max_tokens=14), output_token_ids=reference(p, 3))
    tokens, _ = run_all(engine)
    assert engine.stats().num_preemptions >= 1
    for i in range(4):
        assert tokens[f"r{i}"] == reference(PROMPT[i:] + [i], 14)[3:]


@pytest.mark.parametrize(("carried", "max_tokens", "why"), [
    ([1, 2, 3], 3, "no tokens left"),
    ([1, 2, 3, 4], 3, "no tokens left"),
    ([1, VOCAB], 5, "token ids"),
    ([-1, 2], 5, "token ids"),
])
def test_carried_tokens_that_leave_nothing_to_generate_or_are_out_of_vocab_are_rejected(carried, max_tokens, why):
    """len(output_token_ids) >= max_tokens, or an id outside [0, vocab): RequestRejectedError, nothing queued."""
    engine = make_engine()
    with pytest.raises(RequestRejectedError, match=why):
        engine.add_request("r", PROMPT, params(max_tokens=max_tokens), output_token_ids=carried)
    assert engine.requests == {} and not engine.has_unfinished()


def test_carried_tokens_that_fill_the_context_are_rejected_and_one_short_is_accepted():
    """prompt + carried >= max_model_len leaves no room: rejected; one token short generates one."""
    engine = make_engine(max_model_len=16)
    with pytest.raises(RequestRejectedError):
        engine.add_request("r", PROMPT, params(max_tokens=50), output_token_ids=reference(PROMPT, 7))
    engine.add_request("r", PROMPT, params(max_tokens=50), output_token_ids=reference(PROMPT, 6))
    tokens, reasons = run_all(engine)
    assert tokens["r"] == reference(PROMPT, 7)[6:] and reasons["r"] == "length"


def test_max_tokens_minus_one_carried_generates_exactly_one():
    """The most that may be carried is max_tokens - 1: one more token, then "length"."""
    engine = make_engine()
    engine.add_request("r", PROMPT, params(max_tokens=5), output_token_ids=reference(PROMPT, 4))
    tokens, reasons = run_all(engine)
    assert tokens["r"] == reference(PROMPT, 5)[4:] and reasons["r"] == "length"


# -- step_seed ----------------------------------------------------------------------------------------
def test_step_seed_is_deterministic_and_differs_across_positions_and_seeds():
    """step_seed(seed, position): a pure function, distinct for every (seed, position) pair tried."""
    seeds = [step_seed(s, p) for s in (0, 1, 2, 7, 2**31, 2**63 - 1) for p in range(64)]
    assert len(set(seeds)) == len(seeds)
    assert [step_seed(s, p) for s in (0, 1, 2, 7, 2**31, 2**63 - 1) for p in range(64)] == seeds
    assert all(0 <= s < 2**63 for s in seeds), "a valid torch.Generator.manual_seed argument"
    assert step_seed(1, 0) != step_seed(0, 1) and step_seed(5, 6) != step_seed(6, 5)


# -- a real runner: the tiny random-weight model -----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from stages.model_info import cache_root
    from tests.tools_model import build_tools_model

    return build_tools_model(cache_root() / "test-models" / "tiny-hermes-tools")


def _engine(model: Path) -> LLMEngine:
    return LLMEngine.from_config(str(model), EngineSettings(
        device="cpu", weights="float32", num_threads=1, kv_cache_memory_gb=0.02, max_num_batched_tokens=256))


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    """Two engines of the model: the first runs requests whole, the second (fresh) continues them."""
    yield _engine(tiny_model), _engine(tiny_model)


TINY_PROMPT = [1, 504, 2031, 17, 9001, 33, 42, 7]


def _run(engine: LLMEngine, rid: str, sp: SamplingParams, carried: list[int] | None = None) -> list[int]:
    engine.add_request(rid, TINY_PROMPT, sp, output_token_ids=carried)
    tokens, reasons = run_all(engine, check=False)
    assert reasons[rid] == "length"
    return tokens[rid]


@pytest.mark.parametrize("penalties", [{}, {"frequency_penalty": 1.5, "presence_penalty": 0.5}],
                         ids=["plain", "penalties"])
def test_a_greedy_request_continued_on_a_fresh_engine_gives_the_uninterrupted_rest(engines, penalties):
    """Greedy, continued from its first k tokens on another engine: the same remaining tokens (penalties
    count the carried tokens)."""
    first, fresh = engines
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **penalties)
    whole = _run(first, f"g-{len(penalties)}", sp)
    assert len(whole) == 16
    if penalties:
        assert len(set(whole)) > 8, "the penalties steer it (the carried tokens must count toward them)"
    for k in (1, 6):
        assert _run(fresh, f"g-{len(penalties)}-{k}", sp, whole[:k]) == whole[k:]


def test_a_seeded_request_continued_on_a_fresh_engine_draws_what_the_first_would_have(engines):
    """Seeded (temperature 1), continued from its first k tokens on another engine: the same next tokens,
    since each draw is seeded from (seed, position) only."""
    first, fresh = engines
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    whole = _run(first, "s", sp)
    greedy = _run(first, "s-greedy", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert whole != greedy and len(set(whole)) > 8, "it really sampled"
    assert _run(first, "s-again", sp) == whole, "seeded: reproducible"
    for k in (1, 7):
        assert _run(fresh, f"s-{k}", sp, whole[:k]) == whole[k:]
    other = SamplingParams(max_tokens=16, temperature=1.0, seed=1235, ignore_eos=True)
    assert _run(fresh, "s-other", other, whole[:7]) != whole[7:], "the draw depends on the seed"
