"""Ingress stage: the OpenAI-compatible HTTP API (Starlette inside a Ray Serve deployment).

Parses and validates requests, assigns the request id, starts the request's trace, calls
Preprocess (unary) then Egress (streaming or unary), writes SSE with heartbeats, and notices when
the client leaves. This module is the only place where errors become HTTP responses.

Cancellation: when the client disconnects, Starlette cancels the response task; the ``finally``
of the SSE generator (or the cancelled ``await`` of a unary call) cancels the Egress call, Ray
Serve carries the cancellation to Egress and from there to the engine stream, whose ``finally``
aborts the request by id in the engine replica that owns it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode
from ray import serve
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from stages.config import AppConfig
from stages.errors import (
    EngineUnavailableError,
    InternalServerError,
    InvalidRequestError,
    MethodNotAllowedError,
    ModelNotFoundError,
    NotFoundError,
    PayloadTooLargeError,
    RequestTimeoutError,
    ServeError,
)
from stages.metrics import IngressMetrics, RequestRecord
from stages.model_info import EMBEDDED_MODEL, EMBEDDED_SERVED_NAME
from stages.openai_format import (
    SSE_HEADERS,
    SSE_KEEPALIVE,
    TIMING_FIELD,
    final_stream_chunk,
    server_timing_header,
    sse_event,
    usage,
)
from stages.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    messages_to_dicts,
    parse_request,
    to_sampling_params,
)
from stages.protocol import EngineRequest, GenerationJob, PreprocessRequest
from stages.telemetry import configure_logging, configure_tracing, extract, get_tracer, inject

logger = logging.getLogger("lifecycle.ingress")
#: One JSON line per finished request (stderr with the rest; optionally also a file).
request_log = logging.getLogger("lifecycle.requests")

VERSION = "0.1.0"
#: Response header with the engine-side request id when it differs from ``X-Request-Id``.
ENGINE_ID_HEADER = "X-Engine-Request-Id"
MAX_REQUEST_ID_LEN = 128


def unwrap_error(exc: BaseException) -> BaseException:
    """The original exception behind a Ray task error (Ray wraps what a deployment raised)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def error_response(exc: BaseException) -> JSONResponse:
    """The one place an exception becomes an HTTP response (OpenAI error shape)."""
    exc = unwrap_error(exc)
    if not isinstance(exc, ServeError):
        logger.exception("unhandled error", exc_info=exc)
        exc = InternalServerError(f"Internal server error: {type(exc).__name__}")
    return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=exc.headers)


def validate_request_id(value: str | None) -> str | None:
    """A client-supplied ``X-Request-Id``: printable ASCII, 1..128 characters."""
    if value is None:
        return None
    if not value or len(value) > MAX_REQUEST_ID_LEN or not (value.isascii() and value.isprintable()):
        raise InvalidRequestError(
            f"X-Request-Id must be 1..{MAX_REQUEST_ID_LEN} printable ASCII characters", param="X-Request-Id")
    return value


def _ms(seconds: float | None) -> float:
    return round((seconds or 0.0) * 1000.0, 3)


class _Live:
    """Per-request state owned by Ingress: ids, clocks, span, log fields."""

    def __init__(self, request_id: str, kind: str, span: Any, incoming_id: str | None = None) -> None:
        self.request_id = request_id
        self.incoming_id = incoming_id
        self.kind = kind
        self.span = span
        self.t0 = time.perf_counter()
        self.prep = 0.0
        self.ttft: float | None = None
        self.last_token_at: float | None = None
        self.itls: list[float] = []
        self.outcome = "ok"

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def id_header(self) -> dict[str, str]:
        """Ray Serve's proxy always echoes the incoming (or its own minted) ``X-Request-Id``, so a
        second value there would conflict. When a live duplicate made us suffix the id, the id the
        engine, logs and trace use goes in ``X-Engine-Request-Id`` (and in the response ``id``)."""
        return {} if self.request_id == self.incoming_id else {ENGINE_ID_HEADER: self.request_id}


@serve.deployment(name="Ingress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.25},
                  graceful_shutdown_timeout_s=10)
