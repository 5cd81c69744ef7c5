"""The error tree and the one place errors become HTTP answers.

:mod:`stages.errors`: each class's status and OpenAI ``type``/``code``, the body shape, headers, and
pickling across processes (Ray pickles what a deployment raises). :mod:`stages.ingress.http_errors`:
engine errors, Ray's replica-gone errors and unexpected exceptions mapped to their
:class:`ServeError` and rendered, without leaking internals. No Ray cluster is needed.
"""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Iterator

import pytest
from ray import cloudpickle
from ray import exceptions as ray_exceptions

from stages import errors
from stages.engine.core.errors import (
    DuplicateRequestIdError,
    EngineDeadError,
    EngineOverloadedError,
    PromptTooLongError,
    RequestRejectedError,
    SamplingError,
)
from stages.errors import (
    AuthenticationError,
    ConflictError,
    ContextLengthExceededError,
    EgressLostError,
    EngineUnavailableError,
    EventsDroppedError,
    InternalServerError,
    InvalidRequestError,
    MethodNotAllowedError,
    ModelNotFoundError,
    NotFoundError,
    PayloadTooLargeError,
    QueueFullError,
    RequestCancelledError,
    RequestTimeoutError,
    ServeError,
    SlowReaderError,
    unwrap_error,
)
from stages.ingress.http_errors import error_response, to_serve_error

# One instance of every class, built with its own constructor signature (non-default fields set, so
# a pickle that re-runs ``__init__`` with the wrong arguments shows).
INSTANCES: list[ServeError] = [
    ServeError("boom", param="p", code="c", headers={"X-A": "1"}),
    InvalidRequestError("temperature: too hot", param="temperature"),
    AuthenticationError("Incorrect API key provided."),
    ContextLengthExceededError(100, 50, 128, param="prompt"),
    ModelNotFoundError("gpt-9"),
    NotFoundError("Invalid URL (GET /v1/nope)"),
    MethodNotAllowedError(),
    PayloadTooLargeError(),
    QueueFullError("busy", retry_after=2.5),
    EngineUnavailableError("engine died"),
    EgressLostError("The Egress replica g1 was lost before the request finished. Retry."),
    InternalServerError(),
    RequestCancelledError(),
    RequestTimeoutError(),
    SlowReaderError(20000, 16384),
    ConflictError("The stream already has a connection attached."),
    EventsDroppedError(),
]

#: The HTTP contract: status, OpenAI error ``type`` and default ``code`` of each class.
CONTRACT: dict[type[ServeError], tuple[int, str, str | None]] = {
    ServeError: (500, "internal_error", "c"),
    InvalidRequestError: (400, "invalid_request_error", None),
    ContextLengthExceededError: (400, "invalid_request_error", "context_length_exceeded"),
    ModelNotFoundError: (404, "invalid_request_error", "model_not_found"),
    NotFoundError: (404, "invalid_request_error", None),
    MethodNotAllowedError: (405, "invalid_request_error", None),
    PayloadTooLargeError: (413, "invalid_request_error", None),
    AuthenticationError: (401, "invalid_request_error", "invalid_api_key"),
    QueueFullError: (429, "requests", "rate_limit_exceeded"),
    EngineUnavailableError: (503, "service_unavailable", None),
    EgressLostError: (503, "service_unavailable", None),
    InternalServerError: (500, "internal_error", None),
    RequestCancelledError: (499, "request_cancelled", None),
    RequestTimeoutError: (504, "timeout", "request_timeout"),
    SlowReaderError: (408, "slow_reader", "stream_buffer_exceeded"),
    ConflictError: (409, "invalid_request_error", "conflict"),
    EventsDroppedError: (410, "events_dropped", "events_dropped"),
}


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _all_subclasses(sub)
    return out


def test_every_class_is_covered() -> None:
    """Adding an error class without a contract row and a pickling case fails here."""
    exported = {getattr(errors, name) for name in errors.__all__}
    assert exported == {type(e) for e in INSTANCES} == set(CONTRACT)
    assert _all_subclasses(ServeError) | {ServeError} == exported


