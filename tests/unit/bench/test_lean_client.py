"""``bench.lean_client``: the benchmark's low-overhead client counts what the httpx client counts.

The chunked decoder against every split of a real body; the client against the real app, next to
``bench.common.stream_completion`` on the same greedy request; keep-alive reuse; an error status.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from bench.common import MODEL_NAME, stream_completion
from bench.lean_client import LeanClient, _Chunked


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


EVENTS = [b'data: {"choices":[{"index":0,"text":"a\\"text\\":\\"b"}]}\n\n',  # an escaped pattern in a text
          b'data: {"choices":[{"index":0,"text":""}]}\n\n',
          b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\n', b"data: [DONE]\n\n"]
BODY = b"".join(_chunk(e) for e in EVENTS) + b"0\r\n\r\n"


@pytest.mark.parametrize("step", [1, 2, 3, 7, len(BODY)])
def test_chunked_decoder_any_split(step: int) -> None:
    dec = _Chunked()
    out = b"".join(dec.feed(BODY[i:i + step]) for i in range(0, len(BODY), step))
    assert out == b"".join(EVENTS)
    assert dec.done
    # What is left is the body's closing blank line (or part of it), nothing of the payload.
    assert bytes(dec.buf) in (b"", b"\r", b"\r\n")


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
