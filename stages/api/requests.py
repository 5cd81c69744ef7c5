"""OpenAI-compatible request models (pydantic v2) and their conversion to engine inputs.

Conventions, chosen for compatibility with the official ``openai`` client and with vLLM:

* Unknown fields are ignored (``extra="ignore"``); a JSON ``null`` means the same as omitting the
  field, because the client sends ``null`` for optional fields the caller passed as ``None``.
* Types are strict (``"0.5"`` is not a number, ``true`` is not an integer, ``NaN`` is rejected):
  OpenAI rejects these too, and silently coercing them hides client bugs.
* ``stream_options`` is accepted but ignored when ``stream`` is false (lenient, unlike OpenAI's
  400); use :attr:`_RequestBase.include_usage` instead of reading it directly.
* ``n`` may be 1..8. Values above 4 are allowed but cost a full sequence each.
* ``echo`` (completions) is supported, but not together with ``logprobs``: we do not compute
  prompt log-probabilities, so that combination is a 400.
* Several prompts in one completions request (a batch) are a 400 for now.
* Text content parts are joined with ``"\\n"`` (as vLLM does); any other part type is a 400.
* Every field of the official ``openai`` package's request types is supported, rejected with a 400
  that names it (:data:`REJECTED_FIELDS`), or accepted and ignored as the README lists
  (:data:`IGNORED_FIELDS`); ``tests/unit/api/test_fields.py`` checks the installed client against this.
* Structured outputs: ``response_format`` (OpenAI), ``structured_outputs`` (vLLM's current field)
  and the legacy ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; at
  most one constraint per request (``tool_choice`` forcing a call counts as one).

Every validation failure surfaces from :func:`parse_request` as an
:class:`~stages.errors.InvalidRequestError` whose ``param`` is the offending field's dotted path.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from stages.api.fields import StructuredFields, ToolFields, reject_unsupported
from stages.api.kinds import ApiKind
from stages.api.max_tokens import UNRESOLVED, MaxTokens
from stages.errors import InvalidRequestError
from stages.transport.messages import MAX_TOP_LOGPROBS, SamplingParams

#: Largest ``n`` accepted; every choice is a full sequence in the engine.
MAX_N = 8
#: Most stop strings per request (OpenAI allows 4; vLLM is unbounded).
MAX_STOP = 16

_NonEmptyStr = Annotated[str, Field(min_length=1)]
_TokenId = Annotated[int, Field(ge=0)]
_M = TypeVar("_M", bound=BaseModel)


class _Base(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_omitted(cls, data: Any) -> Any:
        # The openai client sends ``null`` for optional fields; treat it as "use the default" so
        # fields can keep non-optional types (``n: int = 1``) instead of ``int | None`` everywhere.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in cls.model_fields)}
        return data


class StreamOptions(_Base):
    """``stream_options``: only ``include_usage`` is honoured."""

    include_usage: bool = False


class FunctionCall(_Base):
    name: str
    arguments: str


class ToolCall(_Base):
    """A tool call an assistant message made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Base):
    """One chat message. ``content`` is normalised to a string (text parts joined)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | None = None
    name: str | None = None
    #: An assistant turn's earlier calls (multi-turn tool use), passed to the chat template.
    tool_calls: list[ToolCall] | None = None
    #: A ``tool`` message answers the call with this id.
    tool_call_id: str | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _content_to_text(cls, v: Any) -> str | None:
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("content must be a string or a list of text parts")
        texts: list[str] = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError(f"content part {i} must be an object with a string 'type'")
            if part["type"] != "text":
                raise ValueError(f"only text content parts are supported, got {part['type']!r} (part {i})")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} of type 'text' needs a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        # Only assistant messages may omit content (they may carry tool_calls instead).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for role '{self.role}'")
        return self


class _RequestBase(_Base, StructuredFields):
    """Sampling and streaming fields shared by chat and text completions. Each subclass is one
    API: its :attr:`kind` picks the response renderer (:func:`stages.api.render.renderer`)."""

    kind: ClassVar[ApiKind]
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    #: -1 and 0 both disable top-k.
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    #: Range of ``torch.Generator.manual_seed``.
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: list[_NonEmptyStr] = Field(default_factory=list, max_length=MAX_STOP)
    stop_token_ids: list[_TokenId] = Field(default_factory=list)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        reject_unsupported(data)
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_to_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` if given, else ``max_tokens``; ``None`` = up to the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_rule(self, limit: int) -> MaxTokens:
        """This request's output-length ask under the operator's ``limit`` (0: none), resolved
        once the prompt's length is known (:mod:`stages.api.max_tokens`)."""
        field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return MaxTokens(self.requested_max_tokens, field, limit)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk (never for non-streamed ones)."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_RequestBase, ToolFields):
    """Body of ``POST /v1/chat/completions``."""

    kind = ApiKind.CHAT
    #: Chat never echoes the prompt (the field is a text completions one).
    echo: ClassVar[bool] = False
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def logprobs_asked(self) -> int | None:
        """``SamplingParams.logprobs``: ``None`` for none, else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_input(self) -> dict[str, Any]:
        """The ``PreprocessRequest`` field holding what the model is prompted with."""
        return {"messages": messages_to_dicts(self)}

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        # Raised directly (not ValueError) so the error names the field instead of the body.
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        return self


class CompletionRequest(_RequestBase):
    """Body of ``POST /v1/completions``. ``prompt`` is normalised to a string or token ids."""

    kind = ApiKind.COMPLETION
    prompt: str | list[int]
    #: Number of alternatives per token (OpenAI allows 5; we allow up to 20).
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    @property
    def logprobs_asked(self) -> int | None:
        """``SamplingParams.logprobs``: ``None`` for none, else how many alternatives per token."""
        return self.logprobs

    def prompt_input(self) -> dict[str, Any]:
        """The ``PreprocessRequest`` field holding what the model is prompted with."""
        return {"prompt": self.prompt}

    @field_validator("prompt", mode="plain")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        return _normalise_prompt(v)

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError(
                "echo together with logprobs is not supported (prompt logprobs are not computed)",
                param="echo",
            )
        return self


class TokenizeRequest(_Base):
    """Body of ``POST /tokenize``: exactly one of ``prompt`` or ``messages``.

    ``add_special_tokens`` defaults to true for a prompt and false for messages, because chat
    templates already contain the special tokens (it is always a bool after validation).
    """

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None

    @model_validator(mode="after")
    def _exactly_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError(
                "exactly one of `prompt` or `messages` must be given",
                param="prompt" if self.prompt is None else "messages",
            )
        if self.add_special_tokens is None:
            self.add_special_tokens = self.messages is None
        return self


class DetokenizeRequest(_Base):
    """Body of ``POST /detokenize``."""

    model: str | None = None
    tokens: list[_TokenId]


def _token_ids(v: list[Any]) -> list[int]:
    # bool is a subclass of int; ``[true]`` is not a token id.
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise ValueError("token ids must be non-negative integers")
    if not v:
        raise ValueError("prompt must not be empty")
    return v


def _normalise_prompt(v: Any) -> str | list[int]:
    """Reduce the four OpenAI prompt shapes to one string or one list of token ids."""
    if isinstance(v, str):
        if not v:
            raise ValueError("prompt must not be empty")
        return v
    if not isinstance(v, list):
        raise ValueError("prompt must be a string, a list of token ids, or a list holding one of those")
    if v and all(isinstance(p, str | list) for p in v):
        if len(v) > 1:
            raise ValueError(
                f"batched prompts ({len(v)} prompts in one request) are not supported; "
                "send one prompt per request"
            )
        return _normalise_prompt(v[0])
    return _token_ids(v)


def _clean_msg(msg: str) -> str:
    # Pydantic prefixes messages from our ValueErrors; the client does not need to see that.
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix) :]
    return msg


def _to_invalid_request(exc: ValidationError) -> InvalidRequestError:
    errors = exc.errors(include_url=False)
    parts: list[str] = []
    for err in errors[:3]:
        path = ".".join(str(p) for p in err["loc"])
        parts.append(f"{path}: {_clean_msg(err['msg'])}" if path else _clean_msg(err["msg"]))
    message = "; ".join(parts)
    if len(errors) > 3:
        message += f" (and {len(errors) - 3} more errors)"
    param = ".".join(str(p) for p in errors[0]["loc"]) or None
    return InvalidRequestError(message, param=param)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in JSON")


#: A JSON escape of a UTF-16 surrogate (``\\uD800``-``\\uDFFF``): only these can put one in a string.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(value: Any) -> UnicodeEncodeError | None:
    """The error of the first string in ``value`` (keys included) that holds a lone surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                return exc
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def parse_request(model_cls: type[_M], body: bytes) -> _M:
    """Parse and validate a JSON request body into ``model_cls``.

    Raises :class:`InvalidRequestError` (400) for malformed JSON, a body that is not a JSON
    object, a string that is not Unicode text (a lone surrogate escape such as ``"\\ud800"``: JSON
    allows it, but no tokenizer can take it), or any validation failure; ``param`` then names the
    first offending field.
    """
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidRequestError(f"The request body is not valid JSON: {e}") from None
    # Only a body with a surrogate escape is walked (an escaped emoji is a valid pair).
    if _SURROGATE_ESCAPE.search(body) and (bad := _lone_surrogate(data)) is not None:
        raise InvalidRequestError(f"The request body is not valid Unicode: a string holds the lone surrogate "
                                  f"\\u{ord(bad.object[bad.start]):04x} at character {bad.start}.")
    if not isinstance(data, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise _to_invalid_request(e) from None


def to_sampling_params(req: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
    """Map a chat or text completion request onto engine :class:`SamplingParams`.

    Everything but ``max_tokens``, which needs the prompt's length: it is left at
    :data:`~stages.api.max_tokens.UNRESOLVED` until Preprocess resolves the request's
    :meth:`~_RequestBase.max_tokens_rule` (the engine refuses a request that skipped that).
    """
    return SamplingParams(
        max_tokens=UNRESOLVED,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(req.top_k, 0),  # -1 (vLLM's "off") becomes our 0
        min_p=req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        stop=list(req.stop),
        stop_token_ids=list(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs_asked,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=req.logit_bias_ids(),
        allowed_token_ids=list(req.allowed_token_ids) if req.allowed_token_ids is not None else None,
    )


def messages_to_dicts(req: ChatCompletionRequest | TokenizeRequest) -> list[dict[str, Any]]:
    """``[{"role", "content", ...}]`` ready for a chat template; ``developer`` becomes ``system``.

    An assistant turn's ``tool_calls`` carry their arguments as objects, as tool-aware templates
    expect (they render them with ``tojson``); a ``tool`` turn keeps its ``tool_call_id``.
    """
    if req.messages is None:
        raise InvalidRequestError("messages are required", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments, f"messages.{i}.tool_calls")}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            msg["name"] = m.name
        out.append(msg)
    return out


def _arguments(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidRequestError("tool call arguments must be a JSON string", param=param) from None