@pytest.mark.parametrize("exc", INSTANCES, ids=lambda e: type(e).__name__)
def test_status_type_code_and_body(exc: ServeError) -> None:
    status, error_type, code = CONTRACT[type(exc)]
    assert (exc.status_code, exc.error_type, exc.code) == (status, error_type, code)
    assert exc.to_dict() == {"error": {"message": exc.message, "type": error_type, "param": exc.param,
                                       "code": code}}
    assert exc.message and exc.message == str(exc)


@pytest.mark.parametrize("dumps_loads", [(pickle.dumps, pickle.loads), (cloudpickle.dumps, pickle.loads)],
                         ids=["pickle", "cloudpickle"])
@pytest.mark.parametrize("exc", INSTANCES, ids=lambda e: type(e).__name__)
def test_pickle_round_trip(exc: ServeError, dumps_loads) -> None:
    dumps, loads = dumps_loads
    back = loads(dumps(exc))
    assert type(back) is type(exc)
    assert back.args == exc.args
    assert back.__dict__ == exc.__dict__
    assert back.to_dict() == exc.to_dict()
    assert back.headers == exc.headers
    assert str(back) == str(exc)


def test_pickle_keeps_subclass_fields() -> None:
    back = pickle.loads(pickle.dumps(ContextLengthExceededError(4000, 200, 4096, param="prompt")))
    assert (back.prompt_tokens, back.max_tokens, back.max_model_len, back.param) == (4000, 200, 4096, "prompt")
    assert back.code == "context_length_exceeded"
    model = pickle.loads(pickle.dumps(ModelNotFoundError("x")))
    assert (model.model, model.message, model.param) == ("x", "The model `x` does not exist.", "model")


def test_pickle_keeps_queue_full_headers() -> None:
    back = pickle.loads(pickle.dumps(QueueFullError("busy", retry_after=7.2)))
    assert back.headers == {"Retry-After": "8"}
    assert back.retry_after == 8
    assert back.message == "busy"


def test_pickled_error_keeps_attributes_set_after_construction() -> None:
    exc = InvalidRequestError("x")
    exc.param = "messages[0].content"
    exc.headers["X-Extra"] = "1"
    back = pickle.loads(pickle.dumps(exc))
    assert back.param == "messages[0].content"
    assert back.headers == {"X-Extra": "1"}


def test_context_length_message_has_the_counts() -> None:
    exc = ContextLengthExceededError(prompt_tokens=3000, max_tokens=1500, max_model_len=4096)
    assert exc.message == ("This model's maximum context length is 4096 tokens. However, you requested 4500 "
                           "tokens (3000 in the messages, 1500 in the completion). Please reduce the length "
                           "of the messages or completion.")
    assert exc.param == "messages"


def test_context_length_message_names_the_prompt() -> None:
    exc = ContextLengthExceededError(3000, 1500, 4096, param="prompt")
    assert "3000 in the prompt" in exc.message and "length of the prompt or completion" in exc.message
    assert "messages" not in exc.message


def test_context_length_without_max_tokens() -> None:
    exc = ContextLengthExceededError(prompt_tokens=5000, max_tokens=None, max_model_len=4096)
    assert exc.message == ("This model's maximum context length is 4096 tokens. However, your messages "
                           "resulted in 5000 tokens. Please reduce the length of the messages.")
    assert exc.max_tokens is None


@pytest.mark.parametrize(("retry_after", "header"),
                         [(1, "1"), (2.5, "3"), (0, "0"), (0.2, "1"), (1.0001, "2"), (30.0, "30"), (-5, "0")])
def test_queue_full_retry_after_rounds_up_to_whole_seconds(retry_after: float, header: str) -> None:
    exc = QueueFullError(retry_after=retry_after)
    assert exc.headers == {"Retry-After": header}
    assert exc.retry_after == int(header)
    assert exc.message == QueueFullError.default_message


def test_other_errors_have_no_headers_by_default() -> None:
    assert InvalidRequestError("x").headers == {}
    assert EngineUnavailableError().headers == {}


