"""OpenAI response shapes (the chat and completion renderers) and SSE framing, checked against exact
expected output and against the official ``openai`` client's own models and SSE decoder."""

from __future__ import annotations

import json
import pickle

import pytest
from openai._streaming import SSEDecoder
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from stages.api.kinds import ApiKind
from stages.api.render import (
    CHAT,
    COMPLETION,
    SSE_KEEPALIVE,
    TIMING_FIELD,
    LogprobFormatter,
    renderer,
    server_timing_header,
    sse_event,
    usage,
)
from stages.transport.messages import TokenLogprob

RID, CREATED, MODEL = "chatcmpl-abc", 1_700_000_000, "tiny"


def decode(raw: str) -> list:
    """What the official client's SSE decoder makes of a stream."""
    return list(SSEDecoder().iter_bytes(iter([raw.encode()])))


# -- SSE ----------------------------------------------------------------------------------------------
def test_sse_event_with_id_is_compact_and_keeps_non_ascii() -> None:
    assert sse_event({"a": 1, "b": "é😀"}, event_id=7) == 'id: 7\ndata: {"a":1,"b":"é😀"}\n\n'


def test_sse_event_without_id_and_raw_string() -> None:
    assert sse_event({"a": [1, 2]}) == 'data: {"a":[1,2]}\n\n'
    assert sse_event("[DONE]") == "data: [DONE]\n\n"
    assert sse_event("[DONE]", event_id=0) == "id: 0\ndata: [DONE]\n\n"  # id 0 is an id


def test_newlines_in_text_stay_inside_one_data_line() -> None:
    frame = sse_event({"text": "line one\nline two\r\n\n"}, event_id=1)
    assert frame.count("\n") == 3  # id line, data line, blank line
    (event,) = decode(frame)
    assert event.json() == {"text": "line one\nline two\r\n\n"}
    assert event.id == "1"


def test_keepalive_between_events_is_invisible_to_the_client() -> None:
    assert SSE_KEEPALIVE.startswith(":")
    raw = sse_event({"n": 1}, event_id=1) + SSE_KEEPALIVE + SSE_KEEPALIVE + sse_event({"n": 2}, event_id=2) \
        + SSE_KEEPALIVE + sse_event("[DONE]")
    events = decode(raw)
    assert [e.data for e in events] == ['{"n":1}', '{"n":2}', "[DONE]"]
    assert [e.id for e in events[:2]] == ["1", "2"]


# -- the two renderers -------------------------------------------------------------------------------
def test_each_kind_has_its_renderer_and_names() -> None:
    assert renderer(ApiKind.CHAT) is CHAT and renderer("chat") is CHAT  # the name, as it crossed a boundary
    assert renderer(ApiKind.COMPLETION) is COMPLETION and renderer("completion") is COMPLETION
    assert (CHAT.response_id("abc"), COMPLETION.response_id("abc")) == ("chatcmpl-abc", "cmpl-abc")
    assert (CHAT.path, COMPLETION.path) == ("/v1/chat/completions", "/v1/completions")
    assert (CHAT.operation, COMPLETION.operation) == ("chat", "text_completion")
    assert (CHAT.object_name, CHAT.chunk_object_name) == ("chat.completion", "chat.completion.chunk")
    assert (COMPLETION.object_name, COMPLETION.chunk_object_name) == ("text_completion", "text_completion")
    with pytest.raises(KeyError):
        renderer("embedding")


def test_a_kind_is_its_name_in_json_and_pickles() -> None:
    assert json.dumps({"kind": ApiKind.CHAT}) == '{"kind": "chat"}' and f"{ApiKind.COMPLETION}" == "completion"
    assert pickle.loads(pickle.dumps(ApiKind.CHAT)) is ApiKind.CHAT


def test_a_chat_delta_with_only_tool_calls_has_null_content() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chunk = CHAT.stream_chunk(RID, CREATED, MODEL, 0, "", first=True, tool_calls=[call])
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": None, "tool_calls": [call]}
    ChatCompletionChunk.model_validate(chunk)
    whole = CHAT.full_response(RID, CREATED, MODEL, [{"index": 0, "text": None, "finish_reason": "tool_calls",
                                                      "tool_calls": [call]}], usage(1, 1))
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": [call]}


# -- streamed chunks ----------------------------------------------------------------------------------
def test_first_chat_delta_carries_the_role() -> None:
    first = CHAT.stream_chunk(RID, CREATED, MODEL, 0, "Hel", first=True)
    assert first == {"id": RID, "object": "chat.completion.chunk", "created": CREATED, "model": MODEL,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"},
                                  "logprobs": None, "finish_reason": None}]}
    later = CHAT.stream_chunk(RID, CREATED, MODEL, 1, "lo", finish_reason="stop", logprobs={"content": []})
    assert later["choices"] == [{"index": 1, "delta": {"content": "lo"}, "logprobs": {"content": []},
                                 "finish_reason": "stop"}]
    for chunk in (first, later):
        ChatCompletionChunk.model_validate(chunk)
    assert ChatCompletionChunk.model_validate(first).choices[0].delta.role == "assistant"
    assert ChatCompletionChunk.model_validate(later).choices[0].delta.role is None


