"""Egress without Ray: a scripted engine stream in, typed items out (StreamStart, frames, summary),
stop strings that end one choice of several, a full queue retried on another replica, and a request
moved off a lost engine replica (and when it is not)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from stages.egress.egress import Egress, EngineStream
from stages.engine.core.errors import EngineOverloadedError, SamplingError
from stages.errors import EngineUnavailableError
from stages.model_info import EMBEDDED_MODEL, load_tokenizer
from stages.transport.messages import (
    AbortRequest,
    EngineMoved,
    EngineOutput,
    EngineRequest,
    GenerationJob,
    PrefillNote,
    RouteNote,
    SamplingParams,
    StreamCarry,
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


# -- moving a request off a lost engine replica (stages/egress/migration.py) ------------------------------
TEXT = " the quick brown fox jumps over the lazy dog"
FIRST_TIMINGS = {"queue": 0.1, "prefill": 0.2}


class Wrapped(Exception):
    """What Ray raises for an error of a remote call: the original is its ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _actor_died() -> BaseException:
    exceptions = pytest.importorskip("ray.exceptions")
    try:
        return exceptions.ActorDiedError()
    except Exception as exc:  # noqa: BLE001 - not constructible in this Ray version
        pytest.skip(f"ray.exceptions.ActorDiedError() is not constructible: {exc}")


#: How an engine stream dies: a factory of the error it raises, or None to end early (StopAsyncIteration).
LOSSES = {
    "unavailable": lambda: EngineUnavailableError("engine replica lost"),
    "early_end": None,
    "actor_died": _actor_died,
    "wrapped": lambda: Wrapped(EngineUnavailableError("lost, wrapped by Ray")),
}


class DyingEngine:
    """Engine replicas e1, e2, ... (one per open) that all generate ``tokens`` from where the request's
    ``output_token_ids`` leave off; the stream opened i-th dies after ``dies_after[i]`` tokens in all
    (None: it runs to the end) by raising ``error()``, or by ending early when ``error`` is None."""

    def __init__(self, tokens: list[int], dies_after: list[int | None], error: Any = None) -> None:
        self.tokens = tokens
        self.dies_after = list(dies_after)
        self.error = error
        self.opened: list[EngineRequest] = []
        self.replicas: list[str] = []
        self.closed = 0
        self.health_asks = 0

    def open(self, request: EngineRequest) -> EngineStream:
        self.opened.append(request)
        replica = f"e{len(self.opened)}"
        self.replicas.append(replica)
        dies = self.dies_after[len(self.opened) - 1] if len(self.opened) <= len(self.dies_after) else None
        first = len(self.opened) == 1
        prompt = len(request.prompt_token_ids)
        # The first replica's usage and timings are the ones the summary must keep.
        n_prompt, n_cached = (prompt, 1) if first else (prompt + len(request.carried(0)), 0)
        timings = FIRST_TIMINGS if first else {"queue": 5.0, "prefill": 6.0}

        async def items() -> Any:
            yield [EngineOutput(request.request_id, [], num_prompt_tokens=n_prompt, replica=replica)]
            start = len(request.carried(0))
            for pos in range(start, len(self.tokens)):
                if dies is not None and pos >= dies:
                    if self.error is None:
                        return
                    raise self.error()
                await asyncio.sleep(0)
                last = pos == len(self.tokens) - 1
                yield [EngineOutput(request.request_id, [self.tokens[pos]], num_prompt_tokens=n_prompt,
                                    num_cached_tokens=n_cached, timings=timings if pos == start else {},
                                    finish_reason="length" if last else None)]

        async def close() -> None:
            self.closed += 1

        return EngineStream(items(), close)

    def healthy(self, answer: list[str] | Exception | None = None) -> Any:
        """A ``healthy_engines`` callable answering ``answer`` (raising it if an exception), by default
        e1 to e6."""
        async def healthy_engines() -> list[str]:
            self.health_asks += 1
            if isinstance(answer, Exception):
                raise answer
            return answer if answer is not None else ["e1", "e2", "e3", "e4", "e5", "e6"]
        return healthy_engines