def test_headers_are_copied() -> None:
    given = {"X-A": "1"}
    exc = ServeError("x", headers=given)
    given["X-B"] = "2"
    assert exc.headers == {"X-A": "1"}


def test_code_override_and_default_message() -> None:
    assert InvalidRequestError("x", code="custom").code == "custom"
    assert EngineUnavailableError().message == "The inference engine is not available."
    assert RequestTimeoutError().message == "The request timed out and was aborted."
    assert PayloadTooLargeError("too big: 5 MiB").message == "too big: 5 MiB"


def test_unwrap_error() -> None:
    inner = EngineDeadError("dead")
    task_error = ray_exceptions.RayTaskError("generate", "Traceback ...", inner)
    assert unwrap_error(task_error) is inner
    assert unwrap_error(task_error.as_instanceof_cause()) is inner
    plain = ValueError("x")
    assert unwrap_error(plain) is plain

    class NotACause(Exception):
        cause = "a string, not an exception"

    odd = NotACause()
    assert unwrap_error(odd) is odd


# -- engine errors → HTTP (stages/ingress/http_errors.py) --------------------------------------------------
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def ingress_log() -> Iterator[list[logging.LogRecord]]:
    """Records of ``lifecycle.ingress``, attached to that logger itself (propagation may be off)."""
    logger = logging.getLogger("lifecycle.ingress")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _wrapped(exc: BaseException) -> list[BaseException]:
    """``exc`` as a stage raises it, and as the caller of a Ray task or Serve handle receives it."""
    task_error = ray_exceptions.RayTaskError("method", "Traceback ...", exc)
    return [exc, task_error, task_error.as_instanceof_cause()]


@pytest.mark.parametrize("how", range(3), ids=["raw", "RayTaskError", "dual"])
def test_prompt_too_long_is_context_length_exceeded(how: int) -> None:
    err = to_serve_error(_wrapped(PromptTooLongError(5000, 4096))[how])
    assert isinstance(err, ContextLengthExceededError)
    assert (err.status_code, err.code) == (400, "context_length_exceeded")
    assert (err.prompt_tokens, err.max_tokens, err.max_model_len) == (5000, None, 4096)
    assert "maximum context length is 4096 tokens" in err.message and "5000 tokens" in err.message


@pytest.mark.parametrize("how", range(3), ids=["raw", "RayTaskError", "dual"])
def test_rejected_request_is_400_with_the_engines_reason(how: int) -> None:
    err = to_serve_error(_wrapped(RequestRejectedError("token id 99999 is outside the vocabulary"))[how])
    assert type(err) is InvalidRequestError
    assert err.to_dict()["error"] == {"message": "token id 99999 is outside the vocabulary",
                                      "type": "invalid_request_error", "param": None, "code": None}
    assert err.status_code == 400


@pytest.mark.parametrize("how", range(3), ids=["raw", "RayTaskError", "dual"])
def test_overloaded_engine_is_429_with_retry_after(how: int) -> None:
    err = to_serve_error(_wrapped(EngineOverloadedError("waiting queue full", replica="e1", retry_after=2.2))[how])
    assert isinstance(err, QueueFullError)
    assert err.status_code == 429
    assert err.headers == {"Retry-After": "3"}
    assert err.message == "waiting queue full"
    assert err.code == "rate_limit_exceeded"


@pytest.mark.parametrize("how", range(3), ids=["raw", "RayTaskError", "dual"])
def test_dead_engine_is_503(how: int) -> None:
    err = to_serve_error(_wrapped(EngineDeadError("engine is dead: RuntimeError('cuda')"))[how])
    assert type(err) is EngineUnavailableError
    assert err.status_code == 503
    assert err.message == "engine is dead: RuntimeError('cuda')"


@pytest.mark.parametrize("how", range(3), ids=["raw", "RayTaskError", "dual"])
def test_a_failed_sampling_is_500_that_names_the_exception(how: int) -> None:
    err = to_serve_error(_wrapped(SamplingError("sampling failed for this request (IndexError: index 49159)"))[how])
    assert type(err) is InternalServerError
    assert err.status_code == 500
    assert err.to_dict()["error"]["type"] == "internal_error"
    assert err.message == "sampling failed for this request (IndexError: index 49159)"


