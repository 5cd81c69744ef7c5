"""The rule that orders engine replicas (stages/routing/policy.py): hits against load."""

from __future__ import annotations

import random

from stages.routing.load import FULL
from stages.routing.policy import Candidate, Policy, rank, score


def order(candidates: list[Candidate], prompt_tokens: int = 2000, per_request: float = 256, **kw) -> list[str]:
    kw.setdefault("policy", Policy.CACHE_AWARE)
    return [r.replica for r in rank(candidates, prompt_tokens=prompt_tokens,
                                    prefill_tokens_per_request=per_request, **kw)]


def test_with_equal_queues_the_cache_decides():
    assert order([Candidate("a", 1.0, 0), Candidate("b", 1.0, 1900)]) == ["b", "a"]


def test_with_equal_caches_the_load_decides():
    # A shared system prompt only: both hold the same 32 tokens.
    assert order([Candidate("a", 3.0, 32), Candidate("b", 1.0, 32)]) == ["b", "a"]


def test_a_hit_is_worth_its_tokens_in_requests_waiting_ahead():
    # 1,900 tokens saved at 256 tokens a request: worth about 7.4 requests of queueing.
    assert order([Candidate("a", 0.0, 0), Candidate("b", 7.0, 1900)]) == ["b", "a"]
    assert order([Candidate("a", 0.0, 0), Candidate("b", 8.0, 1900)]) == ["a", "b"]
    # The knob: at 1,000 tokens a request the same hit is worth under 2 requests.
    assert order([Candidate("a", 0.0, 0), Candidate("b", 2.0, 1900)], per_request=1000) == ["a", "b"]


def test_a_full_queue_is_never_chosen_for_a_hit():
    ranked = rank([Candidate("a", FULL, 2000), Candidate("b", 5.0, 0)], policy=Policy.CACHE_AWARE,
                  prompt_tokens=2000, prefill_tokens_per_request=256)
    assert [r.replica for r in ranked] == ["b", "a"] and ranked[1].score == FULL


def test_replicas_that_refused_go_last_whatever_they_hold():
    assert order([Candidate("a", 0.0, 1900, avoid=True), Candidate("b", 4.0, 0)]) == ["b", "a"]
    for policy in Policy:
        assert order([Candidate("a", 0.0, 0, avoid=True), Candidate("b", 9.0, 0)], policy=policy,
                     rng=random.Random(1))[-1] == "a"


def test_the_score_counts_only_what_is_left_to_compute():
    assert score(Candidate("a", 2.0, 1024), 2048, 512) == 4.0
    assert score(Candidate("a", 0.0, 4096), 2048, 512) == 0.0  # never negative
    ranked = rank([Candidate("a", 1.0, 512)], policy=Policy.CACHE_AWARE, prompt_tokens=1024,
                  prefill_tokens_per_request=256)
    assert ranked[0].cached_tokens == 512 and ranked[0].score == 3.0


def test_least_loaded_ignores_the_cache():
    assert order([Candidate("a", 0.0, 0), Candidate("b", 1.0, 1900)], policy=Policy.LEAST_LOADED) == ["a", "b"]


def test_round_robin_takes_turns():
    cands = [Candidate("a", 0.0), Candidate("b", 9.0), Candidate("c", 0.0)]
    firsts = [order(cands, policy=Policy.ROUND_ROBIN, turn=t)[0] for t in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]


def test_power_of_two_picks_the_less_loaded_of_a_random_pair():
    cands = [Candidate("a", 0.0), Candidate("b", 5.0), Candidate("c", 9.0)]
    rng = random.Random(7)
    firsts = [order(cands, policy=Policy.POWER_OF_TWO, rng=rng)[0] for _ in range(300)]
    # "c" is never first (it loses to either partner); "b" is first exactly when the pair is (b, c).
    assert set(firsts) == {"a", "b"} and 60 < firsts.count("b") < 140