def moving(tok: Any, engine: DyingEngine, max_migrations: int = 3, healthy: Any = None) -> Egress:
    return Egress(tok, engine.open, max_migrations=max_migrations,
                  healthy_engines=healthy if healthy is not None else engine.healthy())


def frame_text(frames: list[StreamFrame]) -> str:
    return "".join(json.loads(f.data.split("data: ")[1])["choices"][0]["text"] for f in frames)


async def collect_until_error(egress: Egress, j: GenerationJob) -> tuple[list[Any], BaseException | None]:
    items: list[Any] = []
    try:
        async for item in egress.stream(j):
            items.append(item)
    except Exception as exc:  # noqa: BLE001 - returned for the test to check
        return items, exc
    return items, None


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a_lost_engine_moves_the_request_and_the_stream_goes_on_unbroken(tok: Any, loss: str) -> None:
    """Lost after k tokens: the same request goes to another replica with those k tokens, and the client
    gets one stream (EngineMoved in it), numbered without a gap, with the first replica's usage."""
    words, k = ids(tok, TEXT), 3
    if LOSSES[loss] is not None:
        LOSSES[loss]()  # skips here when the error cannot be made
    engine = DyingEngine(words, dies_after=[k], error=LOSSES[loss])
    egress = moving(tok, engine)
    items, err = asyncio.run(collect_until_error(egress, job()))
    assert err is None
    assert len(engine.opened) == 2
    moved = engine.opened[1]
    assert moved.request_id == "r1" and moved.prompt_token_ids == [1, 2, 3]
    assert moved.output_token_ids == [words[:k]] and moved.finished_choices == [] and "e1" in moved.avoid_replicas
    kinds = [type(i).__name__ for i in items]
    assert kinds[0] == "StreamStart" and kinds[-1] == "StreamSummary" and kinds.count("EngineMoved") == 1
    at = kinds.index("EngineMoved")
    assert items[at] == EngineMoved("e2", ["r1"])
    before = [i for i in items[:at] if isinstance(i, StreamFrame)]
    after = [i for i in items[at:] if isinstance(i, StreamFrame)]
    assert set(kinds[1:at]) == {"StreamFrame"} and set(kinds[at + 1:-1]) == {"StreamFrame"} and after
    assert sum(f.num_tokens for f in before) == k
    frames = before + after
    assert [f.event_id for f in frames] == list(range(len(frames)))
    assert [f.data.split("\n")[0] for f in frames] == [f"id: {i}" for i in range(len(frames))]
    assert frame_text(frames) == TEXT, "nothing repeated, nothing missing"
    summary = items[-1]
    assert summary.completion_tokens == len(words) and summary.num_events == len(frames)
    assert summary.finish_reasons == ["length"]
    assert (summary.prompt_tokens, summary.cached_tokens) == (3, 1)
    assert {key: summary.engine_timings[key] for key in FIRST_TIMINGS} == FIRST_TIMINGS
    assert egress.migrations == 1 and egress.recomputed_tokens == 3 + k
    assert engine.closed == 2, "the lost stream and the new one are both closed"


