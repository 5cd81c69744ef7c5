"""No OpenAI request field is silently ignored: every field of the installed ``openai`` package's
chat and text completion request types is supported (a field of our request model), rejected with
a 400 naming it, or listed in the README as accepted and ignored."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from stages.api.fields import IGNORED_FIELDS, REJECTED_FIELDS
from stages.api.requests import ChatCompletionRequest, CompletionRequest, parse_request
from stages.errors import InvalidRequestError

README = Path(__file__).resolve().parents[3] / "README.md"

#: A value that asks for something, per rejected field (the default-like values are accepted).
_REJECTED_VALUES: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "mp3"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
    "functions": [{"name": "f"}], "function_call": "auto", "reasoning_effort": "high", "verbosity": "low",
    "moderation": {"input": True}, "suffix": "tail", "best_of": 3,
}


def _openai_fields(module: Any) -> set[str]:
    fields: set[str] = set()
    for name in ("CompletionCreateParamsStreaming", "CompletionCreateParamsNonStreaming"):
        td = getattr(module, name)
        fields |= set(td.__required_keys__) | set(td.__optional_keys__)
    return fields


def _supported(model: type) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def _ignored_in_readme() -> set[str]:
    text = README.read_text()
    section = text.split("Accepted and ignored", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"`([a-z_]+)`", section))


def _base(kind: str) -> dict[str, Any]:
    if kind == "chat":
        return {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize("kind, module, model", [
    ("chat", chat_create_params, ChatCompletionRequest),
    ("completion", completion_create_params, CompletionRequest),
])
def test_every_openai_field_is_supported_rejected_or_documented(kind: str, module: Any, model: type) -> None:
    fields = _openai_fields(module)
    assert {"model", "temperature", "stream"} <= fields  # the enumeration really reads the client's types
    supported = _supported(model)
    readme_ignored = _ignored_in_readme()
    unaccounted = []
    for name in sorted(fields):
        if name in supported:
            assert name not in REJECTED_FIELDS, name
            continue
        if name in REJECTED_FIELDS:
            body = {**_base(kind), name: _REJECTED_VALUES[name]}
            with pytest.raises(InvalidRequestError) as err:
                parse_request(model, json.dumps(body).encode())
            assert err.value.param == name and name in err.value.message
            continue
        if name in IGNORED_FIELDS and name in readme_ignored:
            parse_request(model, json.dumps({**_base(kind), name: "x" if name != "store" else True}).encode())
            continue
        unaccounted.append(name)
    assert not unaccounted, f"OpenAI {kind} fields neither supported, rejected nor documented: {unaccounted}"


def test_readme_lists_exactly_the_ignored_fields() -> None:
    assert _ignored_in_readme() == set(IGNORED_FIELDS)


def test_default_like_values_of_rejected_fields_pass() -> None:
    parse_request(ChatCompletionRequest, json.dumps({**_base("chat"), "modalities": ["text"]}).encode())
    parse_request(CompletionRequest, json.dumps({**_base("completion"), "best_of": 1, "suffix": ""}).encode())
    parse_request(CompletionRequest, json.dumps({**_base("completion"), "n": 2, "best_of": 2}).encode())
