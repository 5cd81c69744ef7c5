"""Tests of the engine sampler on synthetic logits (no model): greedy, seeding, filters, penalties,
temperature and logprobs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from stages.engine.core.errors import SamplingError
from stages.engine.core.sampler import Sampler, SamplingContext, apply_penalties
from stages.transport.messages import MAX_TOP_LOGPROBS, SamplingParams


def ctx(prompt: list[int] | None = None, output: list[int] | None = None, **params) -> SamplingContext:
    """A row; seeded rows get their generator the way the engine makes it."""
    sp = SamplingParams(**params)
    gen = Sampler.make_generator(sp.seed) if sp.seed is not None else None
    return SamplingContext(sp, list(prompt or []), list(output or []), gen)


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def draw_many(logits_per_config: list[torch.Tensor], configs: list[dict], n: int, seed: int = 0
              ) -> list[Counter]:
    """Sample ``n`` times per config in one interleaved batch (rows alternate between configs)."""
    rows, batch = [], []
    for _ in range(n):
        for lg, cfg in zip(logits_per_config, configs, strict=True):
            rows.append(ctx(**cfg))
            batch.append(lg)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        out = Sampler().sample(torch.stack(batch), rows)
    counts = [Counter() for _ in configs]
    for i, (tok, _) in enumerate(out):
        counts[i % len(configs)][tok] += 1
    return counts


# -- 1. greedy ----------------------------------------------------------------------------------
def test_greedy_is_argmax_and_fast_path_matches_general(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = randn(6, 1000)
    logits[2, 7] = logits[2, 900] = logits[2].max() + 1.0  # a tie: torch.argmax takes the first
    rows = [ctx(temperature=0.0, top_k=3, top_p=0.5) for _ in range(6)]
    sampler = Sampler()
    general = sampler._sample_general(logits, rows)
    # The fast path must not go through the general path at all.
    monkeypatch.setattr(Sampler, "_sample_general", lambda *a: pytest.fail("fast path not taken"))
    fast = sampler.sample(logits, rows)
    expected = logits.argmax(dim=-1).tolist()
    assert expected[2] == 7
    assert [t for t, _ in fast] == expected
    assert fast == general
    assert all(lp is None for _, lp in fast)


def test_greedy_rows_in_a_mixed_batch_take_the_argmax() -> None:
    logits = randn(4, 1000, seed=1)
    rows = [ctx(temperature=0.0), ctx(temperature=1.0), ctx(temperature=0.0, logprobs=2),
            ctx(temperature=0.7, seed=3)]
    out = Sampler().sample(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    assert out[0][0] == argmax[0] and out[2][0] == argmax[2]


# -- 2. seeded reproducibility ------------------------------------------------------------------
STEPS, VOCAB = 20, 1000
STEP_LOGITS = [randn(VOCAB, seed=100 + s) for s in range(STEPS)]


def run_seeded(seed: int, with_neighbours: bool, **params) -> list[int]:
    """Decode ``STEPS`` tokens for one seeded row, alone or at a moving position in a batch of 5."""
    sampler = Sampler()
    target = ctx(seed=seed, temperature=1.0, **params)
    neighbours = [ctx(temperature=0.9), ctx(seed=seed + 1, top_k=20), ctx(temperature=0.0, logprobs=3),
                  ctx(temperature=1.2, top_p=0.8, frequency_penalty=0.5, output=[1, 2, 2])]
    tokens = []
    for step, lg in enumerate(STEP_LOGITS):
        if with_neighbours:
            pos = step % 5
            rows = neighbours[:pos] + [target] + neighbours[pos:]
            batch = randn(5, VOCAB, seed=500 + step)
            batch[pos] = lg
        else:
            rows, batch, pos = [target], lg[None], 0
        tok, _ = sampler.sample(batch, rows)[pos]
        target.output_token_ids.append(tok)
        tokens.append(tok)
    return tokens


@pytest.mark.parametrize("params", [{}, {"top_k": 50, "top_p": 0.95, "min_p": 0.01}])
def test_seed_reproducible_and_independent_of_batch(params: dict) -> None:
    alone = run_seeded(7, with_neighbours=False, **params)
    assert run_seeded(7, with_neighbours=False, **params) == alone
    assert run_seeded(7, with_neighbours=True, **params) == alone
    # It really sampled: not constant and not just the argmax.
    assert len(set(alone)) > 1
    assert any(t != lg.argmax().item() for t, lg in zip(alone, STEP_LOGITS, strict=True))
    assert run_seeded(8, with_neighbours=False, **params) != alone


def test_missing_generator_is_created_from_seed() -> None:
    lg = randn(1, VOCAB)
    lazy = SamplingContext(SamplingParams(seed=11), [], [], None)
    tok, _ = Sampler().sample(lg, [lazy])[0]
    assert isinstance(lazy.generator, torch.Generator)
    assert Sampler().sample(lg, [ctx(seed=11)])[0][0] == tok


# -- 3. support restriction ---------------------------------------------------------------------
def nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """Smallest set of most likely tokens whose mass reaches top_p, computed by hand in float64."""
    p, order = probs.double().sort(descending=True)
    before = p.cumsum(0) - p
    assert (p.cumsum(0) - top_p).abs().min() > 1e-4, "test logits too close to the nucleus edge"
    return set(order[before < top_p].tolist())


def test_top_k_top_p_min_p_restrict_support_per_row() -> None:
    logits = [randn(64, seed=20 + i, scale=2.0) for i in range(5)]
    configs = [{"top_k": 5}, {"top_p": 0.6}, {"min_p": 0.1},
               {"top_k": 10, "top_p": 0.8, "temperature": 0.7}, {}]
    counts = draw_many(logits, configs, n=2000)

    top5 = set(logits[0].topk(5).indices.tolist())
    in_nucleus = nucleus(logits[1].softmax(0), 0.6)
    p2 = logits[2].softmax(0)
    above_min_p = set(torch.nonzero(p2 >= 0.1 * p2.max()).flatten().tolist())
    # Combined: temperature first, then top-k, then the nucleus of the renormalised top-k.
    scaled = logits[3] / 0.7
    top10 = scaled.topk(10).indices
    renorm = torch.zeros(64).index_put_((top10,), scaled[top10].softmax(0))
    combined = nucleus(renorm, 0.8)

    for observed, allowed in zip(counts[:4], [top5, in_nucleus, above_min_p, combined], strict=True):
        assert len(allowed) < 30  # the filter actually removes tokens
        assert set(observed) == allowed  # nothing outside, and every allowed token shows up
    assert len(counts[4]) > 30  # the unfiltered row ranges far wider


def test_top_k_beyond_the_vocabulary_keeps_every_token_even_past_int64() -> None:
    # Found by the fuzz test: top_k 5.7e28 with a top_p below 1 raised "Overflow when unpacking long
    # long" in the step loop, which killed the engine for every request.
    logits = [randn(64, seed=40, scale=2.0)]
    huge = draw_many(logits, [{"top_k": 56601025981351854763637997568, "top_p": 0.6}], n=2000)
    alone = draw_many(logits, [{"top_p": 0.6}], n=2000)
    assert set(huge[0]) == set(alone[0]) == nucleus(logits[0].softmax(0), 0.6)


def test_a_row_whose_sampling_raises_fails_alone() -> None:
    # A logit_bias on an id beyond the vocabulary (the API refuses it; the engine's own callers need
    # not) is refused on the host before it indexes anything: on CUDA an out-of-range index is a
    # device-side assert that ends the process. In a batch, only that row fails.
    logits = randn(4, 64, seed=41, scale=2.0)
    rows = [ctx(temperature=0.0), ctx(temperature=0.0, logit_bias={64 + 3: 5.0}),
            ctx(temperature=0.7, seed=5), ctx(temperature=0.0, logprobs=2)]
    with pytest.raises(ValueError, match=r"logit_bias has token ids outside the vocabulary \(0\.\.63\): \[67\]"):
        Sampler().sample(logits, rows)
    out = Sampler().sample_or_fail(logits, rows)
    assert isinstance(out[1], SamplingError) and "ValueError" in out[1].message
    assert out[0] == (int(logits[0].argmax()), None)
    assert out[3][0] == int(logits[3].argmax()) and out[3][1] is not None
    # The batched attempt failed before anything drew from the seeded row's generator.
    assert out[2] == Sampler().sample(logits[2:3], [ctx(temperature=0.7, seed=5)])[0]
    # A batch that samples fine is exactly sample()'s.
    good = [rows[0], rows[3]]
    assert Sampler().sample_or_fail(logits[[0, 3]], good) == Sampler().sample(logits[[0, 3]], good)


def test_token_ids_outside_the_vocabulary_are_refused_or_dropped() -> None:
    logits = randn(1, 64, seed=42, scale=2.0)
    # A negative id would index from the end on CPU (and assert on CUDA): refused like a large one.
    for params in ({"logit_bias": {-1: 5.0}}, {"bad_words_token_ids": [[64]]}, {"bad_words_token_ids": [[-2]]}):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            Sampler().sample(logits, [ctx(temperature=0.0, **params)])
    # allowed_token_ids keeps only the ids that exist: a negative one does not allow the last token.
    out = Sampler().sample(logits, [ctx(temperature=0.0, allowed_token_ids=[5, -1, 99])])
    assert out[0][0] == 5


# -- 4. penalties -------------------------------------------------------------------------------
def test_apply_penalties_numerically() -> None:
    base = torch.tensor([2.0, -1.0, 0.5, -0.5, 3.0, 1.0])
    # Token 0 and 1 are in the prompt only; token 2 twice and token 3 once in the output.
    prompt, output = [0, 1], [2, 2, 3]
    rows = [ctx(prompt, output, repetition_penalty=2.0),
            ctx(prompt, output, presence_penalty=0.5),
            ctx(prompt, output, frequency_penalty=0.3),
            ctx(prompt, output, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.3),
            ctx([5], [], repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0)]
    logits = base.repeat(len(rows), 1)
    got = apply_penalties(logits, rows)
    expected = torch.tensor([
        [1.0, -2.0, 0.25, -1.0, 3.0, 1.0],      # repetition: prompt and output tokens
        [2.0, -1.0, 0.0, -1.0, 3.0, 1.0],       # presence: output tokens only, once each
        [2.0, -1.0, -0.1, -0.8, 3.0, 1.0],      # frequency: times the output count
        [1.0, -2.0, -0.85, -1.8, 3.0, 1.0],     # repetition first, then the subtractions
        [2.0, -1.0, 0.5, -0.5, 3.0, 0.5],       # empty output: only repetition on prompt token 5
    ])
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(logits, base.repeat(len(rows), 1))  # input untouched


def test_penalties_steer_sampling() -> None:
    sampler = Sampler()
    lg = torch.tensor([[0.0, 5.0, 4.5, 3.0]])
    assert sampler.sample(lg, [ctx([], [1, 1], temperature=0.0)])[0][0] == 1
    assert sampler.sample(lg, [ctx([], [1, 1], temperature=0.0, frequency_penalty=0.5)])[0][0] == 2
    # A token seen only in the prompt: repetition demotes it, presence/frequency do not.
    assert sampler.sample(lg, [ctx([1], [], temperature=0.0, repetition_penalty=2.0)])[0][0] == 2
    assert sampler.sample(lg, [ctx([1], [], temperature=0.0, presence_penalty=5.0,
                                   frequency_penalty=5.0)])[0][0] == 1


# -- 5. temperature -----------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5])
    n = 20000
    counts = draw_many([logits], [{"temperature": temperature}], n=n, seed=1)[0]
    observed = torch.tensor([counts[i] for i in range(8)], dtype=torch.float64)

    def chi2(probs: torch.Tensor) -> float:
        expected = n * probs.double()
        return float(((observed - expected) ** 2 / expected).sum())

    assert chi2((logits / temperature).softmax(0)) < 30.0  # 7 dof: p ~ 1e-4
    assert chi2(logits.softmax(0)) > 100.0  # and temperature 1 would be clearly rejected


# -- 6. logprobs --------------------------------------------------------------------------------
def test_logprobs_are_raw_log_softmax_with_sorted_top() -> None:
    logits = randn(5, 1000, seed=3, scale=3.0)
    rows = [ctx(list(range(50)), [3, 3], temperature=0.8, repetition_penalty=1.3, top_k=40, logprobs=5),
            ctx(temperature=0.0, logprobs=0),
            ctx(temperature=1.0),
            ctx(temperature=1.0, seed=4, logprobs=25),
            ctx(temperature=0.0, presence_penalty=2.0, output=[int(logits[4].argmax())], logprobs=1)]
    out = Sampler().sample(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    for i, n_top in [(0, 5), (1, 0), (3, MAX_TOP_LOGPROBS), (4, 1)]:
        tok, lp = out[i]
        assert lp is not None and lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-5)
        assert len(lp.top) == n_top
        assert [t for t, _ in lp.top] == ref[i].topk(n_top).indices.tolist()
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        torch.testing.assert_close(torch.tensor(values), ref[i].topk(n_top).values)
    assert out[2][1] is None
    assert out[1][0] == logits[1].argmax().item()
    # Row 4's penalty moved it off the raw argmax, yet its top-1 still reports the raw argmax.
    assert out[4][0] != logits[4].argmax().item()
    assert out[4][1].top[0][0] == logits[4].argmax().item()
