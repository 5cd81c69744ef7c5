"""``POST /tokenize`` and ``POST /detokenize``: Preprocess does the work; its reply can outgrow one
inter-deployment message (a 1 MB prompt is ~1M token ids), so it arrives in parts
(:mod:`stages.transport.chunking`) and is rendered as JSON without holding the Ingress event loop."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from stages.api.render import server_timing_header
from stages.api.requests import DetokenizeRequest, TokenizeRequest, messages_to_dicts, parse_request
from stages.ingress.http_errors import error_response
from stages.transport.chunking import join_reply, render_json


class TokenRoutes:
    """The two routes, given the Preprocess streaming handle and the Ingress's body and model checks."""

    def __init__(self, preprocess_stream: Any, read_body: Callable[[Request], Awaitable[bytes]],
                 check_model: Callable[[str | None], None]) -> None:
        self.preprocess_stream = preprocess_stream
        self.read_body = read_body
        self.check_model = check_model

    async def _bulk_reply(self, method: str, arg: Any, t0: float) -> Response:
        """A Preprocess reply in parts, as JSON; ``Server-Timing`` gives the server's time."""
        result = await join_reply(getattr(self.preprocess_stream, method).remote(arg))
        body = await render_json(result)
        total_ms = round((time.perf_counter() - t0) * 1000, 3)
        return Response(body, media_type="application/json",
                        headers={"Server-Timing": server_timing_header({"total": total_ms})})

    async def tokenize(self, request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            req = parse_request(TokenizeRequest, await self.read_body(request))
            self.check_model(req.model)
            return await self._bulk_reply("tokenize", {
                "prompt": req.prompt, "messages": messages_to_dicts(req) if req.messages is not None else None,
                "add_generation_prompt": req.add_generation_prompt,
                "add_special_tokens": bool(req.add_special_tokens)}, t0)
        except Exception as exc:  # noqa: BLE001 - rendered in the one place
            return error_response(exc)

    async def detokenize(self, request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            req = parse_request(DetokenizeRequest, await self.read_body(request))
            self.check_model(req.model)
            return await self._bulk_reply("detokenize", req.tokens, t0)
        except Exception as exc:  # noqa: BLE001 - rendered in the one place
            return error_response(exc)
