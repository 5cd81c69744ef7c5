"""Egress without Ray: a scripted engine stream in, typed items out (StreamStart, frames, summary),
stop strings that end one choice of several, and a full queue retried on another replica."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from stages.egress.egress import Egress, EngineStream
from stages.engine.core.errors import EngineOverloadedError
from stages.model_info import EMBEDDED_MODEL, load_tokenizer
from stages.transport.messages import (
    AbortRequest,
    EngineOutput,
    EngineRequest,
    GenerationJob,
    SamplingParams,
    StreamFrame,
    StreamStart,
    StreamSummary,
)


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(EMBEDDED_MODEL)


class ScriptedEngine:
    """Opens streams whose items come from ``script(request)``; records opens, closes and aborts."""

    def __init__(self, script: Any, refuse: list[str] | None = None) -> None:
        self.script = script
        self.refuse = list(refuse or [])  # replicas that answer 429, in order of opening
        self.opened: list[EngineRequest] = []
        self.closed = 0
        self.aborts: list[AbortRequest] = []

    def open(self, request: EngineRequest) -> EngineStream:
        self.opened.append(request)
        refuse = self.refuse.pop(0) if self.refuse else None

        async def items() -> Any:
            if refuse is not None:
                raise EngineOverloadedError("busy", replica=refuse)
            for outs in self.script(request):
                await asyncio.sleep(0)
                yield outs

        async def close() -> None:
            self.closed += 1

        return EngineStream(items(), close)

    async def abort(self, req: AbortRequest) -> None:
        self.aborts.append(req)


def ids(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def job(n: int = 1, stream: bool = True, stop: list[str] | None = None) -> GenerationJob:
    params = SamplingParams(max_tokens=50, temperature=0, stop=stop or [])
    req = EngineRequest("r1", [1, 2, 3], params, n=n)
    return GenerationJob(req, "completion", "m", "cmpl-r1", 0, n=n, stream=stream)


async def collect(egress: Egress, j: GenerationJob) -> list[Any]:
    return [item async for item in egress.stream(j)]


def test_stream_items_are_typed_and_numbered(tok: Any) -> None:
    words = ids(tok, " hello world")

    def script(req: EngineRequest) -> Any:
        yield [EngineOutput("r1", [], num_prompt_tokens=3, replica="e1")]
        yield [EngineOutput("r1", words[:1])]
        yield [EngineOutput("r1", words[1:], finish_reason="length", timings={"queue": 0.1})]

    engine = ScriptedEngine(script)
    items = asyncio.run(collect(Egress(tok, engine.open, engine.abort), job()))
    assert isinstance(items[0], StreamStart) and items[0].engine_replica == "e1"
    assert items[0].engine_request_ids == ["r1"] and items[0].prompt_tokens == 3
    frames = [i for i in items if isinstance(i, StreamFrame)]
    assert [f.data.split("\n")[0] for f in frames] == [f"id: {k}" for k in range(len(frames))]
    text = "".join(json.loads(f.data.split("data: ")[1])["choices"][0]["text"] for f in frames)
    assert text == " hello world" and frames[-1].finish_reason == "length"
    summary = items[-1]
    assert isinstance(summary, StreamSummary) and summary.completion_tokens == len(words)
    assert summary.finish_reasons == ["length"] and summary.body is None
    assert engine.closed == 1 and engine.aborts == []


def test_stop_string_in_one_choice_aborts_only_that_choice(tok: Any) -> None:
    stop_words, go_words = ids(tok, " one STOP two"), ids(tok, " alpha beta gamma delta epsilon zeta eta theta")

    def script(req: EngineRequest) -> Any:
        a, b = req.choice_ids()
        yield [EngineOutput(a, [], num_prompt_tokens=3, replica="e9")]
        for i in range(max(len(stop_words), len(go_words))):
            outs = []
            if i < len(stop_words):
                outs.append(EngineOutput(a, [stop_words[i]], index=0))
            if i < len(go_words):
                last = i == len(go_words) - 1
                outs.append(EngineOutput(b, [go_words[i]], index=1, finish_reason="length" if last else None))
            yield outs
        yield [EngineOutput(a, [], index=0, finish_reason="abort")]  # what the engine sends after the abort

    engine = ScriptedEngine(script)
    items = asyncio.run(collect(Egress(tok, engine.open, engine.abort), job(n=2, stop=["STOP"])))
    summary = items[-1]
    assert summary.finish_reasons == ["stop", "length"]
    assert engine.aborts == [AbortRequest("e9", ["r1-0"])]  # only choice 0, on the replica that runs it
    finishes = [(f.index, f.finish_reason) for f in items if isinstance(f, StreamFrame) and f.finish_reason]
    assert sorted(finishes) == [(0, "stop"), (1, "length")]  # each choice ends once, with its own reason


def test_non_streamed_job_gets_the_body_in_the_summary(tok: Any) -> None:
    words = ids(tok, " fine")

    def script(req: EngineRequest) -> Any:
        yield [EngineOutput("r1", [], num_prompt_tokens=3, replica="e1")]
        yield [EngineOutput("r1", words, finish_reason="abort")]

    engine = ScriptedEngine(script)
    items = asyncio.run(collect(Egress(tok, engine.open, engine.abort), job(stream=False)))
    assert [type(i) for i in items] == [StreamStart, StreamSummary]
    body = items[-1].body
    assert body["choices"][0]["text"] == " fine" and body["choices"][0]["finish_reason"] == "abort"
    assert body["usage"]["completion_tokens"] == len(words)


def test_full_queue_is_retried_on_another_replica_first(tok: Any) -> None:
    def script(req: EngineRequest) -> Any:
        yield [EngineOutput("r1", [], num_prompt_tokens=3, replica="e2")]
        yield [EngineOutput("r1", [5], finish_reason="length")]

    engine = ScriptedEngine(script, refuse=["e1"])
    items = asyncio.run(collect(Egress(tok, engine.open, engine.abort), job()))
    assert items[0].engine_replica == "e2"
    assert [r.avoid_replicas for r in engine.opened] == [[], ["e1"]]


def test_every_replica_refusing_gives_the_429(tok: Any) -> None:
    engine = ScriptedEngine(lambda req: iter(()), refuse=["e1", "e2", "e1"])
    with pytest.raises(EngineOverloadedError):
        asyncio.run(collect(Egress(tok, engine.open, engine.abort), job()))
    # e1, then e2 (avoiding e1), then e1 again: a replica refusing twice means all are full.
    assert [r.avoid_replicas for r in engine.opened] == [[], ["e1"], ["e1", "e2"]]
    assert engine.closed == 3
