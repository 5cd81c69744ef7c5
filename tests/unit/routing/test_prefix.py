"""What routers expect each replica to hold (stages/routing/prefix.py), against the block manager."""

from __future__ import annotations

from stages.engine.core.block_manager import BlockManager
from stages.engine.core.request import Request
from stages.routing.prefix import PrefixViews, prompt_block_hashes
from stages.transport.messages import PrefixSummary, SamplingParams

BS = 4


def engine_cache(*prompts: list[int]) -> BlockManager:
    """A block manager whose prefix cache holds the full blocks of ``prompts`` (computed, freed)."""
    bm = BlockManager(num_blocks=64, block_size=BS)
    for i, tokens in enumerate(prompts):
        req = Request(f"r{i}", list(tokens), SamplingParams(max_tokens=1))
        assert bm.allocate_slots(req, len(tokens))
        req.num_computed_tokens = len(tokens)
        bm.cache_full_blocks(req)
        bm.free(req)
    return bm


def summary(bm: BlockManager) -> PrefixSummary:
    return PrefixSummary.of(bm.block_size, bm.cache_version, bm.cached_hashes())


def test_the_routing_side_hashes_a_prompt_as_the_engine_does():
    prompt = list(range(1, 18))  # 4 full blocks and a token
    bm = engine_cache(prompt)
    views = PrefixViews()
    views.update("a", summary(bm))
    # The engine finds 4 blocks (16 tokens: the 17th is always computed); so does the router.
    probe = Request("p", prompt, SamplingParams(max_tokens=1))
    assert len(bm.find_cached_prefix(probe)) * BS == views.cached_tokens("a", prompt) == 16
    # The same prompt cut at a block boundary: the last block holds the last token, so it is not a hit.
    assert views.cached_tokens("a", prompt[:16]) == 12
    # A prompt that diverges in its second block hits its first block only; another prefix, nothing.
    assert views.cached_tokens("a", prompt[:4] + [99] * 10) == 4
    assert views.cached_tokens("a", [99] + prompt[1:]) == 0


def test_a_summary_is_4_bytes_a_block_and_holds_only_hashes():
    bm = engine_cache(list(range(1, 33)), list(range(100, 117)))
    s = summary(bm)
    assert len(s) == bm.num_cached_blocks == 12 and len(s.hashes) == 48
    assert s.hash_set() == {PrefixSummary.short(h) for h in bm.cached_hashes()}


def test_the_version_moves_when_blocks_enter_or_leave_the_cache():
    bm = engine_cache(list(range(1, 9)))
    v = bm.cache_version
    req = Request("x", list(range(200, 200 + 64 * BS)), SamplingParams(max_tokens=1))
    assert bm.allocate_slots(req, 64 * BS)  # takes every block: the cached ones are evicted
    assert bm.cache_version > v and bm.num_cached_blocks == 0


def test_sends_count_at_once_and_expire_after_two_newer_summaries():
    bm = engine_cache(list(range(1, 9)))
    views = PrefixViews()
    views.update("a", summary(bm))
    prompt = list(range(1, 9)) + list(range(500, 517))  # cached head, new tail
    assert views.cached_tokens("a", prompt) == 8
    views.sent("a", prompt)
    assert views.cached_tokens("a", prompt) == 24, "what was just sent is expected there"
    other = list(range(700, 720))
    for version in (101, 102):
        views.update("a", PrefixSummary.of(BS, version, [h for h in bm.cached_hashes()]))
        assert views.cached_tokens("a", prompt) == (24 if version == 101 else 8)
    # A repeated version is the same summary: nothing expires.
    views.sent("a", other)
    views.update("a", PrefixSummary.of(BS, 102, bm.cached_hashes()))
    assert views.cached_tokens("a", other) == 16


def test_memory_is_bounded_and_gone_replicas_are_forgotten():
    views = PrefixViews(max_recent=10)
    views.update("a", PrefixSummary.of(BS, 1, []))
    views.update("b", PrefixSummary.of(BS, 1, [1, 2, 3]))
    views.sent("a", list(range(1000)))
    assert views.num_hashes() == 10 + 3
    views.retain(["a"])
    assert views.replicas() == ["a"] and views.num_hashes() == 10
    assert views.cached_tokens("nobody", list(range(100))) == 0


def test_prompt_block_hashes_stop_before_the_last_token():
    assert len(prompt_block_hashes(list(range(8)), BS)) == 1
    assert len(prompt_block_hashes(list(range(9)), BS)) == 2
    assert prompt_block_hashes([], BS) == []
