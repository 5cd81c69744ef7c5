"""The OpenAPI 3.1 document of the public API, served at ``GET /openapi.json``.

Request bodies are generated from the pydantic models that validate them
(:mod:`stages.api.requests`), so the document cannot drift from what the server accepts. Where a
model's validator accepts more shapes than its type annotation says (``prompt``, ``stop``, message
``content``), the generated schema is replaced by the shapes the validator takes. Limits that depend
on the deployment go in as real bounds: ``max_tokens`` is at most the configured
``http.max_tokens_limit`` (else the context length), ``n`` at most 8, a body at most
``http.max_body_bytes``.

Responses are described by hand (they are built as dicts in :mod:`stages.api.render`): every
error status uses the OpenAI error shape, and the tests fuzz the running app against this document
(schemathesis), checking for server errors and response conformance.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

from pydantic.json_schema import models_json_schema

from stages.api.render import CHAT, COMPLETION, Renderer
from stages.api.requests import (
    MAX_STOP,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

_REF = "#/components/schemas/{model}"
_JSON = "application/json"

_NULLABLE_STR = {"type": ["string", "null"]}
_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": _NULLABLE_STR, "code": _NULLABLE_STR}}},
}
_USAGE = {
    "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {"prompt_tokens": {"type": "integer", "minimum": 0},
                   "completion_tokens": {"type": "integer", "minimum": 0},
                   "total_tokens": {"type": "integer", "minimum": 0},
                   "prompt_tokens_details": {"type": "object"}},
}
_TIMING = {"type": "object", "additionalProperties": {"type": "number"}}
_FINISH = {"type": "string", "enum": ["stop", "length", "abort"]}


_CHAT_CHOICE = {"type": "object", "required": ["index", "message", "finish_reason"],
                "properties": {"index": {"type": "integer"}, "finish_reason": _FINISH,
                               "logprobs": {"type": ["object", "null"]},
                               "message": {"type": "object", "required": ["role", "content"],
                                           "properties": {"role": {"const": "assistant"},
                                                          "content": {"type": "string"}}}}}
_TEXT_CHOICE = {"type": "object", "required": ["index", "text", "finish_reason"],
                "properties": {"index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _FINISH,
                               "logprobs": {"type": ["object", "null"]}}}


def _completion_body(api: Renderer, choice: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"const": api.object_name},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "items": choice},
                           "usage": {"$ref": "#/components/schemas/Usage"},
                           "server_timing": {"$ref": "#/components/schemas/ServerTiming"}}}


_TOKENIZE_RESPONSE = {
    "type": "object", "required": ["prompt", "tokens", "count", "max_model_len", "token_strs"],
    "properties": {"prompt": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer"}},
                   "count": {"type": "integer", "minimum": 0}, "max_model_len": {"type": "integer"},
                   "token_strs": {"type": "array", "items": {"type": ["string", "null"]}}},
}
_MODELS = {
    "type": "object", "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "object", "created", "owned_by"],
        "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                       "owned_by": {"type": "string"}, "root": {"type": "string"},
                       "max_model_len": {"type": ["integer", "null"]}}}}},
}
_CANCELLATION = {
    "type": "object", "required": ["object", "id", "cancelled"],
    "properties": {"object": {"const": "cancellation"}, "id": {"type": "string"},
                   "cancelled": {"type": "array", "items": {
                       "type": "object", "required": ["id"],
                       "properties": {"id": {"type": "string"}, "x_request_id": _NULLABLE_STR}}}},
}

#: Error statuses each kind of route can answer with (besides 401 when keys are on).
_GENERATE_ERRORS = (400, 404, 413, 429, 503, 504)
_DESCRIPTIONS = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model, route or id",
                 405: "Wrong method", 413: "Body over http.max_body_bytes", 429: "Overloaded or over the key's limit",
                 503: "A stage is unavailable", 504: "Request timed out"}


@cache
def _request_schemas() -> dict[str, Any]:
    """The request models' JSON schemas (as components), with the validator-accepted shapes."""
    _, top = models_json_schema(
        [(m, "validation") for m in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)],
        ref_template=_REF)
    defs: dict[str, Any] = top["$defs"]
    stop = {"anyOf": [{"type": "string", "minLength": 1},
                      {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1}}]}
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        defs[name]["properties"]["stop"] = stop
    defs["CompletionRequest"]["properties"]["prompt"] = {
        "description": "One prompt: a string or token ids (a list holding one of those is accepted too).",
        "anyOf": [{"type": "string", "minLength": 1}, token_ids,
                  {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
                  {"type": "array", "minItems": 1, "maxItems": 1, "items": token_ids}]}
    defs["ChatMessage"]["properties"]["content"] = {
        "description": "Text, or a list of text parts (joined with newlines); only assistant messages may omit it.",
        "anyOf": [{"type": "string"}, {"type": "array", "items": text_part}, {"type": "null"}]}
    defs["ChatMessage"]["anyOf"] = [
        {"properties": {"role": {"const": "assistant"}}},
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}]
    # Exactly one of the two, as the model's validator demands (null counts as absent).
    defs["TokenizeRequest"]["oneOf"] = [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]
    return defs


