"""``bench.lean_client`` against the real app: the benchmark's low-overhead client counts what the
httpx client (``bench.common.stream_completion``) counts on the same greedy request; keep-alive
reuse; an error status. Its chunked decoder is unit-tested in ``tests/unit/bench/test_lean_client.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from bench.common import MODEL_NAME, stream_completion
from bench.lean_client import LeanClient


def test_lean_client_matches_httpx_on_the_real_app(serve_app: Any) -> None:
    body = {"model": MODEL_NAME, "prompt": "Write about rivers:", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}

    async def go() -> tuple[Any, Any, Any, int]:
        lean = LeanClient(serve_app.url)
        try:
            a = await lean.stream_completion(body)
            b = await lean.stream_completion(body)
            pooled = len(lean._idle)
        finally:
            await lean.aclose()
        async with httpx.AsyncClient(timeout=120) as client:
            ref = await stream_completion(client, serve_app.url, body)
        return a, b, ref, pooled

    a, b, ref, pooled = asyncio.run(go())
    assert pooled == 1  # the second request reused the first one's connection
    for r in (a, b):
        assert r.num_tokens == ref.num_tokens == 12
        # One content event per token here (one stream): the same count of timed events.
        assert len(r.token_times) == len(ref.token_times) > 0
        assert r.token_times == sorted(r.token_times) and 0 < r.ttft <= r.e2e
        assert r.final is not None and r.final["usage"]["completion_tokens"] == 12
        assert r.final.get("server_timing", {}).get("ttft") is not None


def test_lean_client_raises_on_an_error_status(serve_app: Any) -> None:
    async def go() -> None:
        lean = LeanClient(serve_app.url)
        try:
            await lean.stream_completion({"model": "no-such-model", "prompt": "x", "max_tokens": 2})
        finally:
            await lean.aclose()

    with pytest.raises(RuntimeError, match=r"HTTP 404"):
        asyncio.run(go())
