"""Batched admission without Ray: the caller's queue (stages/transport/admission.py) and the callee's
jobs (stages/transport/producer.py, which replaced ``AdmittedStreams``)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from stages.transport.admission import AdmissionQueue, fire_and_forget
from stages.transport.channel import merge_channel_items
from stages.transport.channel_client import ChannelClient
from stages.transport.consumer import Consumer
from stages.transport.messages import Admission, AdmissionBatch, ChannelBatch, EngineOutput, RoutedError
from stages.transport.producer import Job, Producer
from tests.unit.transport.fakes import (
    END,
    FakeEgress,
    FakeHandle,
    assert_no_leaks,
    generation_job,
    lost,
    summary,
    wait_until,
)

REQUEST = contextvars.ContextVar("REQUEST", default="")


def run_async(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    @functools.wraps(test)
    def wrapper() -> None:
        asyncio.run(test())

    return wrapper


class FakeCallee:
    """Answers each batch after ``delay``: ``"bad..."`` items are refused, the rest accepted."""

    def __init__(self, delay: float = 0.0, fail: BaseException | None = None) -> None:
        self.delay = delay
        self.fail = fail
        self.batches: list[list[str]] = []
        self.contexts: list[str] = []

    async def send(self, items: list[str]) -> list[Admission]:
        self.batches.append(list(items))
        self.contexts.append(REQUEST.get())
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return [Admission(error=ValueError(i)) if i.startswith("bad") else Admission(item=f"ok:{i}") for i in items]


@run_async
async def test_requests_of_one_loop_turn_share_a_call_and_get_their_own_answers() -> None:
    callee = FakeCallee()
    queue: AdmissionQueue[str] = AdmissionQueue(callee.send)
    futures = [queue.submit(x) for x in ("a", "bad-b", "c")]
    assert callee.batches == []  # nothing goes out before the loop turn ends
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert callee.batches == [["a", "bad-b", "c"]]
    assert results[0] == "ok:a" and results[2] == "ok:c"
    assert isinstance(results[1], ValueError) and str(results[1]) == "bad-b"
    # The next turn's requests go in a call of their own.
    assert await queue.submit("d") == "ok:d"
    assert callee.batches[-1] == ["d"] and (queue.calls_sent, queue.items_sent) == (2, 4)


@run_async
async def test_with_a_call_in_flight_requests_wait_a_window_for_each_other() -> None:
    """Idle: a request goes at the end of its loop turn. During a burst (an answer outstanding),
    requests a few milliseconds apart share a call; the window bounds how long they wait."""
    callee = FakeCallee(delay=0.2)
    queue: AdmissionQueue[str] = AdmissionQueue(callee.send, window_s=0.02)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    first = queue.submit("a")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert callee.batches == [["a"]]  # nothing in flight: no wait
    later = [queue.submit("b")]
    await asyncio.sleep(0.005)
    later.append(queue.submit("c"))
    assert callee.batches == [["a"]]
    await asyncio.sleep(0.03)
    assert callee.batches == [["a"], ["b", "c"]]
    assert await asyncio.gather(first, *later) == ["ok:a", "ok:b", "ok:c"]
    assert loop.time() - t0 < 0.5


@run_async
async def test_batches_are_split_by_key_and_size() -> None:
    callee = FakeCallee()
    queue: AdmissionQueue[str] = AdmissionQueue(callee.send, key=lambda x: x[0], max_batch=2)
    await asyncio.gather(*(queue.submit(x) for x in ("a1", "b1", "a2", "a3", "b2")))
    assert sorted(callee.batches) == [["a1", "a2"], ["a3"], ["b1", "b2"]]


@run_async
async def test_a_failed_call_fails_every_request_in_it() -> None:
    callee = FakeCallee(fail=ConnectionError("replica died"))
    queue: AdmissionQueue[str] = AdmissionQueue(callee.send)
    results = await asyncio.gather(queue.submit("a"), queue.submit("b"), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)
    assert queue.num_in_flight() == 0


@run_async
async def test_calls_do_not_belong_to_the_request_that_triggered_them() -> None:
    """Serve cancels the calls a request makes when it is cancelled: a batch call must run in a
    context of its own, and cancelling one waiter must not cancel the call for the others."""
    callee = FakeCallee(delay=0.05)
    queue: AdmissionQueue[str] = AdmissionQueue(callee.send)

    async def waiter(name: str) -> str:
        REQUEST.set(name)
        return await queue.submit(name)

    first = asyncio.create_task(waiter("a"))
    second = asyncio.create_task(waiter("b"))
    await asyncio.sleep(0.01)
    first.cancel()
    assert await second == "ok:b"
    assert callee.contexts == [""], "the batch call ran in a request's context"
    with pytest.raises(asyncio.CancelledError):
        await first


@run_async
async def test_a_request_given_up_before_its_answer_is_handed_to_on_orphan_if_accepted() -> None:
    callee = FakeCallee(delay=0.05)
    orphans: list[tuple[str, Any]] = []
    queue: AdmissionQueue[str] = AdmissionQueue(callee.send, on_orphan=lambda i, a: orphans.append((i, a)))
    accepted, refused, kept = queue.submit("a"), queue.submit("bad-b"), queue.submit("c")
    await asyncio.sleep(0.01)  # sent, not answered
    accepted.cancel()
    refused.cancel()
    assert await kept == "ok:c"
    assert orphans == [("a", "ok:a")]  # the refused one holds nothing to abort


@run_async
async def test_a_request_given_up_before_the_call_is_not_sent() -> None:
    callee = FakeCallee()
    queue: AdmissionQueue[str] = AdmissionQueue(callee.send, on_orphan=lambda i, a: pytest.fail("orphaned"))
    gone = queue.submit("a")
    gone.cancel()
    assert await queue.submit("b") == "ok:b"
    assert callee.batches == [["b"]]


@run_async
async def test_wait_for_timeout_cancels_the_future_and_the_late_acceptance_is_orphaned() -> None:
    callee = FakeCallee(delay=0.1)
    orphans: list[str] = []
    queue: AdmissionQueue[str] = AdmissionQueue(callee.send, on_orphan=lambda i, a: orphans.append(i))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(queue.submit("slow"), 0.02)
    await queue.close()
    assert orphans == ["slow"]


# -- the callee's side (Producer; these were AdmittedStreams' tests) ------------------------------------
async def _stream(items: list[Any], error: BaseException | None = None, log: list[str] | None = None,
                  gate: asyncio.Event | None = None) -> AsyncIterator[Any]:
    try:
        for i, item in enumerate(items):
            if i == 1 and gate is not None:
                await gate.wait()
            yield item
        if error is not None:
            raise error
    finally:
        if log is not None:
            log.append("finally")


async def _nobody_gone(names: list[str]) -> list[str]:
    return []


def _producer() -> Producer:
    producer = Producer("p1", is_gone=_nobody_gone, watch_period_s=0.01)
    producer.hub.linger_s = 0.05
    return producer


def _job(key: str, stream: AsyncIterator[Any]) -> Job:
    """A job whose later items go to the mailbox of consumer ``c1`` as they are."""
    return Job(key, "c1", stream, wrap=lambda item: [item])


async def _admit(producer: Producer, key: str, stream: AsyncIterator[Any]) -> Admission:
    """One request admitted alone (a batch of one)."""
    [answer] = await producer.submit(AdmissionBatch([key]), lambda k: _job(k, stream))
    return answer


async def _mailbox(producer: Producer, consumer: str = "c1") -> list[Any]:
    """Everything waiting in ``consumer``'s mailbox, read through its attach."""
    items: list[Any] = []
    stream = producer.attach(consumer)
    assert (await anext(stream)).items == []  # the hello
    while producer.hub.num_pending():
        items += (await asyncio.wait_for(anext(stream), 1)).items
    await stream.aclose()
    return items


