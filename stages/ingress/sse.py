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
from stages.ingress.errors import to_serve_error
from stages.ingress.lifecycle import Lifecycle, LiveRequest
from stages.openai_format import SSE_HEADERS, SSE_KEEPALIVE, final_stream_chunk, sse_event, usage
from stages.protocol import GenerationJob, StreamFrame, StreamStart, StreamSummary

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
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()  # runs the body's own finally now, not whenever it is collected
            except BaseException:  # noqa: BLE001 - even a second cancel must not skip on_close
                logger.debug("closing the SSE body failed", exc_info=True)
                raise
            finally:
                self._on_close()


def sse_response(gen: Any, job: GenerationJob, live: LiveRequest, lifecycle: Lifecycle,
                 timings: Callable[[LiveRequest, StreamSummary], dict[str, float]], *, keepalive_s: float,
                 deadline: float | None = None, headers: dict[str, str] | None = None) -> ClosingStreamingResponse:
    """The SSE response of a streamed request whose :class:`StreamStart` has been read from ``gen``:
    Egress frames as they come, heartbeats while nothing does, then the closing chunk (usage when
    asked, server timings) and ``[DONE]``; an error after the 200 is an in-band error event, then
    ``[DONE]``. However it ends, ``lifecycle.close`` runs exactly once and an unfinished Egress
    call is cancelled (which aborts the request in the engine)."""

    async def body() -> AsyncIterator[str]:
        events = 0  # Egress numbers its events from 0; the closing events continue the count
        try:
            async for item in relay(gen, keepalive_s, deadline):
                if item is None:
                    yield SSE_KEEPALIVE
                elif isinstance(item, StreamFrame):
                    events += 1
                    live.mark_tokens(item.num_tokens)
                    yield item.data
                    live.mark_flushed()  # resumed: Starlette's send of that frame returned
                else:
                    parts = timings(live, item)
                    usage_body = (usage(item.prompt_tokens, item.completion_tokens, item.cached_tokens)
                                  if job.include_usage else None)
                    yield sse_event(final_stream_chunk(job.kind, job.response_id, job.created, job.model_name,
                                                       usage_body, parts), events)
                    yield sse_event("[DONE]", events + 1)
                    lifecycle.close(live, "cancelled" if live.cancel_requested else "ok", item, parts)
                    return
        except (asyncio.CancelledError, GeneratorExit):
            live.outcome = "client_gone"
            raise
        except Exception as exc:  # noqa: BLE001 - the status is sent: report in-band, then end
            err = to_serve_error(exc)
            live.status = err.status_code
            live.outcome = "timeout" if isinstance(err, RequestTimeoutError) else "error"
            yield sse_event(err.to_dict(), events)
            yield sse_event("[DONE]", events + 1)

    def on_close() -> None:
        if not live.closed:
            gen.cancel()  # Ray Serve carries this to Egress and on to the engine: abort
            lifecycle.close(live, "client_gone" if live.outcome == "ok" else None)

    return ClosingStreamingResponse(body(), on_close, media_type="text/event-stream",
                                    headers={**SSE_HEADERS, **(headers or {})})
