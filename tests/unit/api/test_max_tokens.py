"""The one ``max_tokens`` rule (stages/api/max_tokens.py): the client's ask, the operator's limit
and the room the prompt leaves, with the 400s clients see."""

from __future__ import annotations

import pickle

import pytest

from stages.api.max_tokens import MaxTokens
from stages.errors import ContextLengthExceededError, InvalidRequestError


def test_an_open_ask_gets_the_room_left() -> None:
    assert MaxTokens().resolve(6, 16, prompt_param="messages") == 10


def test_an_open_ask_stops_at_the_operators_limit() -> None:
    assert MaxTokens(limit=4).resolve(6, 16, prompt_param="messages") == 4
    assert MaxTokens(limit=40).resolve(6, 16, prompt_param="messages") == 10  # the room is smaller


def test_an_ask_that_fits_is_kept() -> None:
    assert MaxTokens(10).resolve(6, 16, prompt_param="prompt") == 10
    assert MaxTokens(4, limit=4).resolve(6, 16, prompt_param="prompt") == 4


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_an_ask_over_the_limit_is_a_400_naming_the_field(field: str) -> None:
    rule = MaxTokens(5, field, limit=4)
    for check in (rule.check, lambda: rule.resolve(1, 100, prompt_param="messages")):
        with pytest.raises(InvalidRequestError) as info:
            check()
        assert not isinstance(info.value, ContextLengthExceededError)
        assert info.value.status_code == 400 and info.value.param == field
        assert info.value.message == f"{field} is 5; this server allows at most 4."


def test_no_limit_means_any_ask_passes_the_check() -> None:
    MaxTokens(10**9).check()
    MaxTokens().check()


def test_an_ask_past_the_room_is_context_length_exceeded() -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        MaxTokens(11).resolve(6, 16, prompt_param="messages")
    err = info.value
    assert (err.prompt_tokens, err.max_tokens, err.max_model_len, err.param) == (6, 11, 16, "messages")


def test_a_prompt_that_fills_the_window_leaves_no_room() -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        MaxTokens(limit=4).resolve(16, 16, prompt_param="prompt")
    assert (info.value.prompt_tokens, info.value.max_tokens, info.value.param) == (16, None, "prompt")
    assert MaxTokens().resolve(15, 16, prompt_param="prompt") == 1


def test_it_crosses_a_deployment_boundary() -> None:
    rule = MaxTokens(7, "max_completion_tokens", 8)
    assert pickle.loads(pickle.dumps(rule)) == rule