@run_async
async def test_admit_answers_with_the_first_item_and_hands_on_the_rest() -> None:
    producer = _producer()
    gate = asyncio.Event()
    answer = await _admit(producer, "r1", _stream(["start", "x", "y"], gate=gate))
    assert answer == Admission(item="start") and len(producer) == 1
    gate.set()
    while len(producer):
        await asyncio.sleep(0)
    assert await _mailbox(producer) == ["x", "y"]  # the rest, in the consumer's mailbox; no failure
    await assert_no_leaks([], [])
    assert len(producer.hub) == 0 and len(producer.consumers) == 0


@run_async
async def test_an_error_before_the_first_item_is_the_answer_and_after_it_a_failure() -> None:
    producer = _producer()
    refused = await _admit(producer, "r1", _stream([], error=KeyError("full")))
    assert isinstance(refused.error, KeyError) and refused.item is None
    accepted = await _admit(producer, "r2", _stream(["start"], error=OSError("lost")))
    assert accepted.item == "start"
    while len(producer):
        await asyncio.sleep(0)
    failed = [i for i in await _mailbox(producer) if isinstance(i, RoutedError)]
    assert [(f.request_id, type(f.error)) for f in failed] == [("r2", OSError)]
    empty = await _admit(producer, "r3", _stream([]))
    assert isinstance(empty.error, RuntimeError)


@run_async
async def test_cancel_runs_the_streams_finally_and_unknown_ids_are_ignored() -> None:
    producer = _producer()
    log: list[str] = []
    never = asyncio.Event()
    answer = await _admit(producer, "r1", _stream(["start", "x"], log=log, gate=never))
    assert answer.item == "start"
    assert producer._cancel_tasks(["nope"]) == 0  # the default end: unknown ids are ignored
    producer.end(["r1", "nope"])
    while len(producer):
        await asyncio.sleep(0)
    assert log == ["finally"]
    assert producer._cancel_tasks(["r1"]) == 0, "an ended request is unknown"