def _op(summary: str, *, body: str | None = None, ok: dict[str, Any], errors: tuple[int, ...] = (),
        params: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK", "content": ok}}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {_JSON: {"schema": {"$ref": _REF.format(model=body)}}}}
    if params:
        op["parameters"] = params
    for status in errors:
        op["responses"][str(status)] = {"$ref": f"#/components/responses/Error{status}"}
    return op


def _json(ref: str) -> dict[str, Any]:
    return {_JSON: {"schema": {"$ref": _REF.format(model=ref)}}}


def build_openapi(*, version: str, model: str, max_tokens: int | None, max_body_bytes: int, auth: bool,
                  auth_exempt_paths: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The document. ``model``: the served model name (the one ``model`` value accepted);
    ``max_tokens``: the largest ``max_tokens`` a request may ask (``None``: unknown right now, then
    no ``maximum``); ``auth``: whether API keys are on."""
    schemas = copy.deepcopy(_request_schemas())
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        schemas[name]["properties"]["model"] = {"type": "string", "enum": [model]}
    for name in ("TokenizeRequest", "DetokenizeRequest"):
        schemas[name]["properties"]["model"] = {"anyOf": [{"type": "string", "enum": [model]}, {"type": "null"}]}
    if max_tokens is not None:
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            for field in ("max_tokens", "max_completion_tokens"):
                schemas[name]["properties"][field]["anyOf"][0]["maximum"] = max_tokens
    schemas.update(Error=_ERROR, Usage=_USAGE, ServerTiming=_TIMING, ChatCompletion=_completion_body(CHAT, _CHAT_CHOICE),
                   Completion=_completion_body(COMPLETION, _TEXT_CHOICE), TokenizeResponse=_TOKENIZE_RESPONSE,
                   DetokenizeResponse={"type": "object", "required": ["prompt"],
                                       "properties": {"prompt": {"type": "string"}}},
                   ModelList=_MODELS, Cancellation=_CANCELLATION)
    # Before OpenAPI 3.2, an event stream's ``schema`` describes one event.
    sse = {"text/event-stream": {
        "description": "When stream is true: one event per chunk (data: a JSON chunk object, or an error "
                       "object after the 200), then data: [DONE]",
        "schema": {"type": "object", "required": ["data"],
                   "properties": {"data": {"type": "string", "minLength": 1}, "id": {"type": "string"},
                                  "event": {"type": "string"}}}}}
    cancel_id = [{"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"},
                  "description": "A response id, the server id, or a client X-Request-Id"}]
    paths: dict[str, Any] = {
        CHAT.path: {"post": _op("Chat completion (streamed when stream is true)", body="ChatCompletionRequest",
                                ok={**_json("ChatCompletion"), **sse}, errors=_GENERATE_ERRORS)},
        COMPLETION.path: {"post": _op("Text completion (streamed when stream is true)", body="CompletionRequest",
                                      ok={**_json("Completion"), **sse}, errors=_GENERATE_ERRORS)},
        "/v1/models": {"get": _op("The served model", ok=_json("ModelList"))},
        "/v1/requests/{request_id}/cancel": {"post": _op("Cancel a live request", ok=_json("Cancellation"),
                                                         errors=(404,), params=cancel_id)},
        "/tokenize": {"post": _op("The prompt as the model sees it, and its token ids", body="TokenizeRequest",
                                  ok=_json("TokenizeResponse"), errors=(400, 404, 413, 429, 503))},
        "/detokenize": {"post": _op("Token ids to text", body="DetokenizeRequest", ok=_json("DetokenizeResponse"),
                                    errors=(400, 404, 413, 429, 503))},
        "/health": {"get": _op("200 when every stage answers and every engine makes progress",
                               ok={_JSON: {"schema": {"type": "object"}}}, errors=(503,))},
        "/version": {"get": _op("Server version", ok={_JSON: {"schema": {
            "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}})},
        "/metrics": {"get": _op("Prometheus metrics of every replica", ok={"text/plain": {"schema": {"type": "string"}}})},
        "/openapi.json": {"get": _op("This document", ok={_JSON: {"schema": {"type": "object"}}})},
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "lifecycle-serve", "version": version,
                 "description": "OpenAI-compatible LLM inference server. Errors use the OpenAI shape "
                                f"{{\"error\": {{message, type, param, code}}}}; bodies are at most {max_body_bytes} "
                                "bytes. Types are strict: an integer is written without a fraction (1, not 1.0), "
                                "a number is not a string, and null means the field is absent."},
        "paths": paths,
        "components": {"schemas": schemas, "responses": {
            f"Error{s}": {"description": d, "content": _json("Error")} for s, d in _DESCRIPTIONS.items()}},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearerAuth": []}]
        for path, item in paths.items():
            for op in item.values():
                if path in auth_exempt_paths:
                    op["security"] = []
                else:
                    op["responses"]["401"] = {"$ref": "#/components/responses/Error401"}
    return doc
