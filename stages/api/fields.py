"""Request fields beyond plain sampling: structured outputs, tools, token restrictions, and what
happens to every OpenAI field this server does not implement.

Structured outputs come in three spellings, all mapped onto one :class:`StructuredOutputSpec`:

* OpenAI ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (``strict: false`` is constrained too);
* vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object"}``;
* vLLM's legacy ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

Only one constraint per request; two are a 400 naming the second.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.errors import InvalidRequestError
from stages.transport.messages import StructuredOutputSpec

#: OpenAI fields accepted and ignored (README "Accepted and ignored"): they describe the caller or
#: the OpenAI platform (storage, billing tier, caching hints), not what the model generates.
IGNORED_FIELDS: dict[str, str] = {
    "user": "an end-user label for OpenAI's abuse monitoring; not used here",
    "safety_identifier": "an end-user label for OpenAI's abuse monitoring; not used here",
    "metadata": "tags for OpenAI's stored completions; nothing is stored here",
    "store": "OpenAI's stored completions; nothing is stored here",
    "service_tier": "OpenAI's billing tier; there is one tier here",
    "prompt_cache_key": "a caching hint; prefix caching here is automatic",
    "prompt_cache_retention": "a caching hint; prefix caching here is automatic",
    "prompt_cache_options": "a caching hint; prefix caching here is automatic",
}

#: OpenAI fields that would change the output in ways this server cannot honour: 400 naming the
#: field when present with a non-default value. Value: why (shown to the client).
REJECTED_FIELDS: dict[str, str] = {
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated functions field is not supported; use tools",
    "function_call": "the deprecated function_call field is not supported; use tool_choice",
    "reasoning_effort": "the served model is not a reasoning model",
    "verbosity": "verbosity is not supported",
    "moderation": "moderation is not supported",
    "suffix": "suffix (insertion) is not supported",
    "best_of": "best_of is not supported; use n",
}


def _benign(name: str, value: Any, data: dict[str, Any]) -> bool:
    """Values of a rejected field that ask for nothing beyond the default."""
    if name == "modalities":
        return value == ["text"]
    if name == "best_of":
        return value in (1, data.get("n", 1))
    if name == "suffix":
        return value == ""
    return False


def reject_unsupported(data: Any) -> None:
    """400 for the first :data:`REJECTED_FIELDS` entry present (``null`` counts as absent)."""
    if not isinstance(data, dict):
        return
    for name, why in REJECTED_FIELDS.items():
        value = data.get(name)
        if value is not None and not _benign(name, value, data):
            raise InvalidRequestError(f"{name}: {why}", param=name, code="unsupported_parameter")


class _Model(BaseModel):
    # Unknown keys inside these objects are errors: a misspelt option must not be dropped silently.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class JsonSchemaFormat(_Model):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    #: ``schema`` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    """OpenAI ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Model):
    """vLLM ``structured_outputs`` (exactly one of its constraint fields)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(_Model):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StructuredFields(BaseModel):
    """Mixin of the request fields above (chat and text completions)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    #: Token id (as a string key, as JSON needs) -> bias in -100..100.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] = Field(default_factory=dict)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    bad_words: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=64)

    @field_validator("logit_bias")
    @classmethod
    def _int_keys(cls, v: dict[str, float]) -> dict[str, float]:
        for key in v:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
        return v

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in self.logit_bias.items()}

    def structured_output(self) -> StructuredOutputSpec | None:
        """The one output constraint this request asks for, or ``None``."""
        found: list[StructuredOutputSpec] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutputSpec("json_object", "", "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError("response_format of type json_schema needs json_schema.schema",
                                          param="response_format.json_schema")
            found.append(StructuredOutputSpec("json_schema", json.dumps(rf.json_schema.schema_), "response_format"))
        so = self.structured_outputs
        if so is not None:
            parts = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                         ("grammar", so.grammar), ("json_object", so.json_object or None))
                     if v is not None]
            if len(parts) != 1:
                raise InvalidRequestError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                                          "json_object", param="structured_outputs")
            found.append(_spec(*parts[0], param=f"structured_outputs.{parts[0][0]}"))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append(_spec(kind, value, param=name))
        if len(found) > 1:
            raise InvalidRequestError(f"only one output constraint per request; got {found[0].param} and "
                                      f"{found[1].param}", param=found[1].param)
        return found[0] if found else None


def _spec(kind: str, value: Any, param: str) -> StructuredOutputSpec:
    if kind == "json":
        return StructuredOutputSpec("json_schema", value if isinstance(value, str) else json.dumps(value), param)
    if kind == "choice":
        return StructuredOutputSpec("choice", json.dumps(value), param)
    if kind == "json_object":
        return StructuredOutputSpec("json_object", "", param)
    return StructuredOutputSpec(kind, value, param)


class ToolFields(BaseModel):
    """Mixin of the chat request's tool fields."""

    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ToolFields:
        if not self.tools and self.tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice requires tools", param="tool_choice")
        return self

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (``None`` when there are none, or ``tool_choice`` is none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_choice_value(self) -> Any:
        """``tool_choice`` as plain data (default ``"auto"`` with tools, as OpenAI does)."""
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        return choice.model_dump() if isinstance(choice, BaseModel) else choice


def preprocess_fields(req: Any) -> dict[str, Any]:
    """The :class:`~stages.transport.messages.PreprocessRequest` keyword arguments these fields give
    (``req`` is a chat or text completion request)."""
    tools = req.tool_dicts() if isinstance(req, ToolFields) else None
    return {"structured": req.structured_output(), "bad_words": list(req.bad_words), "tools": tools,
            "tool_choice": req.tool_choice_value() if tools else None,
            "parallel_tool_calls": getattr(req, "parallel_tool_calls", True)}


def tool_parsing(req: Any) -> str | None:
    """How Egress treats ``<tool_call>`` blocks for ``req`` (see ``GenerationJob.tool_parsing``)."""
    if not isinstance(req, ToolFields) or req.tool_dicts() is None:
        return None
    choice = req.tool_choice_value()
    return "named" if isinstance(choice, dict) else choice
