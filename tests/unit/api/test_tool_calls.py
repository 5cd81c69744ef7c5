"""Tool calls: the Hermes ``<tool_call>`` parser, the forcing grammar and template detection. Tool
calling end to end against a real app is in ``tests/app/test_tool_calls.py``."""

from __future__ import annotations

import json

import pytest

from stages.api.tool_calls import (
    ToolCallStreamParser,
    forcing_grammar,
    parse_tool_calls,
    template_supports_tools,
)
from stages.errors import InvalidRequestError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


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