def test_completion_chunk_has_text_not_delta() -> None:
    chunk = COMPLETION.stream_chunk("cmpl-1", CREATED, MODEL, 2, " world", first=True, finish_reason="length")
    assert chunk == {"id": "cmpl-1", "object": "text_completion", "created": CREATED, "model": MODEL,
                     "choices": [{"index": 2, "text": " world", "logprobs": None, "finish_reason": "length"}]}
    Completion.model_validate(chunk)


def test_final_stream_chunk_with_usage_and_timings() -> None:
    body = CHAT.final_stream_chunk(RID, CREATED, MODEL, usage(5, 3), {"prep": 1.5, "total": 20.0})
    assert body == {"id": RID, "object": "chat.completion.chunk", "created": CREATED, "model": MODEL,
                    "choices": [], "usage": usage(5, 3), TIMING_FIELD: {"prep": 1.5, "total": 20.0}}
    parsed = ChatCompletionChunk.model_validate(body)
    assert parsed.usage is not None and parsed.usage.total_tokens == 8


def test_final_stream_chunk_without_usage_or_timings() -> None:
    body = COMPLETION.final_stream_chunk("cmpl-1", CREATED, MODEL, None, None)
    assert body == {"id": "cmpl-1", "object": "text_completion", "created": CREATED, "model": MODEL,
                    "choices": [], "usage": None}
    assert TIMING_FIELD not in body


# -- whole responses ----------------------------------------------------------------------------------
CHOICES = [
    {"index": 2, "text": "c", "finish_reason": "length"},
    {"index": 0, "text": "a", "finish_reason": "stop", "logprobs": {"content": []}},
    {"index": 1, "text": "b", "finish_reason": "abort"},
]


def test_full_chat_response_orders_choices_by_index() -> None:
    body = CHAT.full_response(RID, CREATED, MODEL, CHOICES, usage(4, 3, cached_tokens=2))
    assert (body["id"], body["object"], body["created"], body["model"]) == (RID, "chat.completion", CREATED, MODEL)
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "a"}, "logprobs": {"content": []},
         "finish_reason": "stop"},
        {"index": 1, "message": {"role": "assistant", "content": "b"}, "logprobs": None, "finish_reason": "abort"},
        {"index": 2, "message": {"role": "assistant", "content": "c"}, "logprobs": None, "finish_reason": "length"},
    ]
    assert body["usage"] == usage(4, 3, cached_tokens=2)
    assert [c["index"] for c in CHOICES] == [2, 0, 1]  # the caller's list is left as it was


def test_full_completion_response() -> None:
    body = COMPLETION.full_response("cmpl-1", CREATED, MODEL, CHOICES[:2], usage(4, 2))
    assert body["object"] == "text_completion"
    assert body["choices"] == [
        {"index": 0, "text": "a", "logprobs": {"content": []}, "finish_reason": "stop"},
        {"index": 2, "text": "c", "logprobs": None, "finish_reason": "length"},
    ]
    body["choices"][0]["logprobs"] = None  # the legacy client model has its own logprobs shape
    parsed = Completion.model_validate(body)
    assert [c.text for c in parsed.choices] == ["a", "c"]


def test_full_chat_response_parses_in_the_official_client() -> None:
    choices = [c for c in CHOICES if c["finish_reason"] != "abort"]
    parsed = ChatCompletion.model_validate(CHAT.full_response(RID, CREATED, MODEL, choices, usage(4, 3)))
    assert [c.message.content for c in parsed.choices] == ["a", "c"]
    assert parsed.usage.prompt_tokens_details.cached_tokens == 0


def test_usage_totals_and_cached_tokens() -> None:
    assert usage(10, 5) == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert usage(10, 0, cached_tokens=8)["prompt_tokens_details"] == {"cached_tokens": 8}
    assert usage(10, 0, cached_tokens=8)["total_tokens"] == 10


# -- Server-Timing ------------------------------------------------------------------------------------
def test_server_timing_header_format_and_order() -> None:
    header = server_timing_header({"prep": 1.234, "queue": 0.0, "prefill": 12.0, "total": 180.456})
    assert header == "prep;dur=1.23, queue;dur=0.00, prefill;dur=12.00, total;dur=180.46"
    assert server_timing_header({}) == ""
    # Every entry is a metric name with one dur parameter (RFC: server-timing-metric;dur=...).
    for entry in header.split(", "):
        name, param = entry.split(";")
        assert name.isidentifier() and param.startswith("dur=") and float(param[4:]) >= 0


