"""Relaying an Egress stream to the client as Server-Sent Events.

:func:`relay` turns the typed Egress stream into what the SSE body needs: each item as it comes, a
heartbeat tick whenever nothing came for ``keepalive_s`` (the ``: keep-alive`` comment keeps
proxies from timing out, and writing it is how a dead client is noticed during long silences), and
a :class:`RequestTimeoutError` at the request's deadline. At each heartbeat tick a liveness check
(the request's engine replica still reporting and healthy) may end the stream instead: a
heartbeat alone would keep a dead request's connection open forever.

:func:`sse_response` reads the stream into a bounded per-stream buffer
(:mod:`.backpressure`) and writes to the client from it; a client that stops reading is aborted
with a ``slow_reader`` error once the bound is passed.

:class:`ClosingStreamingResponse` guarantees cleanup however the client leaves, including before
Starlette has started iterating the body (then the body generator never runs, so its own
``finally`` cannot be relied on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from stages.api.render import SSE_HEADERS, SSE_KEEPALIVE, renderer, sse_event, usage
from stages.errors import EngineUnavailableError, InternalServerError, RequestTimeoutError, SlowReaderError
from stages.ingress.backpressure import StreamBuffer
from stages.ingress.http_errors import to_serve_error
from stages.ingress.lifecycle import Lifecycle, LiveRequest, Outcome
from stages.transport.messages import (
    EngineMoved,
    GenerationJob,
    ResumeStart,
    StreamFrame,
    StreamStart,
    StreamSummary,
)

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


#: Asked at every heartbeat tick: why the request can no longer progress (its engine replica is
#: gone or stuck), or ``None``. A heartbeat alone would keep a dead request's connection open.
LivenessCheck = Callable[[], Awaitable[str | None]]


async def relay(items: Any, keepalive_s: float, deadline: float | None = None, alive: LivenessCheck | None = None
                ) -> AsyncIterator[StreamFrame | StreamSummary | None]:
    """Items after the :class:`StreamStart`, up to and including the :class:`StreamSummary`;
    ``None`` is a heartbeat tick. ``deadline`` is a ``time.perf_counter()`` value. At each tick,
    ``alive`` (when given) may end the stream with :class:`EngineUnavailableError`."""
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
                if alive is not None:
                    problem = await alive()
                    if problem is not None:
                        raise EngineUnavailableError(f"{problem}; the request was aborted. Retry.")
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
    body finished, the client left mid-body, or the client left before the body started.

    :meth:`close_after` ends the response from outside after a grace period, even while a write to
    a client that stopped reading is stuck: the ASGI server then closes the connection."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close
        self._inner: asyncio.Task[None] | None = None
        self._forced = False

    def close_after(self, delay_s: float) -> None:
        """Cancel the response in ``delay_s`` seconds unless it has finished by then."""

        def force() -> None:
            if self._inner is not None and not self._inner.done():
                self._forced = True
                self._inner.cancel()

        asyncio.get_running_loop().call_later(delay_s, force)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            self._inner = asyncio.ensure_future(super().__call__(scope, receive, send))
            try:
                await self._inner
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not self._forced or (task is not None and task.cancelling()):
                    raise
                # Forced: return with the body unfinished; the server closes the connection.
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


def sse_response(gen: Any, job: GenerationJob | ResumeStart, live: LiveRequest, lifecycle: Lifecycle,
                 timings: Callable[[LiveRequest, StreamSummary], dict[str, float]], *, keepalive_s: float,
                 deadline: float | None = None, headers: dict[str, str] | None = None,
                 alive: LivenessCheck | None = None, max_buffer_bytes: int = 1 << 20,
                 slow_reader_grace_s: float = 10.0, after: int = -1) -> ClosingStreamingResponse:
    """The SSE response of a streamed request whose :class:`StreamStart` has been read from ``gen``:
    Egress frames as they come, heartbeats while nothing does, then the closing chunk (usage when
    asked, server timings) and ``[DONE]``; an error after the 200 is an in-band error event, then
    ``[DONE]``. However it ends, ``lifecycle.close`` runs exactly once and an unfinished Egress
    call is cancelled (which aborts the request in the engine), unless the request is resumable
    (``live.resumable``) and its client left: then it is detached, kept for a reconnect.

    Every event has an ``id``: Egress numbers the frames, the closing chunk and ``[DONE]`` follow
    on. A reconnect (``after``: the last id its client received; ``job`` is then the
    :class:`ResumeStart`) sends only the events after it.

    A reader task takes the Egress stream into a :class:`StreamBuffer`; the body writes from it.
    When more than ``max_buffer_bytes`` wait for a client that stopped reading, the request is
    aborted with :class:`SlowReaderError` (the backlog is replaced by that error event and
    ``[DONE]``), and the connection is closed if they are still unsent ``slow_reader_grace_s`` later.
    """
    buffer = StreamBuffer(max_buffer_bytes)

    def emit(data: str) -> None:
        if not buffer.put(data.encode()):
            raise SlowReaderError(buffer.size, max_buffer_bytes)

    async def read() -> None:
        events = after + 1  # the next event's id: Egress numbers frames from 0, the closing events follow
        try:
            async with contextlib.aclosing(relay(gen, keepalive_s, deadline, alive)) as items:
                async for item in items:
                    if item is None:
                        emit(SSE_KEEPALIVE)
                    elif isinstance(item, EngineMoved):
                        lifecycle.moved(live, item)
                    elif isinstance(item, StreamFrame):
                        events = item.event_id + 1 if item.event_id >= 0 else events + 1
                        live.mark_tokens(item.num_tokens)
                        emit(item.data)
                    else:
                        # The closing chunk carries first_flush: let the writer send what is queued.
                        await buffer.wait_sent(slow_reader_grace_s)
                        parts = timings(live, item)
                        usage_body = (usage(item.prompt_tokens, item.completion_tokens, item.cached_tokens)
                                      if job.include_usage else None)
                        closing = max(events, item.num_events)
                        if closing > after:  # a reconnect after the closing chunk gets only [DONE]
                            emit(sse_event(renderer(job.kind).final_stream_chunk(job.response_id, job.created,
                                                                                 job.model_name, usage_body, parts),
                                           closing))
                        emit(sse_event("[DONE]", closing + 1))
                        buffer.close()
                        lifecycle.close(live, Outcome.CANCELLED if live.cancel_requested else Outcome.OK, item, parts)
                        return
        except asyncio.CancelledError:
            live.outcome = Outcome.CLIENT_GONE
            raise
        except Exception as exc:  # noqa: BLE001 - the status is sent: report in-band, then end
            gen.cancel()  # abort in the engine now, not when the client has taken the error
            err = to_serve_error(exc)
            live.status = err.status_code
            buffer.replace([sse_event(err.to_dict(), events).encode(), sse_event("[DONE]", events + 1).encode()])
            if isinstance(err, SlowReaderError):
                logger.warning("request %s aborted: %s", live.request_id, err.message)
                lifecycle.close(live, Outcome.SLOW_READER)
                response.close_after(slow_reader_grace_s)
            else:
                live.outcome = Outcome.TIMEOUT if isinstance(err, RequestTimeoutError) else Outcome.ERROR
        finally:
            buffer.close()

    async def body() -> AsyncIterator[bytes]:
        reader = asyncio.ensure_future(read())
        try:
            while (chunk := await buffer.get()) is not None:
                first_frame_queued = live.first_frame_at is not None
                yield chunk
                if first_frame_queued:
                    live.mark_flushed()  # resumed: Starlette's send of the first token's frame returned
                buffer.mark_sent()
            if live.resumable:
                gen.release()  # all of it was handed to the connection: nothing left to resume
        except (asyncio.CancelledError, GeneratorExit):
            live.outcome = Outcome.CLIENT_GONE if live.outcome == Outcome.OK else live.outcome
            raise
        finally:
            if not reader.done():
                reader.cancel()
            await asyncio.wait([reader])  # its own errors are handled inside; this never raises them

    def on_close() -> None:
        if live.closed:
            return
        if live.resumable and live.outcome in (Outcome.OK, Outcome.CLIENT_GONE):
            live.span.add_event("client_disconnected", {"lifecycle.resumable": True})
            gen.detach()  # Egress keeps it running and its events for a reconnect
            lifecycle.close(live, Outcome.DETACHED)
            return
        gen.cancel()  # Ray Serve carries this to Egress and on to the engine: abort
        lifecycle.close(live, Outcome.CLIENT_GONE if live.outcome == Outcome.OK else None)

    response = ClosingStreamingResponse(body(), on_close, media_type="text/event-stream",
                                        headers={**SSE_HEADERS, **(headers or {})})
    return response
