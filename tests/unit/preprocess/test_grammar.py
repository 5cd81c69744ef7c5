"""Grammar compilation in Preprocess (stages/preprocess/grammar.py) with the real llguidance and the real
SmolLM2 tokenizer: every kind compiles, bad specs fail closed with the field named, the limits
hold, and the cache is keyed by spec and tokenizer and bounded in bytes."""

from __future__ import annotations

import asyncio
import json
import time

import llguidance
import pytest

from stages.config import StructuredOutputSettings
from stages.errors import InvalidRequestError
from stages.model_info import load_cpu_tokenizer, model_info
from stages.preprocess.grammar import ByteLRU, GrammarCompiler
from stages.transport.messages import GrammarSpec, StructuredOutputSpec
from tests.grammar_schemas import LARGE, SMALL

MODEL = "embedded:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tokenizer():
    return load_cpu_tokenizer(MODEL)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    info = model_info(MODEL, tokenizer=tokenizer)
    return GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids)


def _accepts(compiler: GrammarCompiler, grammar: GrammarSpec, text: str) -> bool:
    """Whether the compiled grammar accepts exactly ``text`` (fed as the tokenizer splits it)."""
    tok = compiler.llg_tokenizer
    m = llguidance.LLMatcher(tok, grammar.grammar, log_level=0)
    return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()


def test_every_kind_compiles_and_constrains(compiler: GrammarCompiler) -> None:
    cases = [
        (StructuredOutputSpec("json_schema", json.dumps(SMALL)), '{"city": "Oslo", "unit": "celsius"}',
         '{"city": "Oslo"}'),
        (StructuredOutputSpec("json_object", ""), '{"a": [1, 2]}', '[1, 2]'),
        (StructuredOutputSpec("regex", r"\d{3}-\d{4}"), "555-1234", "5555-123"),
        (StructuredOutputSpec("choice", json.dumps(["red", 'say "hi"\n'])), 'say "hi"\n', "blue"),
        (StructuredOutputSpec("grammar", 'start: "yes" | "no"'), "no", "maybe"),
        (StructuredOutputSpec("grammar", 'root ::= "yes" | "no"'), "yes", "nope"),  # GBNF converted
    ]
    for spec, good, bad in cases:
        compiled = compiler.compile_sync(spec)
        assert compiled.kind == spec.kind and compiled.tokenizer_hash == compiler.tokenizer_hash
        assert _accepts(compiler, compiled, good), (spec.kind, good)
        assert not _accepts(compiler, compiled, bad), (spec.kind, bad)


def test_regex_classes_are_ascii(compiler: GrammarCompiler) -> None:
    compiled = compiler.compile_sync(StructuredOutputSpec("regex", r"\d+"))
    assert _accepts(compiler, compiled, "0123")
    assert not _accepts(compiler, compiled, "\u0663\u0664")  # Arabic-Indic digits are \d in Unicode


