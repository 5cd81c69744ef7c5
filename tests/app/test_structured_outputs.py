"""Structured outputs, logit_bias and tool rejection against the real app (the session's Serve
app, the real SmolLM2, the official ``openai`` client): every output parses and validates."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
import uuid
from typing import Any

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.conftest import MODEL_NAME, ServeApp

#: Ten varied schemas; strings, arrays and numbers are bounded so greedy decoding finishes.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "address": {
        "type": "object", "properties": {"street": {"type": "string", "maxLength": 16},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "zip"], "additionalProperties": False}},
     "required": ["city", "address"], "additionalProperties": False},
    {"type": "object", "properties": {"colours": {"type": "array", "items": {
        "type": "string", "enum": ["red", "green", "blue", "yellow"]}, "minItems": 1, "maxItems": 3}},
     "required": ["colours"], "additionalProperties": False},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                                      "unit": {"type": "string", "enum": ["C", "F"]}},
     "required": ["temperature", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20},
                                      "subtitle": {"type": "string", "maxLength": 10},
                                      "pages": {"type": "integer", "minimum": 1, "maximum": 999}},
     "required": ["title"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                         "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "boolean"},
                                      "confidence": {"type": "string", "enum": ["low", "medium", "high"]}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999},
                                                       {"type": "string", "maxLength": 8}]},
                                      "kind": {"const": "record"}},
     "required": ["id", "kind"], "additionalProperties": False},
    {"type": "object", "properties": {"grid": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
     "required": ["grid", "code"], "additionalProperties": False},
]
PROMPTS = ["Describe a person.", "Where do you live?", "Name some colours.", "What is the weather?",
           "Name a book.", "Give me a line segment.", "Is the sky blue?", "What is in the cart?",
           "Make a record.", "Give me a small grid and a code."]


def _client(app: ServeApp) -> OpenAI:
    return OpenAI(base_url=app.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _schema_format(i: int) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}


def _complete(app: ServeApp, i: int) -> tuple[str, str]:
    r = _client(app).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[i]}], temperature=0, max_tokens=150,
        response_format=_schema_format(i))
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def _stream(app: ServeApp, i: int) -> tuple[str, str]:
    text, finish = [], None
    for chunk in _client(app).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[i]}], temperature=0, max_tokens=150,
            response_format=_schema_format(i), stream=True):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def _free(app: ServeApp, stream: bool) -> str:
    kw = {"stream": True} if stream else {}
    r = _client(app).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Write a short poem about rain."}],
        temperature=0, max_tokens=40, **kw)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    return r.choices[0].message.content


@pytest.fixture(scope="module")
def outputs(serve_app: ServeApp) -> dict[str, Any]:
    """Every schema non-streamed (8 at a time), then every schema streamed, all 10 at once beside
    two unconstrained requests (8 run together in the engine; the rest queue)."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        plain = list(pool.map(lambda i: _complete(serve_app, i), range(len(SCHEMAS))))
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        free = [pool.submit(_free, serve_app, s) for s in (True, False)]
        streamed = list(pool.map(lambda i: _stream(serve_app, i), range(len(SCHEMAS))))
        free_texts = [f.result() for f in free]
    return {"plain": plain, "streamed": streamed, "free": free_texts}


@pytest.mark.parametrize("mode", ["plain", "streamed"])
def test_ten_schemas_validate(outputs: dict[str, Any], mode: str) -> None:
    for i, (text, finish) in enumerate(outputs[mode]):
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i])


def test_streamed_equals_non_streamed_and_free_requests_are_unaffected(outputs: dict[str, Any]) -> None:
    # float32 weights give the same greedy tokens whatever the batch: the mask is per request.
    assert [t for t, _ in outputs["streamed"]] == [t for t, _ in outputs["plain"]]
    poem_stream, poem = outputs["free"]
    assert poem_stream == poem and not poem.lstrip().startswith("{")


