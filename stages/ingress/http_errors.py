"""The one place an exception becomes an HTTP answer (OpenAI error shape).

Stages raise what they mean: :mod:`stages.errors` for API-level problems, :mod:`stages.engine.core.errors`
for engine conditions, Ray's own errors when a replica dies. :func:`to_serve_error` maps each to
its :class:`ServeError` (status, OpenAI ``type``/``code``); :func:`error_response` renders it.
Both an error response and a mid-stream SSE error event use the same mapping.
"""

from __future__ import annotations

import logging

from ray import exceptions as ray_exceptions
from starlette.responses import JSONResponse

from stages.engine.core.errors import (
    DuplicateRequestIdError,
    EngineDeadError,
    EngineOverloadedError,
    PromptTooLongError,
    RequestRejectedError,
    SamplingError,
)
from stages.errors import (
    ContextLengthExceededError,
    EngineUnavailableError,
    InternalServerError,
    InvalidRequestError,
    QueueFullError,
    ServeError,
    unwrap_error,
)

logger = logging.getLogger("lifecycle.ingress")

#: Ray errors that mean a replica (of any stage) died or became unreachable mid-call.
_REPLICA_GONE = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError,
                 ray_exceptions.WorkerCrashedError, ray_exceptions.NodeDiedError)


def to_serve_error(exc: BaseException) -> ServeError:
    """The :class:`ServeError` that answers ``exc``; unexpected ones are logged and become 500s
    whose message names only the exception type (never internals)."""
    if isinstance(exc, _REPLICA_GONE):
        return EngineUnavailableError(f"A server replica became unavailable: {type(exc).__name__}. Retry.")
    err = unwrap_error(exc)
    if isinstance(err, ServeError):
        return err
    if isinstance(err, PromptTooLongError):
        return ContextLengthExceededError(err.prompt_tokens, None, err.max_model_len)
    if isinstance(err, RequestRejectedError):
        return InvalidRequestError(err.message)
    if isinstance(err, EngineOverloadedError):
        return QueueFullError(err.message, retry_after=err.retry_after)
    if isinstance(err, EngineDeadError):
        return EngineUnavailableError(err.message)
    if isinstance(err, SamplingError):
        # The server failed this request's own sampling (logged on the engine with the traceback);
        # the message names the exception, which is about its parameters, not the server's internals.
        return InternalServerError(err.message)
    if isinstance(err, _REPLICA_GONE):
        return EngineUnavailableError(f"A server replica became unavailable: {type(err).__name__}. Retry.")
    if isinstance(err, DuplicateRequestIdError):
        logger.error("engine id collision (a bug: ids are minted unique): %s", err)
    else:
        logger.exception("unhandled error", exc_info=err)
    return InternalServerError(f"Internal server error: {type(err).__name__}")


def error_response(exc: BaseException, headers: dict[str, str] | None = None) -> JSONResponse:
    """The HTTP response for ``exc``."""
    err = to_serve_error(exc)
    return JSONResponse(err.to_dict(), status_code=err.status_code, headers={**err.headers, **(headers or {})})