# -- logprobs -----------------------------------------------------------------------------------------
class FakeTokenizer:
    """Token id → text, counting decode calls."""

    def __init__(self, vocab: dict[int, str]) -> None:
        self.vocab, self.calls = vocab, 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        return "".join(self.vocab[i] for i in ids)


VOCAB = {1: "Hello", 2: ",", 3: " wörld", 4: "!", 5: " world", 6: "é"}
LPS = [TokenLogprob(1, -0.1, [(1, -0.1), (5, -2.5)]), TokenLogprob(3, -0.7, [(3, -0.7), (6, -1.0)]),
       TokenLogprob(4, -0.01, [])]


def test_chat_logprobs_shape_with_bytes() -> None:
    out = CHAT.logprobs(LogprobFormatter(FakeTokenizer(VOCAB)), LPS[:2], 0)
    assert out == {"content": [
        {"token": "Hello", "logprob": -0.1, "bytes": list(b"Hello"),
         "top_logprobs": [{"token": "Hello", "logprob": -0.1, "bytes": list(b"Hello")},
                          {"token": " world", "logprob": -2.5, "bytes": list(b" world")}]},
        {"token": " wörld", "logprob": -0.7, "bytes": [32, 119, 195, 182, 114, 108, 100],
         "top_logprobs": [{"token": " wörld", "logprob": -0.7, "bytes": list(" wörld".encode())},
                          {"token": "é", "logprob": -1.0, "bytes": [195, 169]}]},
    ]}
    chunk = CHAT.stream_chunk(RID, CREATED, MODEL, 0, "Hello wörld", first=True, logprobs=out)
    parsed = ChatCompletionChunk.model_validate(chunk).choices[0].logprobs
    assert [t.token for t in parsed.content] == ["Hello", " wörld"]
    assert parsed.content[1].top_logprobs[1].bytes == [195, 169]


def test_chat_logprobs_without_alternatives_and_empty() -> None:
    fmt = LogprobFormatter(FakeTokenizer(VOCAB))
    assert CHAT.logprobs(fmt, [LPS[2]], 0) == {"content": [{"token": "!", "logprob": -0.01, "bytes": [33],
                                                           "top_logprobs": []}]}
    assert CHAT.logprobs(fmt, [], 0) == {"content": []}


def test_completion_logprobs_with_text_offsets() -> None:
    out = COMPLETION.logprobs(LogprobFormatter(FakeTokenizer(VOCAB)), LPS[:2], 10)
    assert out == {
        "tokens": ["Hello", " wörld"],
        "token_logprobs": [-0.1, -0.7],
        "top_logprobs": [{"Hello": -0.1, " world": -2.5}, {" wörld": -0.7, "é": -1.0}],
        # Offsets count characters of the text so far: 10, then 10 + len("Hello").
        "text_offset": [10, 15],
    }
    parsed = Completion.model_validate(COMPLETION.full_response("cmpl-1", CREATED, MODEL,
                                                     [{"index": 0, "text": "Hello wörld", "finish_reason": "stop",
                                                       "logprobs": out}], usage(1, 2)))
    assert parsed.choices[0].logprobs.text_offset == [10, 15]


def test_completion_offsets_count_characters_not_bytes() -> None:
    out = COMPLETION.logprobs(LogprobFormatter(FakeTokenizer(VOCAB)), LPS, 0)
    assert out["tokens"] == ["Hello", " wörld", "!"]
    assert out["token_logprobs"] == [-0.1, -0.7, -0.01]
    assert out["text_offset"] == [0, 5, 11]  # " wörld" is 6 characters (7 bytes)


def test_completion_offsets_continue_across_calls() -> None:
    fmt = LogprobFormatter(FakeTokenizer(VOCAB))
    first = COMPLETION.logprobs(fmt, LPS[:1], 0)
    second = COMPLETION.logprobs(fmt, LPS[1:], len("Hello"))
    assert first["text_offset"] + second["text_offset"] == COMPLETION.logprobs(fmt, LPS, 0)["text_offset"]


def test_token_strings_are_decoded_once_per_id() -> None:
    tok = FakeTokenizer(VOCAB)
    fmt = LogprobFormatter(tok)
    CHAT.logprobs(fmt, LPS, 0)
    COMPLETION.logprobs(fmt, LPS, 0)
    assert tok.calls == len({1, 5, 3, 6, 4})
    assert fmt.token(6) == "é"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_chunks_are_json_serialisable_as_framed(kind: str) -> None:
    lps = CHAT.logprobs(LogprobFormatter(FakeTokenizer(VOCAB)), LPS[:1], 0) if kind == "chat" else None
    chunk = renderer(kind).stream_chunk(RID, CREATED, MODEL, 0, "x", first=True, logprobs=lps)
    (event,) = decode(sse_event(chunk, event_id=4))
    assert json.loads(event.data) == chunk
