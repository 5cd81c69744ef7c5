"""A stream moved off a lost Egress replica, as the Ingress drives it
(stages/ingress/egress_moves.py): the carry built from the frames received, the retry past a
replica that is still routed to, and when it does not move."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError, RayActorError

from stages.errors import EgressLostError
from stages.ingress.egress_moves import EgressMoves
from stages.transport.messages import (
    EngineMoved,
    EngineRequest,
    GenerationJob,
    PrefillNote,
    SamplingParams,
    StreamFrame,
    StreamStart,
    StreamSummary,
)


class FakeCall:
    """A started call yielding ``items``; an exception among them is raised there."""

    def __init__(self, items: list[Any], start: Any = None) -> None:
        self.items = list(items)
        self.start_answer = start
        self.cancelled = False
        self.finished = False

    async def start(self, timeout: float | None = None) -> Any:
        if isinstance(self.start_answer, BaseException):
            raise self.start_answer
        return self.start_answer

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class FakeConsumer:
    """``open_frames`` hands out the calls given, in order, and records the jobs."""

    def __init__(self, calls: list[FakeCall]) -> None:
        self.calls = list(calls)
        self.jobs: list[GenerationJob] = []

    def open_frames(self, job: GenerationJob) -> FakeCall:
        self.jobs.append(job)
        return self.calls.pop(0)


def frame(index: int, event_id: int, tokens: list[int], finish: str | None = None) -> StreamFrame:
    return StreamFrame(f"id: {event_id}\ndata: x\n\n", index, len(tokens), finish, event_id, tokens)


def job(n: int = 2) -> GenerationJob:
    from stages.transport.messages import ResumeTerms

    request = EngineRequest("r1", [1, 2, 3], SamplingParams(max_tokens=20), n=n)
    return GenerationJob(request, "chat", "m", "chatcmpl-r1", 0, n=n, stream=True,
                         resume=ResumeTerms(30.0, 1 << 20))


def start(egress: str, engine: str = "e1", ids: list[str] | None = None) -> StreamStart:
    return StreamStart(engine, ids or ["r1-0", "r1-1"], 3, egress_replica=egress)


async def drain(moves: EgressMoves) -> list[Any]:
    out = []
    while True:
        item = await moves.__anext__()
        out.append(item)
        if isinstance(item, StreamSummary):
            return out


@pytest.mark.parametrize("lost", [EgressLostError("The Egress replica g1 was lost"),
                                  ActorUnavailableError("gone", None)], ids=["channel_lost", "ray_error"])
def test_a_lost_egress_hands_the_job_on_with_what_the_client_received(lost: BaseException) -> None:
    prefill = PrefillNote(2, {"queue": 0.1, "prefill": 0.3})
    first = FakeCall([frame(0, 0, []), dataclasses.replace(frame(0, 1, [5, 6]), prefill=prefill), frame(1, 2, [7]),
                      frame(0, 3, [8], "stop"), frame(1, 4, [9, 10]), lost])
    gone = FakeCall([], start=RayActorError())  # Serve still routed to the dead replica once
    second = FakeCall([frame(1, 5, [11], "length"), StreamSummary(3, 6, 0, ["stop", "length"], {}, 0.0)],
                      start=start("g2", "e2", ["r1.1-0", "r1.1-1"]))
    consumer = FakeConsumer([gone, second])
    moved: list[tuple[int, str]] = []
    moves = EgressMoves(consumer, first, job(), start("g1"), max_moves=3, replicas=lambda: ["g1", "g2"],
                        on_move=lambda n, s: moved.append((n, s.egress_replica)))
    items = asyncio.run(drain(moves))
    assert first.cancelled and moved == [(1, "g2")]
    assert [type(i) for i in items].count(EngineMoved) == 1
    assert items[5] == EngineMoved("e2", ["r1.1-0", "r1.1-1"])
    assert [i.event_id for i in items if isinstance(i, StreamFrame)] == [0, 1, 2, 3, 4, 5]
    sent = consumer.jobs[-1]
    assert len(consumer.jobs) == 2 and sent.engine_request.request_id == "r1.1"
    assert sent.resume is None, "its kept events died with the first replica"
    carry = sent.carry
    assert carry is not None
    assert (carry.token_ids, carry.started, carry.finished, carry.next_event_id, carry.prompt_tokens) == (
        [[5, 6, 8], [7, 9, 10]], [0, 1], {0: "stop"}, 5, 3)
    assert carry.prefill == prefill  # the summary reports the prefill the client waited for


@pytest.mark.parametrize("case", ["no_moves_left", "not_a_loss", "no_other_replica", "nobody_accepts"])
def test_no_move_gives_the_caller_the_error(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    lost = EgressLostError("The Egress replica g1 was lost")
    error: BaseException = ValueError("a bug") if case == "not_a_loss" else lost
    first = FakeCall([frame(0, 0, [5]), error])
    consumer = FakeConsumer([FakeCall([], start=RayActorError()) for _ in range(100)])
    monkeypatch.setattr("stages.ingress.egress_moves.MOVE_TIMEOUT_S", 0.5)
    monkeypatch.setattr("stages.ingress.egress_moves.RETRY_S", 0.1)
    others = [] if case == "no_other_replica" else ["g2"]
    moves = EgressMoves(consumer, first, job(), start("g1"), max_moves=0 if case == "no_moves_left" else 3,
                        replicas=lambda: ["g1", *others])
    with pytest.raises(type(error)) as raised:
        asyncio.run(drain(moves))
    assert raised.value is error
    assert (len(consumer.jobs) > 1) == (case == "nobody_accepts")