@serve.ingress()
class Ingress:
    """HTTP front door. Handles to the other stages are created once and reused."""

    def __init__(self, preprocess: Any, egress: Any, engine: Any, app_config: dict[str, Any]) -> None:
        self.cfg = AppConfig.from_args(app_config)
        configure_logging()
        if self.cfg.http.request_log_file:
            handler = logging.FileHandler(self.cfg.http.request_log_file)
            handler.setFormatter(logging.Formatter("%(message)s"))  # pure JSON lines
            request_log.addHandler(handler)
        configure_tracing(self.cfg.tracing, component="ingress")
        self.preprocess = preprocess
        self.egress = egress
        self.engine = engine
        self.served_name = self.cfg.served_model_name or (
            EMBEDDED_SERVED_NAME if self.cfg.model == EMBEDDED_MODEL else self.cfg.model.rstrip("/").split("/")[-1])
        self.live_ids: set[str] = set()
        self.metrics = IngressMetrics(self.served_name)
        self.created = int(time.time())

    def __serve_build_asgi_app__(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
        ]

        async def http_error(_: Request, exc: Exception) -> Response:
            assert isinstance(exc, HTTPException)
            if exc.status_code == 404:
                return error_response(NotFoundError("Not found."))
            if exc.status_code == 405:
                return error_response(MethodNotAllowedError("Method not allowed."))
            return error_response(InvalidRequestError(str(exc.detail)))

        async def any_error(_: Request, exc: Exception) -> Response:
            return error_response(exc)

        return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: any_error})

    # -- helpers --------------------------------------------------------------------------------------
    async def _read_body(self, request: Request) -> bytes:
        limit = self.cfg.http.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(f"Request body is {declared} bytes; the limit is {limit}.")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(f"Request body exceeds the limit of {limit} bytes.")
            chunks.append(chunk)
        return b"".join(chunks)

    def _request_id(self, request: Request) -> str:
        rid = validate_request_id(request.headers.get("x-request-id")) or uuid.uuid4().hex
        base, i = rid, 1
        while rid in self.live_ids:  # keep engine ids unique while a client reuses one
            rid, i = f"{base}-{i}", i + 1
        return rid

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_name:
            raise ModelNotFoundError(model)

    # -- generation -----------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def _generate(self, request: Request, kind: str) -> Response:
        t_arrival = time.perf_counter()
        parent = extract(request.headers)
        span = get_tracer().start_span(
            "POST /v1/chat/completions" if kind == "chat" else "POST /v1/completions",
            context=parent, kind=SpanKind.SERVER)
        live: _Live | None = None
        try:
            body = await self._read_body(request)
            cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
            req = parse_request(cls, body)
            self._check_model(req.model)
            rid = self._request_id(request)
            live = _Live(rid, kind, span, request.headers.get("x-request-id"))
            live.t0 = t_arrival
            self.live_ids.add(rid)
            span.set_attributes({"lifecycle.request_id": rid, "gen_ai.request.model": req.model,
                                 "gen_ai.operation.name": "chat" if kind == "chat" else "text_completion",
                                 "gen_ai.request.max_tokens": req.requested_max_tokens or 0,
                                 "http.request.method": "POST", "lifecycle.stream": req.stream})
            carrier = inject(span)
            pre = PreprocessRequest(
                request_id=rid,
                sampling_params=to_sampling_params(req, default_max_tokens=1),
                requested_max_tokens=req.requested_max_tokens,
                messages=messages_to_dicts(req) if kind == "chat" else None,
                prompt=None if kind == "chat" else req.prompt,
                trace_context=carrier,
            )
            engine_request: EngineRequest = await self.preprocess.process.remote(pre)
            live.prep = time.perf_counter() - t_arrival
            job = GenerationJob(engine_request=engine_request, kind=kind, model_name=self.served_name,
                                response_id=("chatcmpl-" if kind == "chat" else "cmpl-") + rid,
                                created=int(time.time()), n=req.n, stream=req.stream,
                                include_usage=req.include_usage, echo=getattr(req, "echo", False))
            if req.stream:
                return await self._stream(job, live)
            return await self._complete(job, live)
        except BaseException as exc:
            if live is not None:
                self.live_ids.discard(live.request_id)
                live.outcome = "cancelled" if isinstance(exc, asyncio.CancelledError) else "error"
            self._end_span(span, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            response = error_response(exc)
            self.metrics.observe_error(response.status_code)
            if live is not None:
                response.headers.update(live.id_header())
            return response

    async def _complete(self, job: GenerationJob, live: _Live) -> Response:
        timeout = self.cfg.http.request_timeout_s or None
        try:
            body, summary = await asyncio.wait_for(self.egress.complete.remote(job), timeout)
        except TimeoutError:
            live.outcome = "timeout"
            raise RequestTimeoutError() from None
        finally:
            self.live_ids.discard(live.request_id)
        timings = self._timings(live, summary)
        body[TIMING_FIELD] = timings
        self._finish(live, job, summary, timings)
        headers = {**live.id_header(), "Server-Timing": server_timing_header(timings)}
        return JSONResponse(body, headers=headers)

    async def _stream(self, job: GenerationJob, live: _Live) -> Response:
        gen = self.egress.options(stream=True).stream.remote(job)
        # Wait for the engine to accept the request so queue-full and validation errors still get
        # their HTTP status; the first item is the role chunk, sent as soon as the engine admits.
        try:
            first = await self._next(gen)
        except BaseException:
            gen.cancel()
            raise
        if first is None:
            raise InternalServerError("egress ended without output")
        headers = {**SSE_HEADERS, **live.id_header()}
        return StreamingResponse(self._sse(gen, first, job, live), media_type="text/event-stream", headers=headers)

    @staticmethod
    async def _next(gen: Any) -> Any:
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            return None

    async def _sse(self, gen: Any, first: Any, job: GenerationJob, live: _Live) -> AsyncIterator[str]:
        """Frames from Egress, a heartbeat comment while nothing comes, then timings and [DONE]."""
        interval = self.cfg.http.keepalive_interval_s
        deadline = live.t0 + self.cfg.http.request_timeout_s if self.cfg.http.request_timeout_s else None
        pending: asyncio.Task[Any] | None = None
        finished = False
        item: Any = first
        events = 0  # Egress numbers its events from 0; the closing events continue the count
        try:
            while True:
                if isinstance(item, tuple):
                    frame, num_tokens = item
                    events += 1
                    if num_tokens:
                        self._mark_tokens(live, num_tokens)
                    yield frame
                elif item is not None:  # the Summary: the stream is complete
                    timings = self._timings(live, item)
                    usage_body = (usage(item.prompt_tokens, item.completion_tokens, item.cached_tokens)
                                  if job.include_usage else None)
                    yield sse_event(final_stream_chunk(job.kind, job.response_id, job.created, job.model_name,
                                                       usage_body, timings), events)
                    yield sse_event("[DONE]", events + 1)
                    finished = True
                    self._finish(live, job, item, timings)
                    return
                pending = asyncio.ensure_future(self._next(gen))
                while True:
                    wait = interval
                    if deadline is not None:
                        wait = min(wait, max(deadline - time.perf_counter(), 0.0))
                    done, _ = await asyncio.wait({pending}, timeout=wait)
                    if done:
                        break
                    if deadline is not None and time.perf_counter() >= deadline:
                        live.outcome = "timeout"
                        err = RequestTimeoutError()
                        yield sse_event(err.to_dict(), events)
                        yield sse_event("[DONE]", events + 1)
                        return
                    yield SSE_KEEPALIVE  # also how a dead client is noticed during long silences
                item = pending.result()
                pending = None
                if item is None:
                    raise InternalServerError("egress stream ended without a summary")
        except BaseException as exc:
            if isinstance(exc, (asyncio.CancelledError, GeneratorExit, ClientDisconnect)):
                live.outcome = "client_gone"
                raise
            live.outcome = "error"
            err = unwrap_error(exc)
            if not isinstance(err, ServeError):
                logger.exception("stream %s failed", live.request_id, exc_info=err)
                err = InternalServerError(f"Internal server error: {type(err).__name__}")
            yield sse_event(err.to_dict(), events)
            yield sse_event("[DONE]", events + 1)
        finally:
            if pending is not None:
                pending.cancel()
            if not finished:
                gen.cancel()  # Ray Serve carries this to Egress and on to the engine: abort
                self.metrics.observe_abort(live.outcome)
                live.span.add_event("abort", {"reason": live.outcome})
                self._end_span(live.span, None)
                self._log(live, None, None, job.engine_request.prompt_text)
            self.live_ids.discard(live.request_id)

    # -- accounting -----------------------------------------------------------------------------------
    def _mark_tokens(self, live: _Live, num_tokens: int) -> None:
        now = time.perf_counter()
        if live.ttft is None:
            live.ttft = now - live.t0
        elif live.last_token_at is not None:
            # Coalesced items carry several tokens: spread the gap over them.
            live.itls.extend([(now - live.last_token_at) / num_tokens] * num_tokens)
        live.last_token_at = now

    def _timings(self, live: _Live, summary: Any) -> dict[str, float]:
        eng = summary.engine_timings
        return {"prep": _ms(live.prep), "queue": _ms(eng.get("queue")), "prefill": _ms(eng.get("prefill")),
                "decode": _ms(eng.get("decode")), "egress": _ms(summary.egress_busy), "total": _ms(live.elapsed())}

    def _finish(self, live: _Live, job: GenerationJob, summary: Any, timings: dict[str, float]) -> None:
        span = live.span
        if span.is_recording():
            span.set_attributes({"gen_ai.usage.input_tokens": summary.prompt_tokens,
                                 "gen_ai.usage.output_tokens": summary.completion_tokens,
                                 "gen_ai.response.finish_reasons": summary.finish_reasons,
                                 "http.response.status_code": 200})
        self._end_span(span, None)
        self.metrics.observe_request(RequestRecord(
            kind=live.kind, prompt_tokens=summary.prompt_tokens, completion_tokens=summary.completion_tokens,
            finish_reasons=summary.finish_reasons, timings_ms=timings, ttft_s=live.ttft, itls_s=live.itls,
            stream=job.stream))
        self._log(live, summary, timings, job.engine_request.prompt_text)

    def _end_span(self, span: Any, exc: BaseException | None) -> None:
        if exc is not None and span.is_recording():
            err = unwrap_error(exc)
            status = getattr(err, "status_code", 500)
            span.set_attribute("http.response.status_code", status)
            if status >= 500 or isinstance(err, asyncio.CancelledError):
                span.set_status(Status(StatusCode.ERROR, type(err).__name__))
        span.end()

    def _log(self, live: _Live, summary: Any, timings: dict[str, float] | None, prompt: str | None) -> None:
        """One structured line per finished request; the prompt only when enabled, cut short."""
        ctx = live.span.get_span_context()
        record: dict[str, Any] = {
            "event": "request_finished", "request_id": live.request_id,
            "trace_id": format(ctx.trace_id, "032x") if ctx.is_valid else None,
            "kind": live.kind, "outcome": live.outcome, "timings_ms": timings or {"total": _ms(live.elapsed())},
        }
        if summary is not None:
            record.update(prompt_tokens=summary.prompt_tokens, completion_tokens=summary.completion_tokens,
                          cached_tokens=summary.cached_tokens, finish_reasons=summary.finish_reasons)
        if self.cfg.http.log_prompts and prompt is not None:
            record["prompt"] = prompt[: self.cfg.http.max_log_len]
        request_log.info(json.dumps(record, separators=(",", ":"), ensure_ascii=False))

    # -- other routes ---------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.served_name, "object": "model", "created": self.created, "owned_by": "lifecycle-serve",
             "root": self.cfg.model, "max_model_len": await self._max_model_len()}]})

    async def _max_model_len(self) -> int | None:
        try:
            info = await asyncio.wait_for(self.engine.info.remote(), 5)
            return int(info["max_model_len"])
        except Exception:  # noqa: BLE001 - model listing must not fail because the engine is busy
            return None

    async def health(self, request: Request) -> Response:
        try:
            info = await asyncio.wait_for(self.engine.info.remote(), 5)
        except Exception as exc:  # noqa: BLE001 - any failure means not healthy
            return error_response(EngineUnavailableError(f"engine not ready: {type(unwrap_error(exc)).__name__}"))
        if not info.get("alive", False):
            return error_response(EngineUnavailableError("engine is not running"))
        return JSONResponse({"status": "ok"})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def tokenize(self, request: Request) -> Response:
        try:
            req = parse_request(TokenizeRequest, await self._read_body(request))
            self._check_model(req.model)
            result = await self.preprocess.tokenize.remote({
                "prompt": req.prompt, "messages": messages_to_dicts(req) if req.messages is not None else None,
                "add_generation_prompt": req.add_generation_prompt, "add_special_tokens": bool(req.add_special_tokens)})
            return JSONResponse(result)
        except Exception as exc:  # noqa: BLE001 - rendered in the one place
            return error_response(exc)

    async def detokenize(self, request: Request) -> Response:
        try:
            req = parse_request(DetokenizeRequest, await self._read_body(request))
            self._check_model(req.model)
            return JSONResponse(await self.preprocess.detokenize.remote(req.tokens))
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)

    async def metrics_endpoint(self, request: Request) -> Response:
        try:
            stats = await asyncio.wait_for(self.engine.stats.remote(), 5)
        except Exception:  # noqa: BLE001 - still serve the ingress metrics
            stats = None
        body, content_type = self.metrics.render(stats)
        return PlainTextResponse(body, media_type=content_type)