@run_async
async def test_fire_and_forget_runs_outside_the_callers_context_and_swallows_failures() -> None:
    seen: list[str] = []

    async def call() -> None:
        seen.append(REQUEST.get())
        raise ConnectionError("gone")

    REQUEST.set("request-1")
    await fire_and_forget(call, "test")
    assert seen == [""]


# -- what replaced the per-request stream in the channels ------------------------------------------------
def test_an_engine_mailbox_merges_outputs_and_keeps_errors_last() -> None:
    err = RoutedError("a", RuntimeError("step failed"))
    items = [EngineOutput("a", [1]), err, EngineOutput("b", [2]), EngineOutput("a", [3])]
    merged = merge_channel_items(items)
    assert [(o.request_id, o.new_token_ids) for o in merged[:2]] == [("a", [1, 3]), ("b", [2])]
    assert merged[2] is err


@run_async
async def test_a_routed_error_fails_the_request_after_the_outputs_before_it() -> None:
    async def attach(replica: str) -> AsyncIterator[ChannelBatch]:
        yield ChannelBatch(replica, [])
        yield ChannelBatch(replica, [EngineOutput("a", [7]), RoutedError("a", RuntimeError("engine died")),
                                     EngineOutput("b", [8], finish_reason="length")])
        await asyncio.Event().wait()

    client = ChannelClient(attach, lambda r: RuntimeError(f"lost {r}"))
    a, b = client.register(["a"]), client.register(["b"])
    client.bind(a, "e1")
    client.bind(b, "e1")
    assert [o.new_token_ids for o in await a.get()] == [[7]]
    with pytest.raises(RuntimeError, match="engine died"):
        await a.get()
    assert (await b.get())[0].finish_reason == "length"


@run_async
async def test_a_batch_admitted_frame_stream_cancels_once_and_not_after_its_summary() -> None:
    """Now a :class:`~stages.transport.consumer.FrameCall`: its cancel is an abort by id to the
    Egress replica that accepted it, sent once; after the summary nothing is left to cancel."""
    egress = FakeEgress("g1")
    handle = FakeHandle([egress])
    consumer = Consumer(handle, "ingress-1", lost)
    stream = consumer.open_frames(generation_job("r1"))
    await stream.start(2)
    stream.cancel()
    stream.cancel()
    await wait_until(lambda: egress.finally_ran == ["r1"])
    assert [(a.replica, a.request_ids) for a, _ in handle.log.aborts] == [("g1", ["r1"])]
    assert egress.ended == [["r1"]]

    finished = consumer.open_frames(generation_job("r2"))
    await finished.start(2)
    egress.send("r2", summary(), END)
    assert await asyncio.wait_for(finished.__anext__(), 2) == summary()
    finished.cancel()  # the request has ended in Egress: nothing to cancel
    assert [(a.replica, a.request_ids) for a, _ in handle.log.aborts] == [("g1", ["r1"])]
    await assert_no_leaks([consumer], [egress])


@run_async
async def test_a_stream_cancelled_before_it_ever_ran_answers_instead_of_hanging() -> None:
    producer = _producer()
    ran: list[str] = []

    async def stream() -> AsyncIterator[Any]:
        ran.append("ran")
        yield "start"

    admit = asyncio.create_task(_admit(producer, "r1", stream()))
    while not len(producer):  # admit has created the job's task, which has not run yet
        await asyncio.sleep(0)
    assert ran == []
    producer.end(["r1"])
    answer = await asyncio.wait_for(admit, 1.0)
    assert isinstance(answer.error, RuntimeError) and len(producer) == 0 and ran == []


@run_async
async def test_a_lost_channel_still_lets_the_frame_stream_cancel_the_job() -> None:
    """A channel that failed (attach error, Egress replica looks gone) is not the job ending in
    Egress: cancelling afterwards still sends the cancel (a no-op if Egress is really gone)."""
    egress = FakeEgress("g1")
    handle = FakeHandle([egress])
    handle.attach_error = ConnectionError("attach failed")
    consumer = Consumer(handle, "ingress-1", lost)
    stream = consumer.open_frames(generation_job("r1"))
    await stream.start(2)
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(stream.__anext__(), 2)
    assert not stream.finished
    stream.cancel()
    await wait_until(lambda: egress.finally_ran == ["r1"])
    assert [(a.replica, a.request_ids) for a, _ in handle.log.aborts] == [("g1", ["r1"])]
    # (no leak check here: the failed attach leaves the consumer's empty mailbox behind, see
    # test_producer.py::test_a_mailbox_no_attach_drains_is_not_kept_after_its_requests_end)
