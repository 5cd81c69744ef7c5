"""The error tree: statuses, OpenAI body shape, headers, and pickling across processes."""

from __future__ import annotations

import pickle

import pytest

from stages import errors
from stages.errors import (
    ContextLengthExceededError,
    EngineUnavailableError,
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
)

# One instance of every class, built with its own constructor signature.
INSTANCES: list[ServeError] = [
    ServeError("boom", param="p", code="c", headers={"X-A": "1"}),
    InvalidRequestError("temperature: too hot", param="temperature"),
    ContextLengthExceededError(100, 50, 128),
    ModelNotFoundError("gpt-9"),
    NotFoundError("Invalid URL (GET /v1/nope)"),
    MethodNotAllowedError(),
    PayloadTooLargeError(),
    QueueFullError(retry_after=2.5),
    EngineUnavailableError("engine died"),
    InternalServerError(),
    RequestCancelledError(),
    RequestTimeoutError(),
]

EXPECTED_STATUS = {
    ServeError: 500,
    InvalidRequestError: 400,
    ContextLengthExceededError: 400,
    ModelNotFoundError: 404,
    NotFoundError: 404,
    MethodNotAllowedError: 405,
    PayloadTooLargeError: 413,
    QueueFullError: 429,
    EngineUnavailableError: 503,
    InternalServerError: 500,
    RequestCancelledError: 499,
    RequestTimeoutError: 504,
}


def test_every_exported_class_is_covered() -> None:
    exported = {getattr(errors, name) for name in errors.__all__}
    assert exported == {type(e) for e in INSTANCES} == set(EXPECTED_STATUS)


@pytest.mark.parametrize("exc", INSTANCES, ids=lambda e: type(e).__name__)
def test_status_and_body_shape(exc: ServeError) -> None:
    assert exc.status_code == EXPECTED_STATUS[type(exc)]
    body = exc.to_dict()
    assert list(body) == ["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] == exc.message == str(exc)
    assert isinstance(exc.message, str) and exc.message
    assert body["error"]["type"] == exc.error_type
    assert body["error"]["param"] == exc.param
    assert body["error"]["code"] == exc.code


@pytest.mark.parametrize("exc", INSTANCES, ids=lambda e: type(e).__name__)
def test_pickle_round_trip(exc: ServeError) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert back.args == exc.args
    assert back.__dict__ == exc.__dict__
    assert back.to_dict() == exc.to_dict()
    assert back.headers == exc.headers
    assert back.status_code == exc.status_code


def test_pickle_keeps_subclass_fields() -> None:
    back = pickle.loads(pickle.dumps(ContextLengthExceededError(4000, 200, 4096, param="prompt")))
    assert (back.prompt_tokens, back.max_tokens, back.max_model_len) == (4000, 200, 4096)
    assert back.param == "prompt"
    assert pickle.loads(pickle.dumps(ModelNotFoundError("x"))).model == "x"


def test_openai_types_and_codes() -> None:
    assert InvalidRequestError("x", param="n").to_dict()["error"] == {
        "message": "x",
        "type": "invalid_request_error",
        "param": "n",
        "code": None,
    }
    nf = ModelNotFoundError("gpt-9").to_dict()["error"]
    assert nf["type"] == "invalid_request_error"
    assert nf["code"] == "model_not_found"
    assert nf["param"] == "model"
    assert "gpt-9" in nf["message"]
    assert ContextLengthExceededError(1, 1, 1).code == "context_length_exceeded"
    assert ContextLengthExceededError(1, 1, 1).error_type == "invalid_request_error"
    assert QueueFullError().code == "rate_limit_exceeded"
    assert EngineUnavailableError().error_type == "service_unavailable"
    assert InternalServerError().error_type == "internal_error"


def test_context_length_is_an_invalid_request() -> None:
    assert isinstance(ContextLengthExceededError(1, 1, 1), InvalidRequestError)
    assert issubclass(InvalidRequestError, ServeError)
    assert issubclass(ServeError, Exception)


def test_context_length_message_has_the_counts() -> None:
    exc = ContextLengthExceededError(prompt_tokens=3000, max_tokens=1500, max_model_len=4096)
    assert "maximum context length is 4096 tokens" in exc.message
    assert "you requested 4500 tokens" in exc.message
    assert "3000 in the messages" in exc.message
    assert "1500 in the completion" in exc.message
    assert exc.param == "messages"


def test_context_length_without_max_tokens() -> None:
    exc = ContextLengthExceededError(prompt_tokens=5000, max_tokens=None, max_model_len=4096)
    assert "4096" in exc.message and "5000" in exc.message
    assert "None" not in exc.message


@pytest.mark.parametrize(("retry_after", "header"), [(1, "1"), (2.5, "3"), (0, "0"), (30.0, "30")])
def test_queue_full_retry_after_header(retry_after: float, header: str) -> None:
    exc = QueueFullError(retry_after=retry_after)
    assert exc.status_code == 429
    assert exc.headers == {"Retry-After": header}
    assert exc.retry_after == int(header)


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
    assert EngineUnavailableError().message  # a default message is always present
    assert PayloadTooLargeError("too big: 5 MiB").message == "too big: 5 MiB"


def test_can_be_raised_and_caught_as_base() -> None:
    with pytest.raises(ServeError) as info:
        raise QueueFullError(retry_after=5)
    assert info.value.headers["Retry-After"] == "5"
