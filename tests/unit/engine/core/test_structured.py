"""Structured outputs in the engine core, with real llguidance matchers over the real SmolLM2
tokenizer and the deterministic fake runner (tests/fakes.py) that checks the paged KV cache.

The fake picks, among the tokens the request's mask allows, one chosen by the state it reads back
from the KV cache; so a matcher out of step with the request's tokens, or a wrong recompute after
preemption, changes (or breaks) the output.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from stages.config import EngineSettings
from stages.engine.core.engine import LLMEngine
from stages.engine.core.errors import RequestRejectedError
from stages.engine.core.sampler import Sampler, SamplingContext
from stages.engine.core.structured import GrammarBackend, unpack_bitmask
from stages.engine.driver.async_engine import AsyncEngine
from stages.engine.driver.in_process import InProcessDriver
from stages.model_info import load_cpu_tokenizer, model_info
from stages.preprocess.grammar import GrammarCompiler
from stages.transport.messages import EngineRequest, SamplingParams, StructuredOutputSpec
from tests.fakes import FakeRunner, check_engine, run_all

MODEL = "embedded:smollm2-135m-instruct"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "tags", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return load_cpu_tokenizer(MODEL)


@pytest.fixture(scope="module")
def vocab(tokenizer) -> tuple[int, list[int]]:
    info = model_info(MODEL, tokenizer=tokenizer)
    return info.vocab_size, info.eos_token_ids


@pytest.fixture(scope="module")
def compiler(tokenizer, vocab) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab[0], vocab[1])


class MaskedFakeRunner(FakeRunner):
    """The fake runner, sampling only tokens the structured-output mask allows."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.masked_steps = 0

    def execute(self, batch, grammars=None):
        out = super().execute(batch)
        samplers = [s.request for s in batch if s.samples]
        if grammars is None or not any(r.grammar is not None for r in samplers):
            return out
        bitmask = grammars.fill_bitmask([r.grammar for r in samplers], [r.output_token_ids for r in samplers])
        self.masked_steps += 1
        for i, req in enumerate(samplers):
            if req.grammar is None:
                continue
            ids = unpack_bitmask(bitmask[i:i + 1], grammars.n_vocab)[0].nonzero().flatten().tolist()
            choice, _ = out[req.request_id]
            out[req.request_id] = (ids[choice % len(ids)], None)
        return out


def make_engine(tokenizer, vocab, num_blocks: int = 256, block_size: int = 4, max_num_seqs: int = 8
                ) -> tuple[LLMEngine, MaskedFakeRunner]:
    runner = MaskedFakeRunner(num_blocks, block_size, gen_vocab=997)
    config = EngineSettings(block_size=block_size, num_kv_blocks=num_blocks, max_num_batched_tokens=64,
                            max_num_seqs=max_num_seqs)
    engine = LLMEngine(config, runner, vocab[1], vocab[0], 4096, GrammarBackend(tokenizer, vocab[0], vocab[1]))
    runner.block_manager = engine.block_manager
    return engine, runner


def _params(max_tokens: int = 120) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def _add(engine: LLMEngine, compiler: GrammarCompiler, rid: str, prompt: list[int], spec: StructuredOutputSpec,
         max_tokens: int = 120) -> None:
    grammar = compiler.compile_sync(spec)
    engine.grammars.build(grammar)  # what the step loop has done on the grammar pool
    engine.add_request(rid, prompt, _params(max_tokens), grammar=grammar)


def _json_spec() -> StructuredOutputSpec:
    return StructuredOutputSpec("json_schema", json.dumps(SCHEMA))


def test_output_follows_the_schema_and_the_grammar_end_stops(tokenizer, vocab, compiler) -> None:
    engine, runner = make_engine(tokenizer, vocab)
    prompts = {f"r{i}": [1, 5 + i, 9, 13 + i, 2 * i + 1] for i in range(6)}
    for rid, prompt in prompts.items():
        _add(engine, compiler, rid, prompt, _json_spec())
    engine.add_request("free", [3, 4, 5], _params(20))  # an unconstrained neighbour in the same batches
    tokens, reasons = run_all(engine)
    assert runner.masked_steps > 0
    assert reasons["free"] == "length" and len(tokens["free"]) == 20
    texts = set()
    for rid in prompts:
        assert reasons[rid] == "stop", (rid, tokenizer.decode(tokens[rid]))
        text = tokenizer.decode(tokens[rid], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) > 1  # the outputs depend on each request's own state, not one fixed string
    assert engine.stats().grammar_mask_rows > 0


