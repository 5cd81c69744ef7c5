"""Tool calling end to end against a real app serving a tiny random-weight model whose template
supports tools (``tests/tools_model.py``): forced and named calls, streamed deltas, a multi-turn
history, and the 400s. The parser and grammar are unit-tested in ``tests/unit/api/test_tool_calls.py``."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.conftest import ServeApp
from tests.unit.api.test_tool_calls import PARAMS, TOOLS


def _client(app: ServeApp) -> OpenAI:
    return OpenAI(base_url=app.url + "/v1", api_key="none", max_retries=0, timeout=120)


MSGS = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _check_call(call: dict, names: set[str]) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] in names
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])


def test_required_and_named_tool_choice(serve_app_tools: ServeApp) -> None:
    client = _client(serve_app_tools)
    r = client.chat.completions.create(model="tiny-tools", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=80)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert len(msg.tool_calls) == 1
    _check_call(msg.tool_calls[0].model_dump(), {"get_weather", "get_time"})
    named = client.chat.completions.create(
        model="tiny-tools", messages=MSGS, tools=TOOLS, temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.choices[0].finish_reason == "stop"  # OpenAI's reason for a forced function
    (call,) = named.choices[0].message.tool_calls
    _check_call(call.model_dump(), {"get_time"})
    # The tools reached the model through its template: the prompt grew by their signatures.
    bare = client.chat.completions.create(model="tiny-tools", messages=MSGS, temperature=0, max_tokens=1)
    assert named.usage.prompt_tokens > bare.usage.prompt_tokens + 40


def test_tool_calls_stream_as_deltas(serve_app_tools: ServeApp) -> None:
    stream = _client(serve_app_tools).chat.completions.create(
        model="tiny-tools", messages=MSGS, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=80, stream=True)
    calls, content, finish = [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        calls += [c.model_dump() for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and "".join(content) == "" and len(calls) == 1
    _check_call(calls[0], {"get_weather", "get_time"})
    plain = _client(serve_app_tools).chat.completions.create(
        model="tiny-tools", messages=MSGS, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=80)
    assert plain.choices[0].message.tool_calls[0].function.model_dump() == calls[0]["function"]


def test_multi_turn_and_bad_tool_choice(serve_app_tools: ServeApp) -> None:
    client = _client(serve_app_tools)
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="tiny-tools", messages=history, tools=TOOLS, temperature=0,
                                       max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="tiny-tools", messages=MSGS, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "missing"}})
    assert err.value.body["param"] == "tool_choice"
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="tiny-tools", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format"