def test_a_moved_non_streamed_request_gets_the_whole_body(tok: Any) -> None:
    """Not streamed: the body after a move holds the whole text and the usage of every token."""
    words = ids(tok, TEXT)
    engine = DyingEngine(words, dies_after=[4], error=LOSSES["unavailable"])
    items = asyncio.run(collect(moving(tok, engine), job(stream=False)))
    assert [type(i) for i in items] == [StreamStart, EngineMoved, StreamSummary]
    body = items[-1].body
    assert body["choices"][0]["text"] == TEXT and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == len(words) and body["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("loss", ["unavailable", "early_end"])
@pytest.mark.parametrize("case", ["max_migrations_0", "only_the_lost_one_healthy", "health_check_fails"])
def test_no_move_gives_the_caller_the_engine_error(tok: Any, case: str, loss: str) -> None:
    """No move (not allowed, no other healthy replica, nobody to ask): the loss reaches the caller
    as before, EngineUnavailableError for an early end, and nothing is sent again."""
    words = ids(tok, TEXT)
    error = EngineUnavailableError("engine replica lost")
    engine = DyingEngine(words, dies_after=[3], error=None if loss == "early_end" else (lambda: error))
    max_migrations, healthy = 3, None
    if case == "max_migrations_0":
        max_migrations = 0
    elif case == "only_the_lost_one_healthy":
        healthy = engine.healthy(["e1"])
    else:
        healthy = engine.healthy(RuntimeError("directory unreachable"))
    egress = moving(tok, engine, max_migrations=max_migrations, healthy=healthy)
    items, err = asyncio.run(collect_until_error(egress, job()))
    assert isinstance(err, EngineUnavailableError)
    if loss == "unavailable":
        assert err is error, "the original error, unchanged"
    assert len(engine.opened) == 1 and egress.migrations == 0 and egress.recomputed_tokens == 0
    assert not any(isinstance(i, (EngineMoved, StreamSummary)) for i in items)
    if case in ("only_the_lost_one_healthy", "health_check_fails"):
        assert engine.health_asks == 1


class DyingGroupEngine:
    """Engine replicas for a request with several choices: choice i generates ``tokens[i]`` from
    where its carried tokens leave off, one token per open choice per round, and finishes with
    ``"stop"`` after ``stops[i]`` tokens (None: ``"length"`` at the end). The first replica dies
    (raises) before round ``dies_at``."""

    def __init__(self, tokens: list[list[int]], stops: list[int | None], dies_at: int) -> None:
        self.tokens, self.stops, self.dies_at = tokens, stops, dies_at
        self.opened: list[EngineRequest] = []

    def open(self, request: EngineRequest) -> EngineStream:
        self.opened.append(request)
        replica, first = f"e{len(self.opened)}", len(self.opened) == 1
        ids = request.choice_ids()
        open_choices = [i for i in range(request.n) if i not in request.finished_choices]

        async def items() -> Any:
            yield [EngineOutput(ids[open_choices[0]], [], num_prompt_tokens=3, replica=replica,
                                index=open_choices[0])]
            pos = {i: len(request.carried(i)) for i in open_choices}
            for round_ in range(100):
                if first and round_ == self.dies_at:
                    raise EngineUnavailableError("engine replica lost")
                outs = []
                for i in [i for i in open_choices if i in pos]:
                    end = self.stops[i] if self.stops[i] is not None else len(self.tokens[i])
                    finish = None if pos[i] + 1 < end else ("stop" if self.stops[i] is not None else "length")
                    outs.append(EngineOutput(ids[i], [self.tokens[i][pos[i]]], index=i, finish_reason=finish))
                    pos[i] += 1
                    if finish:
                        del pos[i]
                if not outs:
                    return
                await asyncio.sleep(0)
                yield outs

        async def close() -> None:
            pass

        return EngineStream(items(), close)


def test_a_request_with_two_choices_moves_each_open_choice_with_its_own_tokens(tok: Any) -> None:
    """n = 2: choice 0 stopped after 2 tokens, then the replica was lost at round 3. The move
    carries both choices' tokens, marks choice 0 finished (not run again), and choice 1 goes on:
    each choice's text is whole, events are numbered without a gap, usage counts every token."""
    first, second = ids(tok, " one two three"), ids(tok, TEXT)
    engine = DyingGroupEngine([first, second], stops=[2, None], dies_at=3)
    egress = Egress(tok, engine.open, max_migrations=3, healthy_engines=DyingEngine([], []).healthy())
    items, err = asyncio.run(collect_until_error(egress, job(n=2)))
    assert err is None
    moved = engine.opened[1]
    assert moved.output_token_ids == [first[:2], second[:3]] and moved.finished_choices == [0]
    frames = [i for i in items if isinstance(i, StreamFrame)]
    assert [f.event_id for f in frames] == list(range(len(frames)))
    text = {0: "", 1: ""}
    for f in frames:
        for choice in json.loads(f.data.split("data: ")[1])["choices"]:
            text[choice["index"]] += choice["text"]
    assert text == {0: tok.decode(first[:2]), 1: TEXT}
    summary = items[-1]
    assert summary.finish_reasons == ["stop", "length"]
    assert summary.completion_tokens == 2 + len(second)
    assert egress.migrations == 1 and egress.recomputed_tokens == 3 + 3


@pytest.mark.parametrize("error", [SamplingError("this request's sampling failed"), ValueError("a bug")],
                         ids=["sampling_error", "value_error"])
def test_an_error_that_is_not_an_engine_loss_is_not_moved(tok: Any, error: Exception) -> None:
    """The request's own error (not its replica's loss) propagates unchanged, with no move."""
    engine = DyingEngine(ids(tok, TEXT), dies_after=[3], error=lambda: error)
    egress = moving(tok, engine)
    items, err = asyncio.run(collect_until_error(egress, job()))
    assert err is error
    assert len(engine.opened) == 1 and egress.migrations == 0
    assert not any(isinstance(i, EngineMoved) for i in items)


def test_a_request_moves_at_most_max_migrations_times(tok: Any) -> None:
    """An engine that dies every time: max_migrations moves, each carrying every token so far; the
    next loss reaches the caller."""
    words = ids(tok, TEXT)
    assert len(words) > 5
    error = EngineUnavailableError("lost again")
    engine = DyingEngine(words, dies_after=[2, 3, 4, 5, 6], error=lambda: error)
    egress = moving(tok, engine, max_migrations=3)
    items, err = asyncio.run(collect_until_error(egress, job()))
    assert err is error
    assert len(engine.opened) == 4
    assert [r.carried(0) for r in engine.opened] == [[], words[:2], words[:3], words[:4]]
    assert [r.request_id for r in engine.opened] == ["r1"] * 4
    for lost, req in zip(["e1", "e2", "e3"], engine.opened[1:], strict=True):
        assert lost in req.avoid_replicas
    assert [i for i in items if isinstance(i, EngineMoved)] == [EngineMoved(f"e{i}", ["r1"]) for i in (2, 3, 4)]
    frames = [i for i in items if isinstance(i, StreamFrame)]
    assert [f.event_id for f in frames] == list(range(len(frames)))
    assert sum(f.num_tokens for f in frames) == 5
    assert egress.migrations == 3 and egress.recomputed_tokens == 3 * 3 + 2 + 3 + 4


# -- a stream rebuilt on another Egress replica (stages/ingress/egress_moves.py) ---------------------
def _carry_of(frames: list[StreamFrame], n: int, prompt_tokens: int) -> StreamCarry:
    """What a client that received ``frames`` has: the carry an Ingress builds from them."""
    tokens: list[list[int]] = [[] for _ in range(n)]
    finished: dict[int, str] = {}
    prefill = None
    for f in frames:
        tokens[f.index].extend(f.token_ids)
        if f.finish_reason is not None:
            finished[f.index] = f.finish_reason
        prefill = f.prefill or prefill
    return StreamCarry(tokens, sorted({f.index for f in frames}), finished,
                       frames[-1].event_id + 1 if frames else 0, prompt_tokens, prefill)


@pytest.mark.parametrize("stop", [None, [" lazy"]], ids=["plain", "stop_string"])
@pytest.mark.parametrize("received", [0, 1, 4, 7])
def test_a_stream_rebuilt_from_what_its_client_received_goes_on_byte_for_byte(
        tok: Any, received: int, stop: list[str] | None) -> None:
    """The events a client received from a first Egress, then those a second Egress sends from
    the carry of those events, are exactly the events of the uninterrupted stream: same bytes,
    same ids, the same usage. The second asks the engine only for what follows the carried tokens."""
    words = ids(tok, TEXT)

    def run(j: GenerationJob) -> tuple[list[Any], DyingEngine]:
        engine = DyingEngine(words, dies_after=[None])
        return asyncio.run(collect(Egress(tok, engine.open), j)), engine

    whole, _ = run(job(stop=stop))
    frames = [i for i in whole if isinstance(i, StreamFrame)]
    assert len(frames) > received
    carry = _carry_of(frames[:received], 1, whole[0].prompt_tokens)
    rest, engine = run(dataclasses.replace(job(stop=stop), carry=carry))
    assert engine.opened[0].output_token_ids == carry.token_ids
    again = [i for i in rest if isinstance(i, StreamFrame)]
    assert [f.data for f in frames[:received] + again] == [f.data for f in frames]
    assert [f.token_ids for f in frames[:received] + again] == [f.token_ids for f in frames]
    summary, clean = rest[-1], whole[-1]
    assert (summary.completion_tokens, summary.finish_reasons, summary.num_events) == (
        clean.completion_tokens, clean.finish_reasons, clean.num_events)


def test_a_stream_whose_every_choice_had_ended_gets_only_its_summary(tok: Any) -> None:
    """Lost after the last event but before the summary: nothing runs again."""
    words = ids(tok, TEXT)
    engine = DyingEngine(words, dies_after=[None])
    whole = asyncio.run(collect(Egress(tok, engine.open), job()))
    frames = [i for i in whole if isinstance(i, StreamFrame)]
    later = DyingEngine(words, dies_after=[None])
    rest = asyncio.run(collect(Egress(tok, later.open),
                               dataclasses.replace(job(), carry=_carry_of(frames, 1, whole[0].prompt_tokens))))
    assert later.opened == [] and [type(i) for i in rest] == [StreamStart, StreamSummary]
    assert rest[-1].completion_tokens == len(words) and rest[-1].finish_reasons == ["length"]
    assert rest[-1].prompt_tokens == whole[-1].prompt_tokens and rest[-1].num_events == len(frames)


def test_a_rebuilt_stream_reports_the_prefill_its_client_waited_for(tok: Any) -> None:
    """The first choice's first frame with a token carries its prefill (cached tokens, engine
    timings, route), once; a stream rebuilt from a carry with it reports that prefill in its summary (what
    Server-Timing, the log and usage show), not the new engine's recompute of the carried tokens."""
    words = ids(tok, TEXT)
    route = RouteNote("e1", "cache_aware", 0.5, 2)
    engine = DyingEngine(words, dies_after=[None])

    def routed(request: EngineRequest) -> EngineStream:
        stream = engine.open(request)
        stream.request = dataclasses.replace(request, route=route)  # as the router noted it
        return stream

    whole = asyncio.run(collect(Egress(tok, routed), job()))
    frames = [i for i in whole if isinstance(i, StreamFrame)]
    notes = [f.prefill for f in frames if f.prefill is not None]
    assert notes == [PrefillNote(1, FIRST_TIMINGS, route)]
    assert next(f for f in frames if f.token_ids).prefill is notes[0]  # with the first token
    later = DyingEngine(words, dies_after=[None])
    later.open(job().engine_request)  # its next stream is not the first: other usage and timings
    rest = asyncio.run(collect(Egress(tok, later.open),
                               dataclasses.replace(job(), carry=_carry_of(frames[:3], 1, whole[0].prompt_tokens))))
    summary, clean = rest[-1], whole[-1]
    assert (summary.prompt_tokens, summary.cached_tokens, summary.engine_timings, summary.route) == (
        clean.prompt_tokens, 1, FIRST_TIMINGS, route)
    assert not any(f.prefill for f in rest if isinstance(f, StreamFrame))
    # Without a note (lost before the first token) the new engine's prefill is the one there is.
    fresh = DyingEngine(words, dies_after=[None])
    fresh.open(job().engine_request)
    rest = asyncio.run(collect(Egress(tok, fresh.open), dataclasses.replace(job(), carry=_carry_of([], 1, 3))))
    assert rest[-1].engine_timings["queue"] == 5.0 and rest[-1].cached_tokens == 0