def test_matcher_state_survives_preemption_and_recompute(tokenizer, vocab, compiler) -> None:
    prompts = {f"r{i}": [1, 7 + i, 11, 2 + i, 5, 6 + i, 8] for i in range(6)}

    def run(num_blocks: int) -> tuple[dict[str, list[int]], dict[str, str], int]:
        engine, _ = make_engine(tokenizer, vocab, num_blocks=num_blocks, block_size=4)
        for rid, prompt in prompts.items():
            _add(engine, compiler, rid, prompt, _json_spec())
        tokens, reasons = run_all(engine)
        check_engine(engine)
        return tokens, reasons, engine.scheduler.num_preemptions

    roomy_tokens, roomy_reasons, roomy_preempted = run(512)
    tight_tokens, tight_reasons, tight_preempted = run(16)  # 64 slots for 6 sequences of ~30 tokens
    assert roomy_preempted == 0 and tight_preempted > 0
    assert tight_tokens == roomy_tokens and tight_reasons == roomy_reasons
    for rid in prompts:
        jsonschema.validate(json.loads(tokenizer.decode(tight_tokens[rid], skip_special_tokens=True)), SCHEMA)


def test_a_constrained_request_moved_to_another_engine_replays_its_grammar(tokenizer, vocab, compiler) -> None:
    """A structured-output request continued on a fresh engine from its first k tokens: the matcher
    replays them, so the rest is the same and the whole still matches the schema; carried tokens
    the grammar forbids are refused."""
    prompt = [1, 9, 14, 3, 27]
    whole_engine, _ = make_engine(tokenizer, vocab)
    _add(whole_engine, compiler, "r", prompt, _json_spec())
    tokens, reasons = run_all(whole_engine)
    whole = tokens["r"]
    assert reasons["r"] == "stop" and len(whole) > 8
    for k in (3, len(whole) // 2):
        fresh, _ = make_engine(tokenizer, vocab)
        grammar = compiler.compile_sync(_json_spec())
        fresh.grammars.build(grammar)
        fresh.add_request("r", prompt, _params(), grammar=grammar, output_token_ids=whole[:k])
        rest, rest_reasons = run_all(fresh)
        assert rest["r"] == whole[k:] and rest_reasons["r"] == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(whole[:k] + rest["r"], skip_special_tokens=True)), SCHEMA)
    fresh, _ = make_engine(tokenizer, vocab)
    grammar = compiler.compile_sync(_json_spec())
    fresh.grammars.build(grammar)
    not_json = tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(RequestRejectedError, match="grammar"):
        fresh.add_request("bad", prompt, _params(), grammar=grammar, output_token_ids=not_json)


def test_sync_rolls_back_and_replays(tokenizer, vocab, compiler) -> None:
    """A matcher that has consumed more or fewer tokens than the request (a recompute that dropped
    tokens, or a replay) is brought back to exactly the request's tokens."""
    backend = GrammarBackend(tokenizer, vocab[0], vocab[1])
    grammar = compiler.compile_sync(StructuredOutputSpec("regex", "[a-z]{2,12}"))
    backend.build(grammar)
    ids = tokenizer.encode("hello", add_special_tokens=False) + tokenizer.encode("world", add_special_tokens=False)
    reference = backend.new_state(grammar)
    reference.sync(ids[:1])
    ahead = backend.new_state(grammar)
    ahead.sync(ids)  # consumed everything
    ahead.sync(ids[:1])  # rolled back to the first token
    behind = backend.new_state(grammar)
    behind.sync(ids[:1])
    masks = backend.fill_bitmask([reference, ahead, behind], [ids[:1]] * 3)
    assert ahead.num_consumed == behind.num_consumed == 1
    assert torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])
    fresh = backend.new_state(grammar)
    assert not torch.equal(backend.fill_bitmask([fresh], [[]])[0], masks[0])  # the state really moved


def test_abort_leaves_the_others_valid(tokenizer, vocab, compiler) -> None:
    engine, _ = make_engine(tokenizer, vocab)
    for i in range(3):
        _add(engine, compiler, f"r{i}", [1, 2, 3 + i], _json_spec())
    early: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    for _ in range(6):
        for out in engine.step():
            early[out.request_id].extend(out.new_token_ids)
    assert engine.abort("r1")
    tokens, reasons = run_all(engine)
    tokens = {rid: early[rid] + tokens.get(rid, []) for rid in early}
    assert reasons["r1"] == "abort" and "r1" not in engine.requests
    for rid in ("r0", "r2"):
        assert reasons[rid] == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(tokens[rid], skip_special_tokens=True)), SCHEMA)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_step_loop_never_compiles_a_missing_grammar(tokenizer, vocab, compiler) -> None:
    engine, _ = make_engine(tokenizer, vocab)
    grammar = compiler.compile_sync(StructuredOutputSpec("regex", "[0-9]{4}"))
    with pytest.raises(RequestRejectedError, match="not built on this engine"):
        engine.add_request("r", [1, 2, 3], _params(), grammar=grammar)
    assert engine.grammars.templates_built == 0
    other = GrammarBackend(tokenizer, vocab[0] + 32, vocab[1])  # another tokenizer digest
    with pytest.raises(RequestRejectedError, match="different tokenizer"):
        other.build(grammar)


