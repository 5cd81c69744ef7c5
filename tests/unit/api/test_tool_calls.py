"""Tool calls: the Hermes ``<tool_call>`` parser and forcing grammar (unit), and tool calling end to
end against a real app serving a tiny random-weight model whose template supports tools."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from stages.api.tool_calls import (
    ToolCallStreamParser,
    forcing_grammar,
    parse_tool_calls,
    template_supports_tools,
)
from stages.errors import InvalidRequestError
from tests.conftest import ServeApp

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


# -- unit -------------------------------------------------------------------------------------------
def test_parse_whole_output() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    assert [c["index"] for c in calls] == [0, 1] and len({c["id"] for c in calls}) == 2
    # A block that is not a call stays in the content; text without blocks is untouched.
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("plain") == ("plain", [])


def test_stream_parser_holds_back_partial_markers() -> None:
    parser = ToolCallStreamParser()
    text = 'Hi <tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call> bye <tool'
    sent, calls = [], []
    for i in range(0, len(text), 3):  # three characters at a time: markers arrive split
        content, new = parser.feed(text[i:i + 3])
        sent.append(content)
        calls += new
    sent.append(parser.finish())
    assert "".join(sent) == "Hi  bye <tool"
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_time"
    assert "<tool" not in "".join(sent[:-1])  # the unfinished marker was held back until the end


def test_forcing_grammar_and_template_detection() -> None:
    assert forcing_grammar(TOOLS, "auto", True) is None and forcing_grammar(TOOLS, "none", True) is None
    named = forcing_grammar(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True)
    assert named.kind == "grammar" and named.param == "tool_choice" and '"get_time"' in named.spec
    assert '"get_weather"' not in named.spec and ")*" not in named.spec
    assert ")*" in forcing_grammar(TOOLS, "required", True).spec
    assert ")*" not in forcing_grammar(TOOLS, "required", False).spec
    with pytest.raises(InvalidRequestError) as err:
        forcing_grammar(TOOLS, {"type": "function", "function": {"name": "nope"}}, True)
    assert err.value.param == "tool_choice"
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_supports_tools("{% for message in messages %}{{ message.content }}{% endfor %}")


# -- the real app with the tiny tools model ----------------------------------------------------------
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
