"""Tool calls in the Hermes / Qwen2.5 format: template support, forcing grammars, output parsing.

Models of this family are taught to answer a tool request with one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The tools reach the model through its own chat template (``tools`` is a template variable);
a template that never reads it cannot show the model any tool, so such a request is a 400 rather
than a silent prompt without tools. ``tool_choice: "required"`` or a named function is enforced
by a grammar (compiled like any structured output, :mod:`stages.preprocess.grammar`); ``"auto"`` leaves the
model free and only parses. Egress turns the blocks into OpenAI ``tool_calls`` (whole calls, one
delta each when streaming) and passes the text around them through as content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from stages.errors import InvalidRequestError
from stages.transport.messages import StructuredOutputSpec

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_END), re.DOTALL)


def template_supports_tools(chat_template: Any) -> bool:
    """True when the chat template reads the ``tools`` variable (transformers' own convention)."""
    if isinstance(chat_template, dict):
        return any(template_supports_tools(t) for t in chat_template.values())
    return isinstance(chat_template, str) and re.search(r"\btools\b", chat_template) is not None


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def forcing_grammar(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool) -> StructuredOutputSpec | None:
    """The grammar that makes the model call a tool, or ``None`` when ``tool_choice`` leaves it free.

    ``"required"``: one call of any of ``tools`` (one or more when ``parallel``); a named function:
    exactly one call of it. The call's JSON follows the function's ``parameters`` schema.
    """
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        schemas = [_call_schema(t) for t in tools]
        call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        repeat = ' ("\\n" call)*' if parallel else ""
    else:
        name = tool_choice["function"]["name"]
        matching = [t for t in tools if t["function"]["name"] == name]
        if not matching:
            raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools",
                                      param="tool_choice")
        call, repeat = _call_schema(matching[0]), ""
    from stages.preprocess.grammar import JSON_OPTIONS  # compact JSON, as for every schema (see there)

    call = {**call, "x-guidance": JSON_OPTIONS}
    lark = (f'start: call{repeat}\n'
            f'call: "{TOOL_CALL_START}\\n" body "\\n{TOOL_CALL_END}"\n'
            f'body: %json {json.dumps(call)}\n')
    return StructuredOutputSpec(kind="grammar", spec=lark, param="tool_choice")


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _to_call(block: str, index: int) -> dict[str, Any] | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"index": index, "id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a whole output. Blocks that are not valid calls stay in the
    content (the client sees what the model wrote rather than losing it)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = _to_call(m.group(1), len(calls))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


@dataclass
class ToolCallStreamParser:
    """Splits streamed text into content deltas and whole tool calls.

    Text that could be the start of ``<tool_call>`` is held back until it is decided; a complete
    block becomes one call; at the end, whatever is held back is content.
    """

    buffer: str = ""
    num_calls: int = 0
    _calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Add streamed text; returns ``(content to send now, calls completed now)``."""
        self.buffer += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            start = self.buffer.find(TOOL_CALL_START)
            if start < 0:
                keep = _partial_prefix(self.buffer, TOOL_CALL_START)
                content.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(TOOL_CALL_END, start)
            if end < 0:
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                break
            call = _to_call(self.buffer[start + len(TOOL_CALL_START):end].strip(), self.num_calls)
            stop = end + len(TOOL_CALL_END)
            if call is None:
                content.append(self.buffer[:stop])
            else:
                content.append(self.buffer[:start])
                calls.append(call)
                self.num_calls += 1
            self.buffer = self.buffer[stop:]
        return "".join(content), calls

    def finish(self) -> str:
        """The held-back text, as content."""
        rest, self.buffer = self.buffer, ""
        return rest


def _partial_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
