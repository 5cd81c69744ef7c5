"""Where a request is prepared (stages/ingress/prep.py), without Ray: short plain requests in the
Ingress with exactly the stage's result, the rest through the stage's handle; the engines' context
length applies inline too."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from stages.api.max_tokens import MaxTokens
from stages.errors import ContextLengthExceededError
from stages.ingress.prep import Prep
from stages.model_info import EMBEDDED_MODEL
from stages.preprocess.preprocessor import Preprocessor
from stages.transport.messages import EngineRequest, PreprocessRequest, SamplingParams, StructuredOutputSpec

LIMIT = 2048


class _Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    async def remote(self, *args: Any) -> Any:
        return await self.fn(*args)


class FakeStage:
    """The Preprocess stage's handle: prepares with a real Preprocessor and records what it got."""

    def __init__(self, pre: Preprocessor) -> None:
        self.pre = pre
        self.got: list[str] = []
        self.process = _Call(self._process)

    async def _process(self, req: PreprocessRequest) -> EngineRequest:
        self.got.append(req.request_id)
        return self.pre.process(dataclasses.replace(req, tools=None))  # (tool templates: not this test's)


class FakeDirectory:
    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = self._len
        self.value = max_model_len

    async def _len(self) -> int:
        return self.value


@pytest.fixture(scope="module")
def reference() -> Preprocessor:
    return Preprocessor(EMBEDDED_MODEL)


def _chat(rid: str, text: str, **fields: Any) -> PreprocessRequest:
    return PreprocessRequest(rid, SamplingParams(), MaxTokens(8), messages=[{"role": "user", "content": text}], **fields)


def _run(prep: Prep, req: PreprocessRequest) -> EngineRequest:
    return asyncio.run(prep.process(req))


def _same(a: EngineRequest, b: EngineRequest) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.prompt_text == b.prompt_text
    assert dataclasses.asdict(a.sampling_params) == dataclasses.asdict(b.sampling_params)


def test_a_short_plain_request_is_prepared_here_exactly_as_the_stage_would(reference: Preprocessor) -> None:
    stage, counted = FakeStage(reference), []
    prep = Prep(stage, EMBEDDED_MODEL, 0, None, LIMIT, counted.append)
    for req in (_chat("c", "Name a colour.", bad_words=["red"]),
                PreprocessRequest("p", SamplingParams(), MaxTokens(), prompt="Once upon a time"),
                PreprocessRequest("t", SamplingParams(), MaxTokens(4), prompt=[1, 2, 3])):
        _same(_run(prep, req), reference.process(req))
    assert stage.got == [] and counted == ["ingress"] * 3


def test_long_constrained_or_tool_requests_go_to_the_stage(reference: Preprocessor) -> None:
    stage, counted = FakeStage(reference), []
    prep = Prep(stage, EMBEDDED_MODEL, 0, None, LIMIT, counted.append)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    _run(prep, _chat("at-limit", "x" * LIMIT))
    _run(prep, _chat("long", "x" * (LIMIT + 1)))
    _run(prep, PreprocessRequest("long-prompt", SamplingParams(), MaxTokens(4), prompt="y" * (LIMIT + 1)))
    _run(prep, _chat("json", "hi", structured=StructuredOutputSpec("json_object", "")))
    _run(prep, _chat("tools", "hi", tools=tools))
    assert stage.got == ["long", "long-prompt", "json", "tools"]
    assert counted == ["ingress", "stage", "stage", "stage", "stage"]


def test_zero_sends_everything_to_the_stage_and_loads_no_tokenizer(reference: Preprocessor) -> None:
    stage = FakeStage(reference)
    prep = Prep(stage, EMBEDDED_MODEL, 0, None, 0)
    assert prep.pre is None
    _same(_run(prep, _chat("a", "hi")), reference.process(_chat("a", "hi")))
    assert stage.got == ["a"]


def test_the_engines_context_length_applies_inline(reference: Preprocessor) -> None:
    stage, directory = FakeStage(reference), FakeDirectory(40)
    prep = Prep(stage, EMBEDDED_MODEL, 0, directory, LIMIT)
    n = len(reference.process(_chat("n", "Name a colour.")).prompt_token_ids)
    with pytest.raises(ContextLengthExceededError):
        _run(prep, PreprocessRequest("r", SamplingParams(), MaxTokens(40 - n + 1),
                                     messages=[{"role": "user", "content": "Name a colour."}]))
    out = _run(prep, PreprocessRequest("ok", SamplingParams(), MaxTokens(),
                                       messages=[{"role": "user", "content": "Name a colour."}]))
    assert out.sampling_params.max_tokens == 40 - n  # the room the engines' length leaves
    assert stage.got == []


def test_a_directory_that_does_not_answer_keeps_the_last_known_length(reference: Preprocessor) -> None:
    """The refresh is on the request's path: a restarting directory must not hold requests up."""

    class SilentDirectory:
        max_model_len = _Call(lambda: asyncio.sleep(3600))

    from stages.preprocess import preprocessor as preprocess

    prep = Prep(FakeStage(reference), EMBEDDED_MODEL, 0, SilentDirectory(), LIMIT)
    saved, preprocess.LIMIT_TIMEOUT_S = preprocess.LIMIT_TIMEOUT_S, 0.05
    try:  # (bounded here too: without the fix this would wait an hour)
        out = asyncio.run(asyncio.wait_for(prep.process(_chat("a", "hi")), 5))
    finally:
        preprocess.LIMIT_TIMEOUT_S = saved
    assert out.prompt_token_ids == reference.process(_chat("a", "hi")).prompt_token_ids
