"""HTTP errors from the real app: every bad input gets its status and the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``; a full engine answers 429 with ``Retry-After``;
nothing leaks, and a burst of bad requests does not hang the server."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.app.test_cancellation import LongStreams, poll_stats, wait_idle
from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.serve

CHAT = [{"role": "user", "content": "Hello"}]
MAX_BODY = 65536


@dataclass
class Case:
    body: Any = None  # dict -> JSON; bytes -> raw; None -> no body
    status: int = 400
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    path: str = "/v1/completions"
    method: str = "POST"
    message: str | None = None  # regex the message must match
    chunked: bool = False


def _c(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **kw}


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, **kw}


CASES: dict[str, Case] = {
    "malformed json": Case(b'{"model": "x", ', message="not valid JSON"),
    "lone surrogate": Case(b'{"model": "' + MODEL_NAME.encode() + rb'", "prompt": "a\ud800b", "max_tokens": 4}',
                           message="lone surrogate"),
    "malformed json chat": Case(b"{not json", path="/v1/chat/completions", message="not valid JSON"),
    "json array body": Case(b'[{"model": "x"}]', message="JSON object"),
    "json string body": Case(b'"hello"', message="JSON object"),
    "NaN temperature": Case(b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL_NAME.encode()),
    "missing model": Case({"prompt": "Hello"}, param="model"),
    "missing model chat": Case({"messages": CHAT}, param="model", path="/v1/chat/completions"),
    "unknown model": Case(_c(model="gpt-17"), status=404, param="model", code="model_not_found",
                          message="gpt-17"),
    "unknown model chat": Case(_chat(model="gpt-17"), status=404, param="model", code="model_not_found",
                               path="/v1/chat/completions"),
    "temperature 5": Case(_c(temperature=5), param="temperature"),
    "temperature as string": Case(_c(temperature="0.5"), param="temperature"),
    "top_p 0": Case(_c(top_p=0), param="top_p"),
    "n 0": Case(_c(n=0), param="n"),
    "n 9": Case(_chat(n=9), param="n", path="/v1/chat/completions"),
    "max_tokens 0": Case(_c(max_tokens=0), param="max_tokens"),
    "max_tokens negative chat": Case(_chat(max_tokens=-1), param="max_tokens", path="/v1/chat/completions"),
    "top_logprobs without logprobs": Case(_chat(top_logprobs=2), param="top_logprobs",
                                          path="/v1/chat/completions"),
    "top_logprobs 21": Case(_chat(logprobs=True, top_logprobs=21), param="top_logprobs",
                            path="/v1/chat/completions"),
    "echo with logprobs": Case(_c(echo=True, logprobs=1), param="echo"),
    "missing messages": Case({"model": MODEL_NAME}, param="messages", path="/v1/chat/completions"),
    "empty messages": Case(_chat(messages=[]), param="messages", path="/v1/chat/completions"),
    "bad role": Case(_chat(messages=[{"role": "robot", "content": "hi"}]), param="messages.0.role",
                     path="/v1/chat/completions"),
    "image part": Case(_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
                       param="messages.0.content", path="/v1/chat/completions"),
    "empty prompt": Case(_c(prompt=""), param="prompt"),
    "batched prompts": Case(_c(prompt=["a", "b"]), param="prompt"),
    "token id outside vocab": Case(_c(prompt=[1, 2, 10**9]), param="prompt", message="outside the vocabulary"),
    "empty stop string": Case(_c(stop=[""]), param="stop.0"),
    "context exceeded": Case(_c(max_tokens=100000), param="prompt", code="context_length_exceeded",
                             message=r"maximum context length is \d+ tokens.*\(\d+ in the prompt, "
                                     r"100000 in the completion\)"),
    "context exceeded chat": Case(_chat(max_completion_tokens=100000), param="messages",
                                  code="context_length_exceeded", path="/v1/chat/completions",
                                  message=r"100000 in the completion"),
    "body too large": Case(json.dumps(_c(prompt="x" * (MAX_BODY + 100))).encode(), status=413,
                           message=str(MAX_BODY)),
    "body too large chunked": Case(json.dumps(_c(prompt="x" * (MAX_BODY + 100))).encode(), status=413,
                                   chunked=True, message=str(MAX_BODY)),
    "unknown route": Case(None, status=404, path="/v1/nope", method="GET"),
    "unknown route post": Case(_c(), status=404, path="/v1/engines/x/completions"),
    "GET completions": Case(None, status=405, method="GET"),
    "POST models": Case({}, status=405, path="/v1/models"),
    "tokenize neither": Case({"model": MODEL_NAME}, param="prompt", path="/tokenize"),
    "tokenize unknown model": Case({"model": "nope", "prompt": "x"}, status=404, param="model",
                                   code="model_not_found", path="/tokenize"),
    "detokenize bad id": Case({"tokens": [10**9]}, param="tokens", path="/detokenize"),
    "detokenize not a list": Case({"tokens": "abc"}, param="tokens", path="/detokenize"),
}


def send(url: str, case: Case, client: httpx.Client | None = None) -> httpx.Response:
    kw: dict[str, Any] = {}
    if isinstance(case.body, bytes):
        content = case.body
        kw["content"] = (content[i:i + 8192] for i in range(0, len(content), 8192)) if case.chunked else content
        kw["headers"] = {"content-type": "application/json"}
    elif case.body is not None:
        kw["json"] = case.body
    c = client or httpx.Client(timeout=60)
    try:
        return c.request(case.method, url + case.path, **kw)
    finally:
        if client is None:
            c.close()


def check_error(resp: httpx.Response, case: Case) -> dict[str, Any]:
    assert resp.status_code == case.status, resp.text
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == case.type
    assert err["param"] == case.param
    assert err["code"] == case.code
    if case.message is not None:
        assert re.search(case.message, err["message"]), err["message"]
    return err


@pytest.mark.parametrize("name", list(CASES))
def test_bad_request(serve_app: Any, name: str) -> None:
    check_error(send(serve_app.url, CASES[name]), CASES[name])


def test_context_length_message_has_the_token_counts(serve_app: Any) -> None:
    tok = httpx.post(serve_app.url + "/tokenize", json={"messages": CHAT}, timeout=30).json()
    max_len = httpx.get(serve_app.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    # Exactly one token too many fails; exactly enough passes.
    room = max_len - tok["count"]
    err = check_error(send(serve_app.url, Case(_chat(max_tokens=room + 1), path="/v1/chat/completions")),
                      Case(param="messages", code="context_length_exceeded"))
    assert f"maximum context length is {max_len} tokens" in err["message"]
    assert f"requested {max_len + 1} tokens ({tok['count']} in the messages, {room + 1} in the completion)" \
        in err["message"]
    client = OpenAI(base_url=serve_app.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=room + 1, stream=True)
    assert info.value.code == "context_length_exceeded"


def test_openai_client_sees_typed_errors(serve_app: Any) -> None:
    client = OpenAI(base_url=serve_app.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert nf.value.status_code == 404 and nf.value.code == "model_not_found" and nf.value.param == "model"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=5, stream=True)
    assert br.value.param == "temperature"


# -- 429 -----------------------------------------------------------------------------------------------------------
def test_queue_full_gives_429_with_retry_after(serve_app: Any) -> None:
    slots = serve_app.args["engine"]["max_num_seqs"]
    queue = serve_app.args["engine"]["max_waiting_requests"]
    wait_idle(serve_app)
    with LongStreams(serve_app.url, slots + queue, max_tokens=150) as load:
        running = load.start(slots)
        load.wait("first_token", running)
        poll_stats(serve_app, lambda s: s["num_running"] == slots, timeout=30)
        waiting = load.start(queue)
        load.wait("accepted", waiting, timeout=60)
        stats, _ = poll_stats(serve_app, lambda s: s["num_waiting"] >= queue, timeout=30)
        print(f"\nengine full: {stats['num_running']} running, {stats['num_waiting']} waiting")
        assert stats["num_running"] == slots
        assert all(r.status == 200 for r in load.results), [(r.status, r.body[:100]) for r in load.results]

        t0 = time.perf_counter()
        resp = httpx.post(serve_app.url + "/v1/completions", json=_c(), timeout=60)
        print(f"429 answered in {(time.perf_counter() - t0) * 1000:.0f} ms")
        err = check_error(resp, Case(status=429, type="requests", code="rate_limit_exceeded"))
        assert err["message"]
        retry_after = resp.headers["retry-after"]
        assert retry_after.isdigit() and int(retry_after) >= 1
        # Streaming too: the status comes before any SSE byte.
        with httpx.stream("POST", serve_app.url + "/v1/chat/completions", json=_chat(stream=True), timeout=60) as r:
            r.read()
            check_error(r, Case(status=429, type="requests", code="rate_limit_exceeded"))
            assert r.headers["retry-after"].isdigit()
        client = OpenAI(base_url=serve_app.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2)
        assert info.value.status_code == 429 and info.value.code == "rate_limit_exceeded"
        # None of the rejected requests took a slot.
        stats = serve_app.engine_stats()
        assert stats["num_running"] == slots and stats["num_waiting"] == queue, stats
        load.cancel(range(len(load.results)))
    stats = wait_idle(serve_app)
    assert stats["num_free_blocks"] == stats["num_kv_blocks"], stats
    # And the server takes requests again.
    assert httpx.post(serve_app.url + "/v1/completions", json=_c(), timeout=120).status_code == 200


# -- robustness ----------------------------------------------------------------------------------------------------
def test_concurrent_burst_of_invalid_requests(serve_app: Any) -> None:
    names = ["malformed json", "missing model", "unknown model", "temperature 5", "n 0", "context exceeded",
             "body too large", "top_logprobs without logprobs"]

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            async def one(name: str) -> httpx.Response:
                case = CASES[name]
                kw: dict[str, Any] = ({"content": case.body, "headers": {"content-type": "application/json"}}
                                      if isinstance(case.body, bytes) else {"json": case.body})
                return await client.request(case.method, serve_app.url + case.path, **kw)

            return await asyncio.wait_for(asyncio.gather(*(one(n) for n in names)), 60)

    t0 = time.perf_counter()
    responses = asyncio.run(main())
    print(f"\n{len(names)} concurrent invalid requests answered in {time.perf_counter() - t0:.2f} s")
    for name, resp in zip(names, responses, strict=True):
        check_error(resp, CASES[name])


def test_app_healthy_and_nothing_leaked_after_errors(serve_app: Any) -> None:
    assert httpx.get(serve_app.url + "/health", timeout=30).status_code == 200
    stats = wait_idle(serve_app)
    assert stats["num_free_blocks"] == stats["num_kv_blocks"], stats
    assert stats.get("num_streams", 0) == 0
    resp = httpx.post(serve_app.url + "/v1/completions", timeout=120, json=_c(max_tokens=3, temperature=0))
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"]