def test_n_choices_have_their_own_matchers(tokenizer, vocab, compiler) -> None:
    """n=3 through the async engine: the template is built off the step thread, each choice gets a
    copy; aborting one choice leaves the other two to finish valid."""
    engine, _ = make_engine(tokenizer, vocab)
    grammar = compiler.compile_sync(_json_spec())
    request = EngineRequest("req", [1, 4, 9, 16], SamplingParams(max_tokens=120, temperature=0.0), n=3,
                            grammar=grammar)

    async def run() -> dict[int, tuple[list[int], str]]:
        aeng = AsyncEngine(InProcessDriver(engine))
        aeng.start()
        out: dict[int, tuple[list[int], str]] = {}
        tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
        aborted = False
        try:
            async for items in aeng.generate(request):
                for o in items:
                    tokens[o.index].extend(o.new_token_ids)
                    if o.finish_reason:
                        out[o.index] = (tokens[o.index], o.finish_reason)
                if not aborted and tokens[1]:
                    aeng.abort("req-1")
                    aborted = True
        finally:
            aeng.shutdown()
        return out

    out = asyncio.run(run())
    assert engine.grammars.templates_built == 1
    assert out[1][1] == "abort"
    for i in (0, 2):
        assert out[i][1] == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(out[i][0], skip_special_tokens=True)), SCHEMA)


# -- the sampler's token restrictions -----------------------------------------------------------------
def _ctx(**kw) -> SamplingContext:
    return SamplingContext(SamplingParams(temperature=0.0, **kw), [1, 2], [5, 6])


def test_logit_bias_allowed_ids_and_bad_words() -> None:
    sampler = Sampler()
    logits = torch.zeros(4, 16)
    logits[:, 3] = 5.0  # the unconstrained argmax
    rows = [_ctx(), _ctx(logit_bias={7: 100.0}), _ctx(allowed_token_ids=[9, 10], logit_bias={10: 1.0}),
            _ctx(bad_words_token_ids=[[6, 3], [5, 4]])]  # "6 3" follows the output's last token 6: ban 3
    got = [t for t, _ in sampler.sample(logits, rows)]
    assert got[0] == 3 and got[1] == 7 and got[2] == 10
    assert got[3] != 3
    # Logprobs stay those of the raw logits (as vLLM reports them), whatever was masked.
    lp_rows = [_ctx(logprobs=0, logit_bias={7: 100.0})]
    (token, lp), = sampler.sample(logits[:1], lp_rows)
    assert token == 7 and lp.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[7].item())


def test_bitmask_masks_only_constrained_rows() -> None:
    logits = torch.arange(64, dtype=torch.float32).repeat(2, 1)  # argmax 63 everywhere
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)
    bitmask[1] = 0
    bitmask[1, 0] = 1 << 5  # row 1 may only say token 5
    constrained = SamplingContext(SamplingParams(temperature=0.0), [1], [], constrained=True)
    got = [t for t, _ in Sampler().sample(logits, [_ctx(), constrained], bitmask)]
    assert got == [63, 5]
    sampled = [t for t, _ in Sampler().sample(logits, [_ctx(), SamplingContext(
        SamplingParams(temperature=1.0, seed=3), [1], [], constrained=True)], bitmask)]
    assert sampled[1] == 5


def test_a_failing_mask_fill_ends_the_request_instead_of_the_engine(tokenizer, vocab, compiler) -> None:
    engine, _ = make_engine(tokenizer, vocab)
    _add(engine, compiler, "r", [1, 2, 3], _json_spec())

    class Broken:
        def unsafe_compute_mask_ptr(self, *args):
            raise RuntimeError("boom")

    engine.grammars.executor = Broken()
    engine.add_request("free", [4, 5, 6], _params(5))
    tokens, reasons = run_all(engine)
    # Only EOS was allowed; the grammar cannot end there, so the request is ended (and counted), not
    # given output that breaks its schema; its unconstrained neighbour and the engine go on.
    assert tokens.get("r", []) == [] and reasons["r"] == "abort" and engine.grammar_violations == 1
    assert reasons["free"] == "length" and len(tokens["free"]) == 5
