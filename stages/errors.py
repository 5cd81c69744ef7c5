"""One exception tree for every error the server can answer with.

Each class carries the HTTP status and the OpenAI error ``type``/``code`` it maps to, so the HTTP
layer renders any :class:`ServeError` the same way::

    return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=exc.headers)

Ray re-raises exceptions in the caller's process by pickling them. The default
``BaseException`` pickling calls ``cls(*self.args)``, which breaks as soon as a subclass has its own
``__init__`` signature (e.g. :class:`ContextLengthExceededError`), so :meth:`ServeError.__reduce__`
rebuilds instances without calling ``__init__`` and restores every field from ``__dict__``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

__all__ = [
    "ServeError",
    "InvalidRequestError",
    "AuthenticationError",
    "ContextLengthExceededError",
    "ModelNotFoundError",
    "NotFoundError",
    "MethodNotAllowedError",
    "PayloadTooLargeError",
    "QueueFullError",
    "EngineUnavailableError",
    "EgressLostError",
    "RequestTimeoutError",
    "InternalServerError",
    "RequestCancelledError",
    "SlowReaderError",
    "ConflictError",
    "EventsDroppedError",
]


def unwrap_error(exc: BaseException) -> BaseException:
    """The original exception behind Ray task errors (Ray wraps what a deployment raised, once per
    hop it crossed: Engine → Egress → Ingress wraps twice)."""
    seen = 0
    while isinstance(getattr(exc, "cause", None), BaseException) and exc.cause is not exc and seen < 16:
        exc, seen = exc.cause, seen + 1
    return exc


def _restore(cls: type[ServeError], args: tuple[Any, ...], state: dict[str, Any]) -> ServeError:
    """Unpickle a :class:`ServeError` without running its (subclass-specific) ``__init__``."""
    exc = cls.__new__(cls, *args)  # BaseException.__new__ sets ``args``
    exc.__dict__.update(state)
    return exc


class ServeError(Exception):
    """Base of all errors that become an HTTP error response.

    ``message`` is shown to the client; ``param`` names the offending request field (dotted path)
    when there is one; ``code`` is OpenAI's machine-readable code; ``headers`` are extra response
    headers (e.g. ``Retry-After``).
    """

    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    #: Used when the constructor gets no ``code``.
    default_code: ClassVar[str | None] = None
    #: Used when the constructor gets no ``message``.
    default_message: ClassVar[str] = "Internal server error."

    def __init__(
        self,
        message: str | None = None,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = message if message is not None else self.default_message
        super().__init__(message)
        self.message: str = message
        self.param: str | None = param
        self.code: str | None = code if code is not None else self.default_code
        self.headers: dict[str, str] = dict(headers or {})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (type(self), self.args, dict(self.__dict__)))


class InvalidRequestError(ServeError):
    """400: the request is malformed or a field is out of range; ``param`` names the field."""

    status_code = 400
    error_type = "invalid_request_error"
    default_message = "Invalid request."


class AuthenticationError(ServeError):
    """401: no API key, or not one of the configured keys (the message never repeats the key)."""

    status_code = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"
    default_message = "Incorrect API key provided."

    def __init__(self, message: str | None = None) -> None:
        # RFC 6750: a 401 names the scheme the client should use.
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class ContextLengthExceededError(InvalidRequestError):
    """400: prompt plus requested completion does not fit in the model's context window."""

    default_code = "context_length_exceeded"

    def __init__(
        self,
        prompt_tokens: int,
        max_tokens: int | None,
        max_model_len: int,
        *,
        param: str | None = "messages",
        at_least: bool = False,
    ) -> None:
        """``at_least``: ``prompt_tokens`` is a floor, counted without encoding the prompt."""
        what = "prompt" if param == "prompt" else "messages"
        if at_least:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"{what} would be at least {prompt_tokens} tokens. Please reduce the length of the {what}."
            )
        elif max_tokens:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {what}, "
                f"{max_tokens} in the completion). Please reduce the length of the {what} or "
                "completion."
            )
        else:
            # No completion budget asked (or resolved): the prompt alone does not fit.
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"{what} resulted in {prompt_tokens} tokens. Please reduce the length of the {what}."
            )
        super().__init__(message, param=param)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class ModelNotFoundError(ServeError):
    """404: the ``model`` field names a model this server does not serve."""

    status_code = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"

    def __init__(self, model: str, message: str | None = None) -> None:
        super().__init__(message or f"The model `{model}` does not exist.", param="model")
        self.model = model


