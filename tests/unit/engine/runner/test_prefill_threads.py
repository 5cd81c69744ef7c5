"""``engine.prefill_threads``: a step with many prompt tokens runs on more intra-op threads, every
other step on ``num_threads``, with the same tokens as a one-thread engine (the embedded model)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from stages.config import EngineSettings
from stages.engine.core.engine import LLMEngine
from stages.model_info import EMBEDDED_MODEL
from stages.transport.messages import SamplingParams

PROMPTS = [[1, *range(100 + 7 * i, 140 + 7 * i)] for i in range(3)]  # 41 tokens each
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    """One engine for every case (loading the model is most of the time): each case sets the
    runner's thread settings itself."""
    before = torch.get_num_threads()
    yield LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(
        device="cpu", kv_cache_memory_gb=0.05, max_num_batched_tokens=256, num_threads=1, prefill_threads=2,
        prefill_threads_min_tokens=100, enable_prefix_caching=False))  # every run computes its prompts
    torch.set_num_threads(before)


def _run(eng: LLMEngine, prefill_threads: int, min_tokens: int = 100
         ) -> tuple[dict[str, list[int]], dict[str, list[float]], list[tuple[int, int]]]:
    """Three prompts at once, then their decodes; returns tokens, logprobs and, per step,
    (tokens computed, threads the step ran on)."""
    runner = eng.runner
    runner.prefill_threads = prefill_threads
    runner.config = runner.config.model_copy(update={"prefill_threads_min_tokens": min_tokens})
    steps: list[tuple[int, int]] = []
    prepare = type(runner).prepare

    def recording(batch):  # runs inside execute, after the step's thread count is set
        ids, meta, ordered = prepare(runner, batch)
        # execute runs under inference mode (without it an engine replica grew from 1.6 to 6 GB
        # over the API tests: found when this decorator slipped onto the method above it)
        assert torch.is_inference_mode_enabled()
        steps.append((len(ids), torch.get_num_threads()))
        return ids, meta, ordered

    runner.prepare = recording
    try:
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", p, PARAMS)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        logprobs: dict[str, list[float]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        while eng.has_unfinished():
            for out in eng.step():
                tokens[out.request_id] += out.new_token_ids
                logprobs[out.request_id] += [lp.logprob for lp in out.logprobs or []]
    finally:
        del runner.prepare
    return tokens, logprobs, steps


def test_a_step_with_many_prompt_tokens_runs_on_prefill_threads_and_decodes_do_not(engine: LLMEngine):
    assert (engine.runner.step_threads, engine.runner.prefill_threads) == (1, 2)  # from the config
    before = engine.stats().steps_by_threads
    tokens, logprobs, steps = _run(engine, prefill_threads=2)
    assert steps[0] == (3 * 41, 2)  # the three prompts in one step: 123 tokens >= 100
    assert steps[1:] and all(s == (3, 1) for s in steps[1:])  # then one decode token each, on 1 thread
    after = engine.stats().steps_by_threads  # what /metrics shows as engine_steps_by_threads_total
    assert {k: after.get(k, 0) - before.get(k, 0) for k in ("1", "2")} == {"1": len(steps) - 1, "2": 1}
    ref_tokens, ref_logprobs, ref_steps = _run(engine, prefill_threads=1)
    assert {threads for _, threads in ref_steps} == {1}
    assert tokens == ref_tokens
    for rid, lps in logprobs.items():  # summation order differs across threads, nothing else
        assert lps == pytest.approx(ref_logprobs[rid], abs=2e-2)


def test_below_the_token_threshold_a_prompt_step_keeps_num_threads(engine: LLMEngine):
    _, _, steps = _run(engine, prefill_threads=2, min_tokens=124)
    assert steps[0] == (123, 1)
    assert {threads for _, threads in steps} == {1}