@pytest.mark.parametrize("gone", [
    ray_exceptions.RayActorError(),
    ray_exceptions.ActorDiedError(),
    ray_exceptions.ActorUnavailableError("unreachable", None),
    ray_exceptions.WorkerCrashedError(),
    ray_exceptions.NodeDiedError("node gone"),
], ids=lambda e: type(e).__name__)
def test_replica_gone_is_503_naming_only_the_error_type(gone: BaseException) -> None:
    for exc in (gone, ray_exceptions.RayTaskError("stream", "Traceback ...", gone)):
        err = to_serve_error(exc)
        assert type(err) is EngineUnavailableError
        assert err.status_code == 503
        assert err.message == f"A server replica became unavailable: {type(gone).__name__}. Retry."


def test_serve_errors_pass_through_unchanged() -> None:
    original = ContextLengthExceededError(10, 5, 12, param="prompt")
    for exc in _wrapped(original):
        assert to_serve_error(exc) is original
    # Also after the trip through pickle a remote replica's error takes.
    back = to_serve_error(pickle.loads(pickle.dumps(ray_exceptions.RayTaskError("process", "tb", original))))
    assert (type(back), back.param, back.to_dict()) == (ContextLengthExceededError, "prompt", original.to_dict())


def test_engine_errors_survive_pickling_and_map_the_same() -> None:
    for exc in (PromptTooLongError(5000, 4096), EngineOverloadedError("full", "e1", 4.5),
                RequestRejectedError("bad"), EngineDeadError("dead")):
        back = pickle.loads(pickle.dumps(ray_exceptions.RayTaskError("generate", "tb", exc)))
        direct, remote = to_serve_error(exc), to_serve_error(back)
        assert type(remote) is type(direct)
        assert (remote.status_code, remote.to_dict(), remote.headers) == (
            direct.status_code, direct.to_dict(), direct.headers)


@pytest.mark.parametrize("how", range(3), ids=["raw", "RayTaskError", "dual"])
def test_unknown_exception_is_500_naming_only_its_type(how: int, ingress_log: list[logging.LogRecord]) -> None:
    secret = KeyError("/home/app/secrets.env: token=abc123")
    err = to_serve_error(_wrapped(secret)[how])
    assert type(err) is InternalServerError
    assert err.status_code == 500
    assert err.message == "Internal server error: KeyError"
    assert "abc123" not in json.dumps(err.to_dict())
    # The details go to the log, not to the client.
    (rec,) = ingress_log
    assert rec.levelno == logging.ERROR and rec.exc_info is not None and rec.exc_info[1] is secret


def test_duplicate_engine_id_is_a_logged_500(ingress_log: list[logging.LogRecord]) -> None:
    err = to_serve_error(DuplicateRequestIdError("engine request id 'x' is already in use"))
    assert type(err) is InternalServerError
    assert err.message == "Internal server error: DuplicateRequestIdError"
    (rec,) = ingress_log
    assert rec.levelno == logging.ERROR and "engine id collision" in rec.getMessage()


def test_error_response_renders_status_body_and_headers() -> None:
    resp = error_response(EngineOverloadedError("full", "e1", 1.5), headers={"X-Request-Id": "abc"})
    assert resp.status_code == 429
    assert json.loads(resp.body) == {"error": {"message": "full", "type": "requests", "param": None,
                                               "code": "rate_limit_exceeded"}}
    assert resp.headers["retry-after"] == "2"
    assert resp.headers["x-request-id"] == "abc"
    assert resp.headers["content-type"] == "application/json"


def test_error_response_extra_headers_win() -> None:
    resp = error_response(QueueFullError(retry_after=1), headers={"Retry-After": "9"})
    assert resp.headers["retry-after"] == "9"
    plain = error_response(ValueError("x"))
    assert plain.status_code == 500
    assert "retry-after" not in plain.headers
