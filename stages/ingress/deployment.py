"""Ingress stage: the OpenAI-compatible HTTP API (Starlette inside a Ray Serve deployment).

Routes are thin: parse and validate, open the request's life (:mod:`.lifecycle`: minted id, trace,
registry), prepare the request (here when short and plain, else through Preprocess: :mod:`.prep`),
hand the job to Egress (:mod:`stages.transport.consumer`), answer with JSON or relay SSE
(:mod:`.sse`). Every exception becomes HTTP in :mod:`.http_errors`, and every request, whatever
its outcome, ends in :meth:`Lifecycle.close`, which writes its one log line.

Cancellation: when the client disconnects, Starlette cancels the response, and the job ends in
Egress (an abort by id to the Egress replica running it), whose ``finally`` aborts the request by
id in the engine replica that owns it. ``POST /v1/requests/{id}/cancel`` ends a request (on any
Ingress replica) through an abort routed to its engine replica instead, so the client still
receives what was generated, ``finish_reason: "abort"`` and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from importlib.metadata import version as package_version
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode
from ray import serve
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from stages.api.fields import preprocess_fields, tool_parsing
from stages.api.openapi import build_openapi
from stages.api.render import CHAT, COMPLETION, TIMING_FIELD, renderer, server_timing_header
from stages.api.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    to_sampling_params,
)
from stages.config import AppConfig
from stages.directory.client import directory_client
from stages.errors import (
    EgressLostError,
    EngineUnavailableError,
    InvalidRequestError,
    MethodNotAllowedError,
    ModelNotFoundError,
    NotFoundError,
    PayloadTooLargeError,
    RequestTimeoutError,
)
from stages.heap import start_trimmer
from stages.ingress.auth import ApiKeys, AuthMiddleware, request_key_id
from stages.ingress.egress_moves import EgressMoves
from stages.ingress.http_errors import error_response, to_serve_error
from stages.ingress.lifecycle import Lifecycle, LiveRequest, Outcome
from stages.ingress.prep import Prep
from stages.ingress.resume import RESUMABLE_HEADER, find_kept, last_event_id, resume_grace
from stages.ingress.sse import relay, sse_response
from stages.ingress.tokens import TokenRoutes
from stages.ingress.views import (
    PROBE_TIMEOUT_S,
    EngineLiveness,
    health_problems,
    metrics_page,
    report_metrics_forever,
)
from stages.metrics import IngressMetrics, RequestRecord
from stages.model_info import EMBEDDED_MODEL, EMBEDDED_SERVED_NAME
from stages.telemetry import configure_logging, configure_tracing, extract, get_tracer, inject
from stages.transport.consumer import Consumer
from stages.transport.liveness import own_actor_name, own_replica_id
from stages.transport.membership import routed_replicas
from stages.transport.messages import (
    AbortRequest,
    EngineMoved,
    GenerationJob,
    PreprocessRequest,
    ResumeStart,
    ResumeTerms,
    StreamStart,
    StreamSummary,
)

logger = logging.getLogger("lifecycle.ingress")
#: One JSON line per finished request (stderr with the rest; optionally also a file).
request_log = logging.getLogger("lifecycle.requests")

#: The package's own version (``pyproject.toml``), as installed; ``/version`` and the OpenAPI spec show it.
VERSION = package_version("lifecycle-serve")
#: Response header carrying the server-minted request id (the response ``id`` holds it too).
SERVER_ID_HEADER = "X-Server-Request-Id"
MAX_REQUEST_ID_LEN = 128
#: Seconds a reconnect waits for the Egress replica keeping its stream to hand it over.
RESUME_TIMEOUT_S = 10.0


def validate_request_id(value: str | None) -> str | None:
    """A client-supplied ``X-Request-Id``: printable ASCII, 1..128 characters."""
    if value is None:
        return None
    if not value or len(value) > MAX_REQUEST_ID_LEN or not (value.isascii() and value.isprintable()):
        raise InvalidRequestError(
            f"X-Request-Id must be 1..{MAX_REQUEST_ID_LEN} printable ASCII characters", param="X-Request-Id")
    return value


def _egress_lost(replica: str) -> BaseException:
    return EgressLostError(f"The Egress replica {replica} was lost before the request finished. Retry.")


def _ms(seconds: float | None) -> float:
    return round((seconds or 0.0) * 1000.0, 3)


@serve.deployment(name="Ingress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.25},
                  graceful_shutdown_timeout_s=10)
@serve.ingress()
class Ingress:
    """HTTP front door. Handles to the other stages are created once and reused."""

    async def __init__(self, preprocess: Any, egress: Any, engine: Any, app_config: AppConfig,
                       directory: Any = None) -> None:
        """``app_config``: the whole validated config (the Ingress answers for the app: model names,
        limits, keys, inline preparation)."""
        start_trimmer()
        directory = directory_client(directory)
        self.cfg = app_config
        configure_logging()
        if self.cfg.http.request_log_file:
            handler = logging.FileHandler(self.cfg.http.request_log_file)
            handler.setFormatter(logging.Formatter("%(message)s"))  # pure JSON lines
            request_log.addHandler(handler)
        configure_tracing(self.cfg.tracing, component="ingress")
        self.api_keys = ApiKeys.from_config(self.cfg.http)
        if self.api_keys is not None:
            logger.info("API keys on: %d key(s); no key needed for %s", len(self.api_keys),
                        sorted(self.api_keys.exempt_paths) or "nothing")
        self.served_name = self.cfg.served_model_name or (
            EMBEDDED_SERVED_NAME if self.cfg.model == EMBEDDED_MODEL else self.cfg.model.rstrip("/").split("/")[-1])
        self.metrics = IngressMetrics(self.served_name)
        self.preprocess = preprocess
        # Small plain requests are templated and tokenised here, the rest in the Preprocess stage.
        self.prep = Prep(preprocess, self.cfg.model, self.cfg.engine.max_model_len, directory,
                         self.cfg.preprocess.inline_max_chars, self.metrics.observe_prep)
        self.token_routes = TokenRoutes(preprocess.options(stream=True), self._read_body, self._check_model)
        self.egress = egress
        self.engine = engine
        self.directory = directory
        self.created = int(time.time())
        self.replica = own_replica_id()
        # Jobs reach Egress batched per loop turn, their frames come back on shared channels.
        self.to_egress = Consumer(egress, own_actor_name(), _egress_lost)
        self.engine_liveness = EngineLiveness(directory)
        self.lifecycle = Lifecycle(self.replica, directory=directory, abort=self._abort, on_close=self._on_close,
                                   end_kept=self.to_egress.abort)
        self._background = []
        if directory is not None:
            self._background = [asyncio.create_task(self.lifecycle.watch_forever()),
                                asyncio.create_task(report_metrics_forever(directory, self.replica,
                                                                           self.metrics.exposition))]

    def __serve_build_asgi_app__(self) -> Starlette:
        routes = [
            Route(CHAT.path, self.chat_completions, methods=["POST"]),
            Route(COMPLETION.path, self.completions, methods=["POST"]),
            Route("/v1/requests/{request_id}/cancel", self.cancel, methods=["POST"]),
            Route("/v1/requests/{request_id}/events", self.resume_events, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/tokenize", self.token_routes.tokenize, methods=["POST"]),
            Route("/detokenize", self.token_routes.detokenize, methods=["POST"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
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

        middleware = [Middleware(AuthMiddleware, keys=self.api_keys)] if self.api_keys is not None else []
        return Starlette(routes=routes, middleware=middleware,
                         exception_handlers={HTTPException: http_error, Exception: any_error})

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

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_name:
            raise ModelNotFoundError(model)

    def _deadline(self, live: LiveRequest) -> float | None:
        timeout = self.cfg.http.request_timeout_s
        return live.t0 + timeout if timeout else None

    async def _abort(self, request: AbortRequest) -> None:
        await self.engine.abort.remote(request)

    # -- generation -----------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest)

    async def _generate(self, request: Request, cls: type[ChatCompletionRequest | CompletionRequest]) -> Response:
        """The one path of both generation APIs; the route's request model decides which API it is
        (its ``kind``), and from there only the renderer tells them apart."""
        t_arrival = time.perf_counter()
        api = renderer(cls.kind)
        span = get_tracer().start_span(f"POST {api.path}", context=extract(request.headers), kind=SpanKind.SERVER)
        label = request.headers.get("x-request-id")
        live = self.lifecycle.open(api.kind, span, t0=t_arrival, api_key_id=request_key_id(request),
                                   client_request_id=label if label and len(label) <= MAX_REQUEST_ID_LEN else None)
        span.set_attribute("lifecycle.request_id", live.request_id)
        gen: Any = None
        try:
            validate_request_id(label)
            if label is not None:
                span.set_attribute("lifecycle.client_request_id", label)
            req = parse_request(cls, await self._read_body(request))
            self._check_model(req.model)
            max_tokens = req.max_tokens_rule(self.cfg.http.max_tokens_limit)
            max_tokens.check()  # before any templating: the part of the rule that needs no prompt
            span.set_attributes({"gen_ai.request.model": req.model,
                                 "gen_ai.operation.name": api.operation,
                                 "gen_ai.request.max_tokens": req.requested_max_tokens or 0,
                                 "http.request.method": "POST", "lifecycle.stream": req.stream})
            pre = PreprocessRequest(
                request_id=live.request_id,
                sampling_params=to_sampling_params(req),
                max_tokens=max_tokens,
                trace_context=inject(span),
                n=req.n,
                **req.prompt_input(),  # messages (chat) or prompt (text)
                **preprocess_fields(req),  # structured outputs, tools, bad_words
            )
            grace = resume_grace(request.headers.get(RESUMABLE_HEADER), self.cfg.http.resume_grace_s)
            live.resumable = bool(grace) and req.stream
            engine_request = await self.prep.process(pre)
            live.prep = time.perf_counter() - t_arrival
            self.metrics.observe_grammar(engine_request.upstream_timings)
            live.prompt_text = engine_request.prompt_text
            job = GenerationJob(engine_request=engine_request, kind=api.kind, model_name=self.served_name,
                                response_id=live.response_id, created=int(time.time()), n=req.n,
                                stream=req.stream, include_usage=req.include_usage,
                                echo=req.echo, consumer=self.to_egress.name,
                                tool_parsing=tool_parsing(req),
                                resume=ResumeTerms(grace, self.cfg.http.resume_max_bytes, live.client_request_id,
                                                   live.api_key_id) if live.resumable else None)
            # Wait for the engine to accept, so a full queue or a rejected request still gets its
            # HTTP status; after this the answer is a 200.
            live.dispatched_at = time.perf_counter()
            deadline = self._deadline(live)
            call = self.to_egress.open_frames(job)
            start = await call.start(deadline - time.perf_counter() if deadline else None)
            gen = EgressMoves(self.to_egress, call, job, start, max_moves=self.cfg.engine.max_migrations,
                              replicas=self._egress_replicas,
                              on_move=lambda moves, moved: self._egress_moved(live, moves, moved))
            self.lifecycle.started(live, start)
            if req.stream:
                return self._stream(gen, job, live)
            return await self._complete(gen, job, live)
        except BaseException as exc:
            if gen is not None:  # started: ending it is cancelling it (before that, start() undid it)
                gen.cancel()
            if isinstance(exc, asyncio.CancelledError):
                self.lifecycle.close(live, Outcome.CLIENT_GONE)
                raise
            err = to_serve_error(RequestTimeoutError() if isinstance(exc, TimeoutError) else exc)
            live.status = err.status_code
            self.lifecycle.close(live, Outcome.TIMEOUT if isinstance(err, RequestTimeoutError) else Outcome.ERROR)
            return error_response(err, headers=self._id_headers(live))

    def _egress_replicas(self) -> list[str]:
        return routed_replicas(self.egress.app_name, self.egress.deployment_name)

    def _egress_moved(self, live: LiveRequest, moves: int, start: StreamStart) -> None:
        """The request's Egress replica was lost and another took it over
        (:mod:`stages.ingress.egress_moves`): its kept events died with the first, so it is no
        longer resumable."""
        live.resumable = False
        live.span.add_event("egress_moved", {"lifecycle.egress_replica": start.egress_replica,
                                             "lifecycle.egress_moves": moves})
        self.metrics.observe_egress_move()
        logger.info("request %s moved to Egress replica %s (move %d)", live.request_id, start.egress_replica,
                    moves)

    def _id_headers(self, live: LiveRequest) -> dict[str, str]:
        return {SERVER_ID_HEADER: live.request_id}

    async def _complete(self, gen: Any, job: GenerationJob, live: LiveRequest) -> Response:
        summary: StreamSummary | None = None
        async for item in relay(gen, keepalive_s=3600.0, deadline=self._deadline(live)):
            if isinstance(item, StreamSummary):
                summary = item
            elif isinstance(item, EngineMoved):
                self.lifecycle.moved(live, item)
        assert summary is not None and summary.body is not None
        timings = self._timings(live, summary)
        body = summary.body
        body[TIMING_FIELD] = timings
        self.lifecycle.close(live, Outcome.CANCELLED if live.cancel_requested else Outcome.OK, summary, timings)
        headers = {**self._id_headers(live), "Server-Timing": server_timing_header(timings)}
        return JSONResponse(body, headers=headers)

    def _stream(self, gen: Any, job: GenerationJob | ResumeStart, live: LiveRequest, after: int = -1) -> Response:
        http = self.cfg.http
        return sse_response(gen, job, live, self.lifecycle, self._timings,
                            keepalive_s=http.keepalive_interval_s, deadline=self._deadline(live),
                            headers=self._id_headers(live),
                            alive=lambda: self.engine_liveness.problem(live.engine_replica),
                            max_buffer_bytes=http.max_stream_buffer_bytes,
                            slow_reader_grace_s=http.slow_reader_grace_s, after=after)

    # -- reconnecting to a resumable stream -----------------------------------------------------------
    async def resume_events(self, request: Request) -> Response:
        """``GET /v1/requests/{id}/events``: the events of a detached resumable stream after the
        client's ``Last-Event-ID`` (or ``?starting_after=``), then the live ones, on any Ingress
        replica (see :mod:`stages.ingress.resume`). 404 when nothing is kept under the id, 409
        while a connection is attached."""
        t0 = time.perf_counter()
        key = request.path_params["request_id"]
        try:
            after = last_event_id(request.headers, request.query_params)
            entry = await find_kept(self.directory, key, request_key_id(request))
            call = self.to_egress.open_resume(entry.owner, entry.request_id, after)
            start = await call.start(RESUME_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - rendered in the one place
            return error_response(exc)
        span = get_tracer().start_span("GET /v1/requests/{id}/events", context=extract(start.trace_context),
                                       kind=SpanKind.SERVER)
        span.set_attributes({"lifecycle.request_id": entry.request_id, "lifecycle.stream": True})
        span.add_event("reconnect", {"lifecycle.last_event_id": after, "lifecycle.replayed_events": start.replayed,
                                     "lifecycle.reconnects": start.reconnects})
        live = self.lifecycle.open(start.kind, span, t0=t0, request_id=entry.request_id,
                                   client_request_id=entry.client_request_id, api_key_id=entry.api_key_id)
        live.resumable, live.reconnects = not start.dropped, start.reconnects
        self.lifecycle.started(live, start.start)
        return self._stream(call, start, live, after)

    # -- accounting (once per request, from Lifecycle.close) -----------------------------------------
    def _timings(self, live: LiveRequest, summary: StreamSummary) -> dict[str, float]:
        eng = summary.engine_timings
        parts = live.ttft_parts(eng)
        out = {"prep": _ms(parts["prep"])}
        if "hops" in parts:
            out["hops"] = _ms(parts["hops"])
        out.update(queue=_ms(eng.get("queue")), prefill=_ms(eng.get("prefill")))
        if "first_flush" in parts:
            out["first_flush"] = _ms(parts["first_flush"])
        if live.ttft is not None and live.first_flush is not None:
            out["ttft"] = _ms(live.ttft + live.first_flush)
        out.update(decode=_ms(eng.get("decode")), egress=_ms(summary.egress_busy), total=_ms(live.elapsed()))
        return out

    def _on_close(self, live: LiveRequest, summary: StreamSummary | None, timings: dict[str, float] | None) -> None:
        span = live.span
        if live.outcome == Outcome.SLOW_READER:
            self.metrics.observe_slow_reader()
        if summary is not None:
            if span.is_recording():
                span.set_attributes({"gen_ai.usage.input_tokens": summary.prompt_tokens,
                                     "gen_ai.usage.output_tokens": summary.completion_tokens,
                                     "gen_ai.response.finish_reasons": summary.finish_reasons,
                                     "lifecycle.cached_tokens": summary.cached_tokens,
                                     "http.response.status_code": 200})
                if summary.route is not None:
                    span.set_attributes({f"lifecycle.route.{k}": v for k, v in summary.route.attributes().items()})
            self.metrics.observe_request(RequestRecord(
                kind=live.kind, prompt_tokens=summary.prompt_tokens, completion_tokens=summary.completion_tokens,
                finish_reasons=summary.finish_reasons, timings_ms=timings or {}, ttft_s=live.ttft,
                itls_s=live.itls, stream=bool(summary.body is None), cached_tokens=summary.cached_tokens,
                expected_cached_tokens=summary.route.expected_cached_tokens if summary.route else None))
        elif live.status != 200:
            self.metrics.observe_error(live.status)
            if span.is_recording():
                span.set_attribute("http.response.status_code", live.status)
                if live.status >= 500:
                    span.set_status(Status(StatusCode.ERROR, live.outcome))
        elif live.outcome == Outcome.DETACHED:
            pass  # not an abort: it runs on in Egress for a reconnect (Egress counts expiries)
        else:
            self.metrics.observe_abort(live.outcome)
            span.add_event("abort", {"reason": live.outcome})
            span.set_status(Status(StatusCode.ERROR, live.outcome))
        span.end()
        self._log(live, summary, timings)

    def _log(self, live: LiveRequest, summary: StreamSummary | None, timings: dict[str, float] | None) -> None:
        """One structured line per request, for every outcome; the prompt only when enabled."""
        ctx = live.span.get_span_context()
        record: dict[str, Any] = {
            "event": "request_finished", "request_id": live.request_id, "x_request_id": live.client_request_id,
            "trace_id": format(ctx.trace_id, "032x") if ctx.is_valid else None,
            "kind": live.kind, "outcome": live.outcome, "status": live.status, "api_key_id": live.api_key_id,
            "timings_ms": timings or {"total": _ms(live.elapsed())},
        }
        if live.resumable or live.reconnects:
            record["reconnects"] = live.reconnects
        if summary is not None:
            record.update(prompt_tokens=summary.prompt_tokens, completion_tokens=summary.completion_tokens,
                          cached_tokens=summary.cached_tokens, finish_reasons=summary.finish_reasons)
            if summary.route is not None:
                record["route"] = summary.route.attributes()
        if self.cfg.http.log_prompts and live.prompt_text is not None:
            record["prompt"] = live.prompt_text[: self.cfg.http.max_log_len]
        request_log.info(json.dumps(record, separators=(",", ":"), ensure_ascii=False))

    # -- cancel by id ---------------------------------------------------------------------------------
    async def cancel(self, request: Request) -> Response:
        """``POST /v1/requests/{id}/cancel``: a response id (or server id) cancels that request; a
        client ``X-Request-Id`` cancels every live request carrying it, on any replica."""
        key = request.path_params["request_id"]
        try:
            # With keys on, only the key that created a request can cancel it (others get 404).
            entries = await self.lifecycle.cancel(key, request_key_id(request))
        except Exception as exc:  # noqa: BLE001 - rendered in the one place
            return error_response(exc)
        if not entries:
            return error_response(NotFoundError(f"No live request has the id {key!r}.", param="request_id",
                                                code="request_not_found"))
        return JSONResponse({"object": "cancellation", "id": key, "cancelled": [
            {"id": e.response_id, "x_request_id": e.client_request_id} for e in entries]})

    # -- whole-app views --------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """200 only when every stage has a live replica and every engine's step loop is making
        progress (each engine reports to the directory; a silent one has died)."""
        problems = await health_problems(self.preprocess, self.egress, self.engine, self.directory)
        if problems:
            return error_response(EngineUnavailableError("; ".join(problems)))
        return JSONResponse({"status": "ok", "replica": self.replica})

    async def metrics_endpoint(self, request: Request) -> Response:
        body, content_type = await metrics_page(self.directory, self.replica, self.metrics.exposition,
                                                self.served_name)
        return PlainTextResponse(body, media_type=content_type)

    # -- other routes ---------------------------------------------------------------------------------
    async def _max_model_len(self) -> int | None:
        try:
            if self.directory is not None:
                return await asyncio.wait_for(self.directory.max_model_len(), PROBE_TIMEOUT_S)
            info = await asyncio.wait_for(self.engine.info.remote(), PROBE_TIMEOUT_S)
            return int(info["max_model_len"])
        except Exception:  # noqa: BLE001 - model listing must not fail because a stage is busy
            return None

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.served_name, "object": "model", "created": self.created, "owned_by": "lifecycle-serve",
             "root": self.cfg.model, "max_model_len": await self._max_model_len()}]})

    async def openapi(self, request: Request) -> Response:
        """``GET /openapi.json``: the public API, with this deployment's limits as bounds."""
        limit = self.cfg.http.max_tokens_limit
        if not limit:
            context = await self._max_model_len()
            limit = context - 1 if context else 0
        keys = self.api_keys
        return JSONResponse(build_openapi(version=VERSION, model=self.served_name, max_tokens=limit or None,
                                          max_body_bytes=self.cfg.http.max_body_bytes, auth=keys is not None,
                                          auth_exempt_paths=keys.exempt_paths if keys else frozenset()))

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VERSION})