class NotFoundError(ServeError):
    """404: unknown route."""

    status_code = 404
    error_type = "invalid_request_error"
    default_message = "Not found."


class MethodNotAllowedError(ServeError):
    """405: known route, wrong HTTP method."""

    status_code = 405
    error_type = "invalid_request_error"
    default_message = "Method not allowed."


class PayloadTooLargeError(ServeError):
    """413: the request body exceeds the configured size limit."""

    status_code = 413
    error_type = "invalid_request_error"
    default_message = "Request body too large."


class QueueFullError(ServeError):
    """429: admission control rejected the request; the client should retry after a delay.

    OpenAI's own 429 body uses type ``"requests"`` (rate limit on requests per minute) and code
    ``"rate_limit_exceeded"``; the official client retries 429s honouring ``Retry-After``.
    """

    status_code = 429
    error_type = "requests"
    default_code = "rate_limit_exceeded"
    default_message = "The server is overloaded: too many requests in flight. Please retry later."

    def __init__(self, message: str | None = None, *, retry_after: float = 1.0) -> None:
        # Retry-After takes whole seconds (RFC 9110); round up so clients never retry too early.
        seconds = max(0, math.ceil(retry_after))
        super().__init__(message, headers={"Retry-After": str(seconds)})
        self.retry_after = seconds


class EngineUnavailableError(ServeError):
    """503: the engine is not ready yet, or has died."""

    status_code = 503
    error_type = "service_unavailable"
    default_message = "The inference engine is not available."


class EgressLostError(EngineUnavailableError):
    """503: the Egress replica running a request was lost before the request finished (an Ingress
    moves the stream to another one where it can: :mod:`stages.ingress.egress_moves`)."""


class RequestTimeoutError(ServeError):
    """504: the request ran past the configured ``request_timeout_s`` and was aborted."""

    status_code = 504
    error_type = "timeout"
    default_code = "request_timeout"
    default_message = "The request timed out and was aborted."


class InternalServerError(ServeError):
    """500: a bug or unexpected failure; the message must not leak internals."""

    status_code = 500
    error_type = "internal_error"
    default_message = "Internal server error."


class RequestCancelledError(ServeError):
    """The client went away; nobody receives a response. 499 follows nginx's convention."""

    status_code = 499
    error_type = "request_cancelled"
    default_message = "The client closed the request."


class SlowReaderError(ServeError):
    """The client stopped reading a stream: more than ``http.max_stream_buffer_bytes`` of it was
    waiting for the client, so the request was aborted (its engine work cancelled, its blocks
    freed). Only ever sent in-band, as the stream's last event before ``[DONE]`` (the 200 is out);
    the 408 is what the request log and metrics record."""

    status_code = 408
    error_type = "slow_reader"
    default_code = "stream_buffer_exceeded"

    def __init__(self, buffered_bytes: int, limit_bytes: int) -> None:
        super().__init__(f"The client read the stream too slowly: {buffered_bytes} bytes were waiting for it "
                         f"(limit {limit_bytes}), so the request was aborted.")
        self.buffered_bytes = buffered_bytes
        self.limit_bytes = limit_bytes


class ConflictError(ServeError):
    """409: the request is in a state that forbids this, e.g. a reconnect to a stream that still
    has a connection attached, or a client label that names several live requests."""

    status_code = 409
    error_type = "invalid_request_error"
    default_code = "conflict"


class EventsDroppedError(ServeError):
    """A resumable stream's kept events passed ``http.resume_max_bytes`` while nobody was attached,
    so a reconnect cannot get them all. Only ever sent in-band, before ``[DONE]``; 410 is what the
    log records."""

    status_code = 410
    error_type = "events_dropped"
    default_code = "events_dropped"
    default_message = ("The stream's kept events passed the server's limit (http.resume_max_bytes) while "
                       "the client was away, so they were dropped and the request was aborted.")