def test_json_object_regex_choice_and_aliases(serve_app: ServeApp) -> None:
    client = _client(serve_app)
    msgs = [{"role": "user", "content": "Give me a phone number."}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, temperature=0, max_tokens=20,
                                       extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    choices = ["Paris", "London", "Berlin"]
    r = client.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=10,
                                       messages=[{"role": "user", "content": "Capital of France?"}],
                                       extra_body={"guided_choice": choices})
    assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
    c = client.completions.create(model=MODEL_NAME, prompt="The answer is", temperature=0, max_tokens=10,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert c.choices[0].text in ("yes", "no")
    r = client.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=40,
                                       messages=[{"role": "user", "content": "Describe a cat as JSON."}],
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON object's prefix
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def test_logit_bias_forces_and_bans_a_token(serve_app: ServeApp) -> None:
    client = _client(serve_app)
    tokens = httpx.post(serve_app.url + "/tokenize", json={"prompt": " banana"}, timeout=30).json()["tokens"]
    forced = tokens[-1]
    c = client.completions.create(model=MODEL_NAME, prompt="My favourite colour is", temperature=0, max_tokens=3,
                                  logit_bias={str(forced): 100}, logprobs=0)
    assert c.choices[0].text == " banana" * 3
    free = client.completions.create(model=MODEL_NAME, prompt="My favourite colour is", temperature=0, max_tokens=1)
    first = httpx.post(serve_app.url + "/tokenize", json={"prompt": free.choices[0].text}, timeout=30
                       ).json()["tokens"][-1]
    banned = client.completions.create(model=MODEL_NAME, prompt="My favourite colour is", temperature=0,
                                       max_tokens=1, logit_bias={str(first): -100})
    assert banned.choices[0].text != free.choices[0].text


def test_bad_schema_and_bad_fields_are_400(serve_app: ServeApp) -> None:
    client = _client(serve_app)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=msgs, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "strnig"}}}}})
    body = err.value.body
    assert body["param"] == "response_format" and "strnig" in body["message"]
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=msgs, extra_body={"guided_regex": "a(b"})
    assert err.value.body["param"] == "guided_regex"
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=msgs, logit_bias={"999999": 5})
    assert err.value.body["param"] == "logit_bias"
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=msgs, audio={"voice": "alloy", "format": "mp3"},
                                       modalities=["text", "audio"])
    assert err.value.body["param"] in ("audio", "modalities")


def test_tools_on_the_embedded_model_are_400(serve_app: ServeApp) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with pytest.raises(BadRequestError) as err:
        _client(serve_app).chat.completions.create(model=MODEL_NAME, tools=tools,
                                                   messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert err.value.body["param"] == "tools" and "tool support" in err.value.body["message"]
    assert err.value.body["code"] == "tools_not_supported"


def test_compile_span_cache_hit_engine_attribute_and_metrics(serve_app: ServeApp) -> None:
    schema = {"type": "object", "properties": {"k": {"type": "string", "enum": [uuid.uuid4().hex[:6]]}},
              "required": ["k"], "additionalProperties": False}
    rids = [f"so-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for rid in rids:  # the same new schema twice: a miss, then a hit
        r = httpx.post(serve_app.url + "/v1/chat/completions", timeout=120, headers={"X-Request-Id": rid}, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "k?"}], "max_tokens": 30, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
        json.loads(r.json()["choices"][0]["message"]["content"])
    hits = []
    deadline = time.monotonic() + 20
    for rid in rids:
        while True:
            roots = [s for s in serve_app.otlp.spans if s.attributes.get("lifecycle.client_request_id") == rid
                     and s.name.startswith("POST ")]
            spans = serve_app.otlp.trace(roots[0].trace_id) if roots else []
            names = {s.name for s in spans}
            if {"grammar_compile", "engine"} <= names or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        compile_span = next(s for s in spans if s.name == "grammar_compile")
        engine_span = next(s for s in spans if s.name == "engine")
        assert compile_span.attributes["lifecycle.grammar.kind"] == "json_schema"
        assert engine_span.attributes["lifecycle.structured_output"] == "json_schema"
        parent = {s.span_id: s.name for s in spans}[compile_span.parent_span_id]
        assert parent == "preprocess"
        hits.append(compile_span.attributes["lifecycle.grammar.cache_hit"])
    assert hits == [False, True]
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(serve_app.url + "/metrics", timeout=30).text
        if 'lifecycle:grammar_compile_seconds_count{cache="hit"' in text or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for cache in ("hit", "miss"):
        assert re.search(r'lifecycle:grammar_compile_seconds_count\{[^}]*cache="' + cache + r'"[^}]*\} [1-9]', text)
    assert re.search(r"lifecycle:grammar_mask_fill_seconds_count\{[^}]*\} [1-9]", text)
