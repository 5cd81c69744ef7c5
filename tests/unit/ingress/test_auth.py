"""API keys without Ray (stages/ingress/auth.py): Bearer parsing, 401 in the OpenAI shape, exempt
paths, key ids, LIFECYCLE_API_KEYS, the per-key in-flight limit; and the OpenAPI document's
security and bounds. The real app's keys are tested in tests/app/test_guarded_app.py."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import schemathesis
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from stages.api.openapi import build_openapi
from stages.config import AppConfig, HttpSettings
from stages.errors import AuthenticationError
from stages.ingress.auth import ApiKeys, AuthMiddleware, key_id, keys_from_env, request_key_id

KEY, OTHER = "sk-test-0123456789", "sk-other-abcdef"


def _app(keys: ApiKeys, gate: asyncio.Event | None = None) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        if gate is not None:
            await gate.wait()
        return JSONResponse({"key_id": request_key_id(request)})

    routes = [Route(p, echo, methods=["GET", "POST"]) for p in ("/v1/completions", "/health", "/metrics",
                                                                "/v1/requests/x/cancel")]
    return Starlette(routes=routes, middleware=[Middleware(AuthMiddleware, keys=keys)])


def _client(app: Starlette) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_identify_takes_only_a_configured_bearer_key() -> None:
    keys = ApiKeys([KEY, OTHER])
    assert keys.identify(f"Bearer {KEY}") == key_id(KEY) and keys.identify(f"bearer  {OTHER} ") == key_id(OTHER)
    for bad in (None, "", KEY, f"Basic {KEY}", "Bearer ", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}"):
        with pytest.raises(AuthenticationError) as info:
            keys.identify(bad)
        assert KEY not in info.value.message and info.value.status_code == 401


def test_key_ids_are_short_stable_and_not_the_key() -> None:
    assert key_id(KEY) == key_id(KEY) != key_id(OTHER)
    assert key_id(KEY).startswith("key-") and len(key_id(KEY)) == 16 and KEY not in key_id(KEY)


def test_keys_come_from_config_and_env() -> None:
    http = HttpSettings(api_keys=[KEY])
    keys = ApiKeys.from_config(http, {"LIFECYCLE_API_KEYS": f" {OTHER} ,, "})
    assert keys is not None and len(keys) == 2 and keys.identify(f"Bearer {OTHER}") == key_id(OTHER)
    assert ApiKeys.from_config(HttpSettings(), {}) is None  # the default: no keys, nothing asked
    with pytest.raises(ValueError) as info:
        keys_from_env({"LIFECYCLE_API_KEYS": "good,bad key"})
    assert "bad key" not in str(info.value)


def test_a_bad_key_in_the_config_is_not_echoed() -> None:
    with pytest.raises(ValidationError) as info:
        AppConfig.from_args({"http": {"api_keys": ["has a space secret"]}})
    assert "secret" not in str(info.value) and "api_keys" in str(info.value)
    cfg = AppConfig.from_args({"http": {"api_keys": [KEY]}})
    assert KEY not in repr(cfg) and KEY not in str(cfg.model_dump())


def test_middleware_401_200_and_exemptions() -> None:
    async def go() -> None:
        async with _client(_app(ApiKeys([KEY], exempt_paths=["/health"]))) as c:
            r = await c.post("/v1/completions")
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
            r = await c.post("/v1/completions", headers={"Authorization": f"Bearer {OTHER}"})
            assert r.status_code == 401 and OTHER not in r.text
            r = await c.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200 and r.json() == {"key_id": key_id(KEY)}
            assert (await c.get("/nowhere")).status_code == 401  # unknown routes are closed too
            assert (await c.get("/health")).status_code == 200  # exempt
            assert (await c.get("/metrics")).status_code == 401  # not exempt here
            r = await c.get("/health", headers={"Authorization": f"Bearer {KEY}"})
            assert r.json() == {"key_id": key_id(KEY)}

    _run(go())


def test_per_key_in_flight_limit_gives_429_and_frees_on_completion() -> None:
    async def go() -> None:
        gate = asyncio.Event()
        async with _client(_app(ApiKeys([KEY, OTHER], max_concurrent_per_key=2), gate)) as c:
            auth = {"Authorization": f"Bearer {KEY}"}
            held = [asyncio.create_task(c.post("/v1/completions", headers=auth)) for _ in range(2)]
            await asyncio.sleep(0.05)
            r = await c.post("/v1/completions", headers=auth)
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            assert r.headers["retry-after"] == "1"
            other = asyncio.create_task(c.post("/v1/completions", headers={"Authorization": f"Bearer {OTHER}"}))
            cancel = asyncio.create_task(c.post("/v1/requests/x/cancel", headers=auth))  # never limited
            await asyncio.sleep(0.05)
            gate.set()
            assert [t.status_code for t in await asyncio.gather(*held, other, cancel)] == [200] * 4
            assert (await c.post("/v1/completions", headers=auth)).status_code == 200  # freed again

    _run(go())


def test_openapi_document_has_bounds_security_and_loads_in_schemathesis() -> None:
    doc = build_openapi(version="1", model="m", max_tokens=8, max_body_bytes=65536, auth=True,
                        auth_exempt_paths=frozenset({"/health", "/metrics"}))
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == 8 and chat["n"]["maximum"] == 8
    assert doc["security"] == [{"bearerAuth": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert "401" in doc["paths"]["/v1/completions"]["post"]["responses"]
    ops = {op.label for op in (r.ok() for r in schemathesis.openapi.from_dict(doc).get_all_operations())}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize", "GET /openapi.json"} <= ops
    open_doc = build_openapi(version="1", model="m", max_tokens=None, max_body_bytes=65536, auth=False)
    assert "security" not in open_doc
    assert "maximum" not in open_doc["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
