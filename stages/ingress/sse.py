"""Relaying an Egress stream to the client as Server-Sent Events.

:func:`relay` turns the typed Egress stream into what the SSE body needs: each item as it comes, a
heartbeat tick whenever nothing came for ``keepalive_s`` (the ``: keep-alive`` comment keeps
proxies from timing out, and writing it is how a dead client is noticed during long silences), and
a :class:`RequestTimeoutError` at the request's deadline.

:class:`ClosingStreamingResponse` guarantees cleanup however the client leaves, including before
Starlette has started iterating the body (then the body generator never runs, so its own
``finally`` cannot be relied on).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from stages.errors import InternalServerError, RequestTimeoutError
from stages.protocol import StreamFrame, StreamStart, StreamSummary

logger = logging.getLogger("lifecycle.ingress")


async def _next(items: Any) -> Any:
    try:
        return await items.__anext__()
    except StopAsyncIteration:
        raise InternalServerError("egress stream ended without a summary") from None


async def first_item(items: Any) -> StreamStart:
    """Wait for the stream's :class:`StreamStart` (the engine accepted the request)."""
    item = await _next(items)
    if not isinstance(item, StreamStart):
        raise InternalServerError(f"egress stream began with {type(item).__name__}")
    return item


async def relay(items: Any, keepalive_s: float, deadline: float | None = None
                ) -> AsyncIterator[StreamFrame | StreamSummary | None]:
    """Items after the :class:`StreamStart`, up to and including the :class:`StreamSummary`;
    ``None`` is a heartbeat tick. ``deadline`` is a ``time.perf_counter()`` value."""
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            pending = asyncio.ensure_future(_next(items))
            while True:
                wait = keepalive_s
                if deadline is not None:
                    wait = min(wait, max(deadline - time.perf_counter(), 0.0))
                done, _ = await asyncio.wait({pending}, timeout=wait)
                if done:
                    break
                if deadline is not None and time.perf_counter() >= deadline:
                    raise RequestTimeoutError()
                yield None
            item = pending.result()
            pending = None
            yield item
            if isinstance(item, StreamSummary):
                return
    finally:
        if pending is not None:
            pending.cancel()


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that always runs ``on_close`` once it is done, however it ended: the
    body finished, the client left mid-body, or the client left before the body started."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()  # runs the body's own finally now, not whenever it is collected
                except Exception:  # noqa: BLE001 - cleanup below must still run
                    logger.debug("closing the SSE body failed", exc_info=True)
            self._on_close()
