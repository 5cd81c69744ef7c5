"""Request parsing, validation errors (status + param), and conversion to SamplingParams."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stages.api.max_tokens import UNRESOLVED, MaxTokens
from stages.api.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    messages_to_dicts,
    parse_request,
    to_sampling_params,
)
from stages.errors import InvalidRequestError
from stages.transport.messages import SamplingParams

MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": MSGS, **fields}).encode()


def comp(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": "hello", **fields}).encode()


BAD: list[tuple[str, type, bytes, str | None]] = [
    ("malformed json", ChatCompletionRequest, b'{"model": "m",', None),
    ("empty body", ChatCompletionRequest, b"", None),
    ("not utf-8", ChatCompletionRequest, b'{"model": "\xff"}', None),
    ("NaN literal", ChatCompletionRequest, b'{"model": "m", "messages": [], "temperature": NaN}', None),
    ("json array", ChatCompletionRequest, b"[1, 2]", None),
    ("json string", ChatCompletionRequest, b'"hello"', None),
    ("missing model", ChatCompletionRequest, json.dumps({"messages": MSGS}).encode(), "model"),
    ("null model", ChatCompletionRequest, chat(model=None), "model"),
    ("model not a string", ChatCompletionRequest, chat(model=5), "model"),
    ("missing messages", ChatCompletionRequest, b'{"model": "m"}', "messages"),
    ("empty messages", ChatCompletionRequest, chat(messages=[]), "messages"),
    ("messages not a list", ChatCompletionRequest, chat(messages="hi"), "messages"),
    ("bad role", ChatCompletionRequest, chat(messages=[{"role": "bot", "content": "x"}]), "messages.0.role"),
    ("user without content", ChatCompletionRequest, chat(messages=[{"role": "user"}]), "messages.0"),
    (
        "image part",
        ChatCompletionRequest,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages.0.content",
    ),
    (
        "text part without text",
        ChatCompletionRequest,
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages.0.content",
    ),
    (
        "content a number",
        ChatCompletionRequest,
        chat(messages=[{"role": "user", "content": 3}]),
        "messages.0.content",
    ),
    ("temperature 3", ChatCompletionRequest, chat(temperature=3), "temperature"),
    ("temperature negative", ChatCompletionRequest, chat(temperature=-0.1), "temperature"),
    ("temperature hot", ChatCompletionRequest, chat(temperature="hot"), "temperature"),
    ("temperature numeric string", ChatCompletionRequest, chat(temperature="0.5"), "temperature"),
    ("top_p 0", ChatCompletionRequest, chat(top_p=0), "top_p"),
    ("top_p 1.5", ChatCompletionRequest, chat(top_p=1.5), "top_p"),
    ("top_k -2", ChatCompletionRequest, chat(top_k=-2), "top_k"),
    ("top_k float", ChatCompletionRequest, chat(top_k=2.5), "top_k"),
    ("min_p 1.5", ChatCompletionRequest, chat(min_p=1.5), "min_p"),
    ("n 0", ChatCompletionRequest, chat(n=0), "n"),
    ("n 9", ChatCompletionRequest, chat(n=9), "n"),
    ("n bool", ChatCompletionRequest, chat(n=True), "n"),
    ("max_tokens 0", ChatCompletionRequest, chat(max_tokens=0), "max_tokens"),
    ("max_tokens negative", ChatCompletionRequest, chat(max_tokens=-5), "max_tokens"),
    ("max_tokens string", ChatCompletionRequest, chat(max_tokens="10"), "max_tokens"),
    (
        "max_completion_tokens 0",
        ChatCompletionRequest,
        chat(max_completion_tokens=0),
        "max_completion_tokens",
    ),
    ("presence_penalty 3", ChatCompletionRequest, chat(presence_penalty=3), "presence_penalty"),
    ("frequency_penalty -3", ChatCompletionRequest, chat(frequency_penalty=-3), "frequency_penalty"),
    ("repetition_penalty 0", ChatCompletionRequest, chat(repetition_penalty=0), "repetition_penalty"),
    ("repetition_penalty 2.5", ChatCompletionRequest, chat(repetition_penalty=2.5), "repetition_penalty"),
    ("seed string", ChatCompletionRequest, chat(seed="42"), "seed"),
    ("seed too large", ChatCompletionRequest, chat(seed=2**64), "seed"),
    ("stop 50 entries", ChatCompletionRequest, chat(stop=[f"s{i}" for i in range(50)]), "stop"),
    ("stop empty string", ChatCompletionRequest, chat(stop=""), "stop.0"),
    ("stop entry not a string", ChatCompletionRequest, chat(stop=["a", 1]), "stop.1"),
    ("stop_token_ids negative", ChatCompletionRequest, chat(stop_token_ids=[-1]), "stop_token_ids.0"),
    ("stream string", ChatCompletionRequest, chat(stream="yes"), "stream"),
    (
        "stream_options wrong type",
        ChatCompletionRequest,
        chat(stream=True, stream_options={"include_usage": "y"}),
        "stream_options.include_usage",
    ),
    ("chat logprobs int", ChatCompletionRequest, chat(logprobs=5), "logprobs"),
    ("top_logprobs 30", ChatCompletionRequest, chat(logprobs=True, top_logprobs=30), "top_logprobs"),
    ("top_logprobs without logprobs", ChatCompletionRequest, chat(top_logprobs=3), "top_logprobs"),
    (
        "top_logprobs with logprobs false",
        ChatCompletionRequest,
        chat(logprobs=False, top_logprobs=3),
        "top_logprobs",
    ),
    ("missing prompt", CompletionRequest, b'{"model": "m"}', "prompt"),
    ("empty prompt", CompletionRequest, comp(prompt=""), "prompt"),
    ("empty token prompt", CompletionRequest, comp(prompt=[]), "prompt"),
    ("batched string prompts", CompletionRequest, comp(prompt=["a", "b"]), "prompt"),
    ("batched token prompts", CompletionRequest, comp(prompt=[[1], [2]]), "prompt"),
    ("negative token id", CompletionRequest, comp(prompt=[1, -2]), "prompt"),
    ("bool token id", CompletionRequest, comp(prompt=[1, True]), "prompt"),
    ("mixed prompt", CompletionRequest, comp(prompt=[1, "a"]), "prompt"),
    ("prompt a dict", CompletionRequest, comp(prompt={"text": "x"}), "prompt"),
    ("completion logprobs 21", CompletionRequest, comp(logprobs=21), "logprobs"),
    ("completion logprobs bool", CompletionRequest, comp(logprobs=True), "logprobs"),
    ("echo with logprobs", CompletionRequest, comp(echo=True, logprobs=1), "echo"),
    ("tokenize neither", TokenizeRequest, b"{}", "prompt"),
    ("tokenize both", TokenizeRequest, json.dumps({"prompt": "x", "messages": MSGS}).encode(), "messages"),
    ("detokenize missing tokens", DetokenizeRequest, b"{}", "tokens"),
    ("detokenize strings", DetokenizeRequest, b'{"tokens": ["a"]}', "tokens.0"),
]


@pytest.mark.parametrize(("model_cls", "body", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_bodies(model_cls: type, body: bytes, param: str | None) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(model_cls, body)
    err = info.value
    assert err.status_code == 400
    assert err.param == param
    assert err.to_dict()["error"]["type"] == "invalid_request_error"
    assert err.message and "Value error" not in err.message


@pytest.mark.parametrize("where", ["prompt", "stop", "key"])
def test_a_lone_surrogate_is_a_400_and_an_escaped_pair_is_text(where: str) -> None:
    """JSON lets a string hold ``\\ud800`` alone; no tokenizer can take it (it was a 500 from
    Preprocess), so it is refused where the body is parsed. A pair written as escapes is text."""
    bodies = {"prompt": rb'{"model": "m", "prompt": "a\ud800b"}',
              "stop": rb'{"model": "m", "prompt": "a", "stop": ["x", "\uDFFF"]}',
              "key": rb'{"model": "m", "prompt": "a", "metadata": {"\udbff": "v"}}'}
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        parse_request(CompletionRequest, bodies[where])
    assert parse_request(CompletionRequest, rb'{"model": "m", "prompt": "\ud83d\ude00 \\ud800"}').prompt == (
        "\U0001f600 \\ud800")


def test_malformed_json_message() -> None:
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        parse_request(ChatCompletionRequest, b"{nope")
    with pytest.raises(InvalidRequestError, match="JSON object"):
        parse_request(ChatCompletionRequest, b"[]")


def test_validation_message_is_readable() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(ChatCompletionRequest, chat(temperature=3))
    assert info.value.message == "temperature: Input should be less than or equal to 2"
    with pytest.raises(InvalidRequestError) as info:
        parse_request(
            ChatCompletionRequest, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
        )
    assert "only text content parts are supported" in info.value.message
    assert "image_url" in info.value.message


def test_batch_prompt_message_is_clear() -> None:
    with pytest.raises(InvalidRequestError, match="batched prompts"):
        parse_request(CompletionRequest, comp(prompt=["a", "b", "c"]))


# --- good bodies ------------------------------------------------------------------------------


def test_minimal_chat_defaults() -> None:
    req = parse_request(ChatCompletionRequest, chat())
    assert req.model == "m"
    assert req.n == 1 and req.stream is False and req.include_usage is False
    assert req.max_tokens is None and req.requested_max_tokens is None
    assert messages_to_dicts(req) == [{"role": "user", "content": "hi"}]


def test_nulls_mean_defaults() -> None:
    # What the openai client sends when the caller passes None for optional parameters.
    nulls = dict.fromkeys(
        [
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "n",
            "seed",
            "stop",
            "stream",
            "stream_options",
            "logprobs",
            "top_logprobs",
            "user",
            "presence_penalty",
            "frequency_penalty",
            "top_k",
            "min_p",
            "repetition_penalty",
            "stop_token_ids",
        ]
    )
    req = parse_request(ChatCompletionRequest, chat(**nulls))
    assert req.n == 1 and req.temperature == 1.0 and req.stop == [] and req.logprobs is False
    assert to_sampling_params(req) == SamplingParams(max_tokens=UNRESOLVED)
    assert req.max_tokens_rule(0) == MaxTokens(None, "max_tokens", 0)


def test_unknown_fields_ignored() -> None:
    req = parse_request(
        ChatCompletionRequest,
        chat(
            frobnicate=True,
            tools=[],
            response_format={"type": "text"},
            messages=[{"role": "user", "content": "x", "extra": 1}],
        ),
    )
    assert not hasattr(req, "frobnicate")
    assert req.messages[0].content == "x"


def test_text_parts_joined_and_roles() -> None:
    body = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool", "content": "42", "tool_call_id": "t1"},
        ]
    )
    req = parse_request(ChatCompletionRequest, body)
    assert messages_to_dicts(req) == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": ""},
        # A tool result keeps the id of the call it answers (tool-aware templates render it).
        {"role": "tool", "content": "42", "tool_call_id": "t1"},
    ]


def test_stream_options() -> None:
    req = parse_request(ChatCompletionRequest, chat(stream=True, stream_options={"include_usage": True}))
    assert req.include_usage is True
    # Lenient: stream_options without stream is accepted and has no effect.
    req = parse_request(ChatCompletionRequest, chat(stream=False, stream_options={"include_usage": True}))
    assert req.include_usage is False


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hello", "hello"), (["hello"], "hello"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5]), ([0], [0])],
)
def test_prompt_shapes(prompt: Any, expected: Any) -> None:
    assert parse_request(CompletionRequest, comp(prompt=prompt)).prompt == expected


def test_stop_string_becomes_list_and_limits() -> None:
    assert parse_request(ChatCompletionRequest, chat(stop="\n")).stop == ["\n"]
    assert len(parse_request(ChatCompletionRequest, chat(stop=[str(i) for i in range(16)])).stop) == 16


def test_n_8_allowed_and_echo_alone_allowed() -> None:
    assert parse_request(ChatCompletionRequest, chat(n=8)).n == 8
    assert parse_request(CompletionRequest, comp(echo=True)).echo is True


def test_tokenize_and_detokenize() -> None:
    t = parse_request(TokenizeRequest, b'{"prompt": "hi"}')
    assert t.add_special_tokens is True and t.add_generation_prompt is True and t.model is None
    t = parse_request(
        TokenizeRequest, json.dumps({"messages": MSGS, "add_generation_prompt": False}).encode()
    )
    assert t.add_special_tokens is False and t.add_generation_prompt is False
    assert messages_to_dicts(t) == [{"role": "user", "content": "hi"}]
    t = parse_request(TokenizeRequest, json.dumps({"messages": MSGS, "add_special_tokens": True}).encode())
    assert t.add_special_tokens is True
    with pytest.raises(InvalidRequestError):
        messages_to_dicts(parse_request(TokenizeRequest, b'{"prompt": "hi"}'))
    assert parse_request(DetokenizeRequest, b'{"tokens": [1, 2], "model": "m"}').tokens == [1, 2]


# --- to_sampling_params and max_tokens_rule -----------------------------------------------------


def _resolved(req: ChatCompletionRequest | CompletionRequest, room: int = 99) -> int:
    return req.max_tokens_rule(0).resolve(1, room + 1, prompt_param="messages")


def test_max_completion_tokens_wins() -> None:
    req = parse_request(ChatCompletionRequest, chat(max_tokens=10, max_completion_tokens=20))
    assert _resolved(req) == 20 and req.max_tokens_rule(0).field == "max_completion_tokens"
    req = parse_request(ChatCompletionRequest, chat(max_tokens=10))
    assert _resolved(req) == 10 and req.max_tokens_rule(0).field == "max_tokens"
    req = parse_request(ChatCompletionRequest, chat())
    assert _resolved(req) == 99
    # Only Preprocess resolves it: the parsed request's params carry the placeholder the engine refuses.
    assert to_sampling_params(req).max_tokens == UNRESOLVED


def test_full_mapping() -> None:
    req = parse_request(
        CompletionRequest,
        comp(
            temperature=0,
            top_p=0.9,
            top_k=-1,
            min_p=0.05,
            seed=7,
            stop=["x"],
            stop_token_ids=[2],
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            ignore_eos=True,
            skip_special_tokens=False,
            include_stop_str_in_output=True,
            max_tokens=5,
        ),
    )
    sp = to_sampling_params(req)
    assert req.max_tokens_rule(0).requested == 5
    assert sp == SamplingParams(
        max_tokens=UNRESOLVED,
        temperature=0.0,
        top_p=0.9,
        top_k=0,
        min_p=0.05,
        seed=7,
        stop=["x"],
        stop_token_ids=[2],
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        ignore_eos=True,
        logprobs=None,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    assert sp.greedy and sp.has_penalties
    assert (
        to_sampling_params(parse_request(CompletionRequest, comp(top_k=40))).top_k == 40
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 5}, 5),
        ({"logprobs": True, "top_logprobs": 20}, 20),
        ({"logprobs": False, "top_logprobs": 0}, None),
    ],
)
def test_chat_logprobs_mapping(fields: dict[str, Any], expected: int | None) -> None:
    req = parse_request(ChatCompletionRequest, chat(**fields))
    assert to_sampling_params(req).logprobs == expected


@pytest.mark.parametrize(("logprobs", "expected"), [(None, None), (0, 0), (5, 5), (20, 20)])
def test_completion_logprobs_mapping(logprobs: int | None, expected: int | None) -> None:
    req = parse_request(CompletionRequest, comp(logprobs=logprobs))
    assert to_sampling_params(req).logprobs == expected


# --- the official client's bodies ---------------------------------------------------------------


def _capture_openai_bodies() -> list[bytes]:
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    bodies: list[bytes] = []

    def handler(request: Any) -> Any:
        bodies.append(request.content)
        return httpx.Response(503, json={"error": {"message": "x", "type": "t", "param": None, "code": None}})

    client = openai.OpenAI(
        api_key="k",
        base_url="http://test/v1",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    calls = [
        lambda: client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            temperature=None,
            top_p=None,
            max_tokens=None,
            stop=None,
            n=None,
            seed=None,
            logprobs=None,
            user=None,
            stream=True,
            stream_options={"include_usage": True},
        ),
        lambda: client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            max_completion_tokens=3,
            logprobs=True,
            top_logprobs=2,
        ),
        lambda: client.completions.create(
            model="m", prompt="hi", max_tokens=None, logprobs=None, echo=None, stop=None
        ),
        lambda: client.completions.create(model="m", prompt=[1, 2, 3], logprobs=2),
    ]
    for call in calls:
        with pytest.raises(openai.APIStatusError):
            call()
    return bodies


def test_official_client_bodies_parse() -> None:
    chat1, chat2, comp1, comp2 = _capture_openai_bodies()
    r = parse_request(ChatCompletionRequest, chat1)
    assert r.stream and r.include_usage and r.temperature == 1.0
    r = parse_request(ChatCompletionRequest, chat2)
    sp = to_sampling_params(r)
    assert (r.max_tokens_rule(0).requested, sp.logprobs) == (3, 2)
    assert parse_request(CompletionRequest, comp1).prompt == "hi"
    r = parse_request(CompletionRequest, comp2)
    assert r.prompt == [1, 2, 3] and to_sampling_params(r).logprobs == 2