@pytest.mark.parametrize("spec, fragment", [
    (StructuredOutputSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "strng"}}})),
     "strng"),
    (StructuredOutputSpec("json_schema", "{not json"), "not valid JSON"),
    (StructuredOutputSpec("json_schema", "[1]"), "JSON object"),
    (StructuredOutputSpec("regex", "a(b", param="guided_regex"), "unclosed group"),
    (StructuredOutputSpec("choice", "[]", param="structured_outputs.choice"), "non-empty"),
    (StructuredOutputSpec("grammar", "start: missing_rule", param="structured_outputs.grammar"), "missing_rule"),
])
def test_bad_specs_fail_closed_naming_the_field(compiler: GrammarCompiler, spec: StructuredOutputSpec,
                                                fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile_sync(spec)
    assert err.value.param == spec.param
    assert fragment in err.value.message


def test_limits_give_400(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    info = model_info(MODEL, tokenizer=tokenizer)
    small = GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids,
                            StructuredOutputSettings(max_spec_bytes=300, compile_timeout_s=0.2, max_grammar_size=50))
    with pytest.raises(InvalidRequestError, match="limit is 300") as err:
        asyncio.run(small.compile(StructuredOutputSpec("json_schema", json.dumps(LARGE))))
    assert err.value.param == "response_format"
    # llguidance's own grammar-size bound: a 5-property object fits in 300 bytes but not in 50 grammar symbols.
    compact = json.dumps(SMALL["properties"]["city"] | {"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(5)}}, separators=(",", ":"))
    assert len(compact) <= 300
    with pytest.raises(InvalidRequestError, match="could not be compiled"):
        small.compile_sync(StructuredOutputSpec("json_schema", compact))
    # A compile that outlives the timeout (the event loop is free meanwhile): 400, and the loop
    # is not blocked (it answers while the compile thread still sleeps).
    real = small.compile_sync
    monkeypatch.setattr(small, "compile_sync", lambda spec: (time.sleep(1.0), real(spec))[1])

    async def run() -> float:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        try:
            with pytest.raises(InvalidRequestError, match="took longer") as err:
                await small.compile(StructuredOutputSpec("regex", "[a-z]{1,8}", param="guided_regex"))
            assert err.value.param == "guided_regex" and err.value.code == "grammar_compile_timeout"
        finally:
            task.cancel()
        return ticks

    assert asyncio.run(run()) >= 5


def test_cache_hits_by_spec_and_is_bounded_in_bytes(compiler: GrammarCompiler) -> None:
    async def run() -> None:
        spec = StructuredOutputSpec("json_schema", json.dumps(LARGE))
        first, hit1, _ = await compiler.compile(spec)
        again, hit2, _ = await compiler.compile(StructuredOutputSpec("json_schema", json.dumps(LARGE)))
        assert (hit1, hit2) == (False, True) and again is first
        _, hit3, _ = await compiler.compile(StructuredOutputSpec("json_schema", json.dumps(SMALL)))
        assert not hit3
        # Same text, another kind: another grammar.
        assert compiler.key(StructuredOutputSpec("regex", "abc")) != compiler.key(StructuredOutputSpec("grammar", "abc"))

    asyncio.run(run())
    lru = ByteLRU(max_bytes=1000)
    entries = [GrammarSpec("regex", "x" * 300, f"k{i}", "t") for i in range(5)]
    for e in entries:
        lru.put(e.key, e)
    assert lru.nbytes <= 1000 and len(lru) == 2
    assert lru.get("k0") is None and lru.get("k4") is entries[4]
    lru.put("huge", GrammarSpec("regex", "x" * 5000, "huge", "t"))  # bigger than the cache: not kept
    assert lru.get("huge") is None and lru.get("k4") is entries[4]


def test_key_depends_on_tokenizer(compiler: GrammarCompiler, tokenizer) -> None:
    info = model_info(MODEL, tokenizer=tokenizer)
    wider = GrammarCompiler(tokenizer, info.vocab_size + 64, info.eos_token_ids)
    spec = StructuredOutputSpec("regex", "a+")
    assert wider.tokenizer_hash != compiler.tokenizer_hash
    assert wider.key(spec) != compiler.key(spec)


def test_preprocess_tokenises_bad_words_and_checks_token_ids() -> None:
    from stages.api.max_tokens import MaxTokens
    from stages.preprocess.preprocessor import Preprocessor
    from stages.transport.messages import PreprocessRequest, SamplingParams

    pre = Preprocessor(MODEL)
    msgs = [{"role": "user", "content": "hi"}]
    out = pre.process(PreprocessRequest("r", SamplingParams(), MaxTokens(8), messages=msgs, bad_words=["hello world"]))
    seqs = out.sampling_params.bad_words_token_ids
    assert pre.encode("hello world", add_special_tokens=False) in seqs
    assert pre.encode(" hello world", add_special_tokens=False) in seqs
    for field, params in (("logit_bias", SamplingParams(logit_bias={pre.model_vocab_size: 1.0})),
                          ("allowed_token_ids", SamplingParams(allowed_token_ids=[1, 10**6]))):
        with pytest.raises(InvalidRequestError) as err:
            pre.process(PreprocessRequest("r", params, MaxTokens(8), messages=msgs))
        assert err.value.param == field
