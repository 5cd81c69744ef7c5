"""Preprocess logic without Ray: chat template, tokenisation, length checks, ``max_tokens``, and the
``/tokenize`` and ``/detokenize`` answers.

Two models: the embedded one (the real chat template, which adds a default system prompt, and no
BOS), checked against transformers' tokenizer as the reference, and a tiny word-level one written
to a temporary directory, whose encoder adds a BOS and whose template writes one itself, so a
doubled or missing BOS shows.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from stages.api.max_tokens import MaxTokens
from stages.errors import ContextLengthExceededError, InvalidRequestError
from stages.model_info import EMBEDDED_MODEL, load_tokenizer
from stages.preprocess.preprocessor import Preprocessor
from stages.transport.messages import EngineRequest, PreprocessRequest, SamplingParams

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

# -- the tiny tokenizer -------------------------------------------------------------------------------
TINY_WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant", "system", ":", "hi", "there"]
TINY = {w: i for i, w in enumerate(TINY_WORDS)}
TINY_MAX_LEN = 16
TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "{{ m['role'] }} : {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete local model directory: word-level tokenizer (BOS added on encode) and a config."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-model")
    backend = Tokenizer(models.WordLevel(TINY, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", TINY["<s>"])])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = TINY_TEMPLATE
    tok.save_pretrained(path)
    LlamaConfig(vocab_size=len(TINY_WORDS), max_position_embeddings=TINY_MAX_LEN, hidden_size=8,
                intermediate_size=16, num_hidden_layers=1, num_attention_heads=1,
                num_key_value_heads=1).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Preprocessor:
    return Preprocessor(str(tiny_dir))


@pytest.fixture(scope="module")
def smol_tokenizer():
    return load_tokenizer(EMBEDDED_MODEL)


@pytest.fixture(scope="module", params=["default", "transformers"])
def smol(request: pytest.FixtureRequest, smol_tokenizer) -> Preprocessor:
    """The embedded model's Preprocessor, with the tokenizer it loads itself and with transformers'
    (the reference every expectation here is computed with)."""
    if request.param == "default":
        return Preprocessor(EMBEDDED_MODEL)
    return Preprocessor(EMBEDDED_MODEL, tokenizer=smol_tokenizer)


def _req(*, messages=None, prompt=None, max_tokens=None, n=1, params=None, max_tokens_rule=None,
         **kw) -> PreprocessRequest:
    return PreprocessRequest(request_id="r1", sampling_params=params or SamplingParams(),
                             max_tokens=max_tokens_rule or MaxTokens(max_tokens), messages=messages, prompt=prompt, n=n, **kw)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# -- construction -------------------------------------------------------------------------------------
def test_context_length_and_vocab_come_from_the_model(tiny: Preprocessor, smol: Preprocessor) -> None:
    assert tiny.max_model_len == TINY_MAX_LEN
    assert tiny.vocab_size == len(TINY_WORDS)
    assert smol.max_model_len == 8192
    assert smol.vocab_size == 49152


def test_explicit_max_model_len_wins(tiny_dir: Path) -> None:
    assert Preprocessor(str(tiny_dir), max_model_len=8).max_model_len == 8
    # 0 / None mean "the model's own" (the deployment passes ``max_model_len or None``).
    assert Preprocessor(str(tiny_dir), max_model_len=0).max_model_len == TINY_MAX_LEN


# -- chat template ------------------------------------------------------------------------------------
def test_render_is_the_models_own_template(smol: Preprocessor) -> None:
    assert smol.render(_user("Hi")) == SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert smol.render(_user("Hi"), add_generation_prompt=False) == SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n"


def test_render_keeps_a_given_system_prompt(smol: Preprocessor) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = smol.render(messages)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "SmolLM" not in text


def test_template_error_is_the_clients(tiny: Preprocessor) -> None:
    with pytest.raises(InvalidRequestError) as info:
        tiny.render([{"role": "tool", "content": "hello"}])
    assert info.value.param == "messages"
    assert info.value.status_code == 400
    assert "tool messages are not supported" in info.value.message


def test_no_chat_template_means_use_completions(tiny_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_dir))
    tok.chat_template = None
    pre = Preprocessor(str(tiny_dir), tokenizer=tok)
    with pytest.raises(InvalidRequestError) as info:
        pre.process(_req(messages=_user("hello")))
    assert info.value.param == "messages"
    assert "/v1/completions" in info.value.message
    # A text prompt still works without a template.
    assert pre.process(_req(prompt="hello")).prompt_token_ids == [TINY["<s>"], TINY["hello"]]


# -- process: chat ------------------------------------------------------------------------------------
def test_chat_request_becomes_an_engine_request(smol: Preprocessor, smol_tokenizer) -> None:
    params = SamplingParams(temperature=0.3, top_p=0.9, stop=["\n\n"], seed=7, logprobs=2)
    req = _req(messages=_user("What is 2+2?"), max_tokens=20, n=3, params=params,
               trace_context={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
    out = smol.process(req)
    assert isinstance(out, EngineRequest)
    rendered = smol.render(req.messages)
    assert out.prompt_text == rendered
    assert out.prompt_token_ids == smol_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert out.request_id == "r1"
    assert out.n == 3
    assert out.trace_context == req.trace_context
    assert out.sampling_params == dataclasses.replace(params, max_tokens=20)
    assert params.max_tokens == SamplingParams().max_tokens  # the request's own params are untouched
    assert set(out.upstream_timings) == {"template", "tokenize"}
    assert all(v >= 0 for v in out.upstream_timings.values())
    assert out.choice_ids() == ["r1-0", "r1-1", "r1-2"]
    pickle.loads(pickle.dumps(out))  # it crosses a deployment boundary


def test_chat_is_encoded_without_a_second_bos(tiny: Preprocessor) -> None:
    out = tiny.process(_req(messages=_user("hello world")))
    # The template wrote <s> once; the encoder's own BOS must not be added on top.
    assert out.prompt_token_ids == [TINY[w] for w in ["<s>", "user", ":", "hello", "world", "assistant", ":"]]
    no_gen = tiny.process(_req(messages=_user("hello world"), add_generation_prompt=False))
    assert no_gen.prompt_token_ids == [TINY[w] for w in ["<s>", "user", ":", "hello", "world"]]


def test_max_tokens_defaults_to_the_room_left(tiny: Preprocessor, smol: Preprocessor) -> None:
    out = tiny.process(_req(messages=_user("hello")))  # 6 tokens
    assert len(out.prompt_token_ids) == 6
    assert out.sampling_params.max_tokens == TINY_MAX_LEN - 6
    big = smol.process(_req(messages=_user("Hi")))
    assert big.sampling_params.max_tokens == 8192 - len(big.prompt_token_ids)


def test_max_tokens_exactly_the_room_is_accepted(tiny: Preprocessor) -> None:
    out = tiny.process(_req(messages=_user("hello"), max_tokens=TINY_MAX_LEN - 6))
    assert out.sampling_params.max_tokens == TINY_MAX_LEN - 6


def test_max_tokens_past_the_room_is_context_length_exceeded(tiny: Preprocessor) -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        tiny.process(_req(messages=_user("hello"), max_tokens=TINY_MAX_LEN - 5))
    err = info.value
    assert (err.prompt_tokens, err.max_tokens, err.max_model_len) == (6, TINY_MAX_LEN - 5, TINY_MAX_LEN)
    assert err.param == "messages"
    assert err.code == "context_length_exceeded"
    assert err.status_code == 400
    assert f"you requested {TINY_MAX_LEN + 1} tokens (6 in the messages" in err.message


def test_prompt_that_fills_the_window_is_rejected_with_param_prompt(tiny: Preprocessor) -> None:
    # 15 words + BOS = 16 tokens = max_model_len: no room for even one token.
    with pytest.raises(ContextLengthExceededError) as info:
        tiny.process(_req(prompt=" ".join(["hello"] * (TINY_MAX_LEN - 1))))
    err = info.value
    assert err.param == "prompt"
    assert (err.prompt_tokens, err.max_tokens) == (TINY_MAX_LEN, None)
    assert f"your prompt resulted in {TINY_MAX_LEN} tokens" in err.message
    # One token shorter leaves exactly one to generate.
    out = tiny.process(_req(prompt=" ".join(["hello"] * (TINY_MAX_LEN - 2))))
    assert out.sampling_params.max_tokens == 1


def test_a_lowered_limit_is_enforced(tiny_dir: Path) -> None:
    # The deployment lowers ``max_model_len`` to the engines' own after the KV-pool cap.
    pre = Preprocessor(str(tiny_dir))
    pre.max_model_len = 8
    assert pre.process(_req(prompt="hello world")).sampling_params.max_tokens == 8 - 3
    with pytest.raises(ContextLengthExceededError) as info:
        pre.process(_req(prompt="hello world", max_tokens=6))
    assert info.value.max_model_len == 8


# -- process: text and token-id prompts ---------------------------------------------------------------
def test_the_operators_limit_caps_an_open_ask(tiny: Preprocessor) -> None:
    """``http.max_tokens_limit`` travels with the request; an open ask stops there, not at the context."""
    out = tiny.process(_req(prompt="hello world", max_tokens_rule=MaxTokens(limit=4)))
    assert out.sampling_params.max_tokens == 4
    with pytest.raises(InvalidRequestError) as info:
        tiny.process(_req(prompt="hello world", max_tokens_rule=MaxTokens(5, "max_completion_tokens", limit=4)))
    assert info.value.param == "max_completion_tokens"


def test_text_prompt_gets_the_tokenizers_special_tokens(tiny: Preprocessor) -> None:
    out = tiny.process(_req(prompt="hello world", max_tokens=4))
    assert out.prompt_token_ids == [TINY["<s>"], TINY["hello"], TINY["world"]]
    assert out.prompt_text == "hello world"
    assert set(out.upstream_timings) == {"tokenize"}
    assert out.sampling_params.max_tokens == 4


def test_token_id_prompt_passes_through(tiny: Preprocessor) -> None:
    ids = [TINY["hello"], 0, len(TINY_WORDS) - 1]
    out = tiny.process(_req(prompt=ids))
    assert out.prompt_token_ids == ids
    assert out.prompt_token_ids is not ids  # a copy: the caller's list is not shared
    assert out.prompt_text is None
    assert out.sampling_params.max_tokens == TINY_MAX_LEN - 3


@pytest.mark.parametrize("bad", [len(TINY_WORDS), -1, 10**9])
def test_token_id_outside_the_vocabulary(tiny: Preprocessor, bad: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        tiny.process(_req(prompt=[TINY["hello"], bad]))
    assert info.value.param == "prompt"
    assert f"token id {bad} is outside the vocabulary (0..{len(TINY_WORDS) - 1})" in info.value.message
    assert not isinstance(info.value, ContextLengthExceededError)


def test_too_many_token_ids_is_context_length_exceeded(tiny: Preprocessor) -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        tiny.process(_req(prompt=[TINY["hi"]] * 10, max_tokens=7))
    assert info.value.param == "prompt"
    assert (info.value.prompt_tokens, info.value.max_tokens) == (10, 7)


@pytest.mark.parametrize("prompt", ["", [], None], ids=["empty-text", "empty-ids", "none"])
def test_empty_prompt_is_rejected(smol: Preprocessor, prompt) -> None:
    with pytest.raises(InvalidRequestError) as info:
        smol.process(_req(prompt=prompt))
    assert info.value.param == "prompt"
    assert "empty" in info.value.message
    assert not isinstance(info.value, ContextLengthExceededError)


def test_empty_chat_message_is_not_an_empty_prompt(smol: Preprocessor) -> None:
    # The template's role markers are tokens too.
    out = smol.process(_req(messages=_user("")))
    assert len(out.prompt_token_ids) > 5


# -- /tokenize and /detokenize ------------------------------------------------------------------------
def test_tokenize_chat_shows_exactly_what_the_model_sees(smol: Preprocessor, smol_tokenizer) -> None:
    out = smol.tokenize(prompt=None, messages=_user("Hi"), add_generation_prompt=True, add_special_tokens=False)
    assert set(out) == {"prompt", "tokens", "count", "max_model_len", "token_strs"}
    assert out["prompt"] == SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert out["tokens"] == smol.process(_req(messages=_user("Hi"))).prompt_token_ids
    assert out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 8192
    assert out["token_strs"] == smol_tokenizer.convert_ids_to_tokens(out["tokens"])
    assert out["token_strs"][0] == "<|im_start|>"
    assert smol_tokenizer.convert_tokens_to_string(out["token_strs"]) == out["prompt"]


def test_tokenize_prompt_honours_add_special_tokens(tiny: Preprocessor) -> None:
    with_bos = tiny.tokenize(prompt="hello world", messages=None, add_generation_prompt=True,
                             add_special_tokens=True)
    assert with_bos["tokens"] == [TINY["<s>"], TINY["hello"], TINY["world"]]
    assert with_bos["token_strs"] == ["<s>", "hello", "world"]
    assert with_bos["count"] == 3
    assert with_bos["prompt"] == "hello world"
    assert with_bos["max_model_len"] == TINY_MAX_LEN
    plain = tiny.tokenize(prompt="hello world", messages=None, add_generation_prompt=True,
                          add_special_tokens=False)
    assert plain["tokens"] == [TINY["hello"], TINY["world"]]


def test_tokenize_messages_without_generation_prompt(tiny: Preprocessor) -> None:
    out = tiny.tokenize(prompt=None, messages=_user("hi"), add_generation_prompt=False, add_special_tokens=False)
    assert out["prompt"] == "<s>user : hi "
    assert out["token_strs"] == ["<s>", "user", ":", "hi"]


def test_tokenize_nothing_is_empty(tiny: Preprocessor) -> None:
    out = tiny.tokenize(prompt=None, messages=None, add_generation_prompt=True, add_special_tokens=False)
    assert (out["prompt"], out["tokens"], out["count"], out["token_strs"]) == ("", [], 0, [])


def test_tokenize_reports_the_current_limit(tiny_dir: Path) -> None:
    pre = Preprocessor(str(tiny_dir))
    pre.max_model_len = 9
    assert pre.tokenize(prompt="hi", messages=None, add_generation_prompt=True,
                        add_special_tokens=True)["max_model_len"] == 9


def test_detokenize_round_trips_and_keeps_special_tokens(smol: Preprocessor, smol_tokenizer) -> None:
    text = "Hello, world! Crème brûlée 😀"
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert smol.detokenize(ids) == {"prompt": text}
    chat = smol.process(_req(messages=_user("Hi")))
    assert smol.detokenize(chat.prompt_token_ids) == {"prompt": chat.prompt_text}
    assert smol.detokenize([]) == {"prompt": ""}


@pytest.mark.parametrize("bad", [49152, -3])
def test_detokenize_rejects_ids_outside_the_vocabulary(smol: Preprocessor, bad: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        smol.detokenize([1, bad])
    assert info.value.param == "tokens"
    assert f"token id {bad}" in info.value.message


def test_a_prompt_that_cannot_fit_is_refused_without_encoding_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its byte length over the longest token's already exceeds the context: a 400 saying "at
    least", and the prompt is never encoded (a 1 MB one would take a second and 100 MB)."""
    pre = Preprocessor(EMBEDDED_MODEL)
    floor_len = pre.tokenizer._floor.max_bytes * pre.max_model_len
    encoded: list[int] = []
    real = pre.encode
    monkeypatch.setattr(pre, "encode", lambda text, add_special_tokens: encoded.append(len(text)) or real(
        text, add_special_tokens))
    for field in ("messages", "prompt"):
        text = "x" * (floor_len + 1)
        req = _req(messages=_user(text)) if field == "messages" else _req(prompt=text)
        with pytest.raises(ContextLengthExceededError) as info:
            pre.process(req)
        assert info.value.param == field and info.value.code == "context_length_exceeded"
        assert f"your {field} would be at least" in info.value.message
        assert info.value.prompt_tokens > pre.max_model_len
    assert encoded == []
    # Under the floor the prompt is encoded and counted exactly, as before.
    with pytest.raises(ContextLengthExceededError) as info:
        pre.process(_req(prompt="7" * (2 * pre.max_model_len)))  # one token per digit
    assert "resulted in" in info.value.message and encoded
