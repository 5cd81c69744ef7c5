"""The callee side of a hop (stages/transport/producer.py), without Ray: batched admission into
jobs, items into the consumer's mailbox, errors after the acceptance in order, ending by key,
forwarding aborts, a consumer dying, whole bodies in parts, stats, and nothing left behind."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
from collections.abc import AsyncIterator
from typing import Any

import pytest

from stages.api.render import renderer
from stages.transport import channel, chunking
from stages.transport import producer as producer_module
from stages.transport.consumer import Consumer
from stages.transport.messages import (
    AbortRequest,
    AdmissionBatch,
    BodyPart,
    ChannelBatch,
    EngineOutput,
    RoutedError,
    RoutedFrame,
    StreamFrame,
    StreamStart,
    StreamSummary,
)
from stages.transport.producer import Producer, frames
from tests.unit.transport.fakes import (
    END,
    FakeDirectory,
    FakeEgress,
    FakeEngine,
    FakeHandle,
    assert_no_leaks,
    engine_request,
    frame,
    generation_job,
    leaks,
    lost,
    run_async,
    summary,
    wait_until,
)

#: Ray Serve's limit on one message between deployments.
MESSAGE_LIMIT = 4 * 1024 * 1024


class Reader:
    """A consumer's attach stream to ``producer``, read in the background until it ends."""

    def __init__(self, producer: Producer, consumer: str) -> None:
        self.batches: list[ChannelBatch] = []
        self.task = asyncio.ensure_future(self._run(producer, consumer))

    async def _run(self, producer: Producer, consumer: str) -> None:
        async for batch in producer.attach(consumer):
            self.batches.append(pickle.loads(pickle.dumps(batch)))

    @property
    def items(self) -> list[Any]:
        return [item for batch in self.batches for item in batch.items]

    async def ended(self) -> None:
        await asyncio.wait_for(self.task, 3)


def routed(items: list[Any]) -> list[tuple[str, Any]]:
    """(request id, what it carried) per Egress channel item."""
    out = []
    for i in items:
        if isinstance(i, RoutedError):
            out.append((i.request_id, repr(i.error)))
        elif isinstance(i.item, StreamFrame):
            out.append((i.request_id, i.item.data))
        else:
            out.append((i.request_id, type(i.item).__name__))
    return out


# -- admission ------------------------------------------------------------------------------------------
@run_async
async def test_each_request_of_a_batch_gets_its_own_acceptance_or_refusal() -> None:
    egress = FakeEgress("egress-A")
    egress.refuse["r2"] = KeyError("queue full")
    replies = await egress.submit(AdmissionBatch([generation_job(r) for r in ("r1", "r2", "r3")]))
    assert [r.error for r in (replies[0], replies[2])] == [None, None]
    assert replies[0].item == StreamStart("engine-0", ["r1"], 3, egress_replica="egress-A")
    assert replies[2].item == StreamStart("engine-0", ["r3"], 3, egress_replica="egress-A")
    assert replies[1].item is None and isinstance(replies[1].error, KeyError)
    assert len(egress.producer) == 2 and "r2" in egress.finally_ran, "the refused job is over"
    stats = egress.producer.stats()
    assert (stats["admission_calls"], stats["admission_requests"], stats["admitted_streams"]) == (1, 3, 2)

    reader = Reader(egress.producer, "ingress-1")
    egress.send("r3", frame("c"), summary(), END)
    egress.send("r1", summary(), END)
    await reader.ended()
    assert routed(reader.items) == [("r3", "data: c\n\n"), ("r3", "StreamSummary"), ("r1", "StreamSummary")]
    await assert_no_leaks([], [egress])


@run_async
async def test_a_job_that_ends_or_is_ended_before_its_first_item_is_refused() -> None:
    egress = FakeEgress("egress-A")
    hold = egress.hold("r2")

    async def nothing() -> AsyncIterator[Any]:
        return
        yield

    replies = asyncio.ensure_future(egress.producer.submit(
        AdmissionBatch([generation_job("r1"), generation_job("r2")]),
        lambda job: dataclasses.replace(egress.job(job), items=nothing()) if job.engine_request.request_id == "r1"
        else egress.job(job)))
    await wait_until(lambda: "r2" in egress.started)
    egress.producer.end(["r2"])  # e.g. its consumer gave up and aborted it while it waited
    r1, r2 = await asyncio.wait_for(replies, 2)
    assert isinstance(r1.error, RuntimeError) and "ended before it was accepted" in str(r1.error)
    assert isinstance(r2.error, RuntimeError) and "cancelled before it was accepted" in str(r2.error)
    assert not hold.is_set() and egress.finally_ran == ["r2"]
    await asyncio.sleep(0.05)
    assert len(egress.producer) == 0 and len(egress.producer.consumers) == 0


# -- items after the acceptance -----------------------------------------------------------------------------
@run_async
async def test_items_after_acceptance_go_to_their_consumers_mailbox_in_order() -> None:
    egress = FakeEgress("egress-A")
    jobs = [generation_job("r1", "ingress-1"), generation_job("r2", "ingress-2"), generation_job("r3", "ingress-1")]
    await egress.submit(AdmissionBatch(jobs))
    for i in range(3):
        for rid in ("r1", "r2", "r3"):
            egress.send(rid, frame(f"{rid}.{i}"))
    for rid in ("r1", "r2", "r3"):
        egress.send(rid, summary(), END)
    one, two = Reader(egress.producer, "ingress-1"), Reader(egress.producer, "ingress-2")
    await one.ended()
    await two.ended()
    for reader, rids in ((one, ("r1", "r3")), (two, ("r2",))):
        assert {rid for rid, _ in routed(reader.items)} == set(rids), "only its own requests' items"
        for rid in rids:
            assert [x for r, x in routed(reader.items) if r == rid] == [
                *(f"data: {rid}.{i}\n\n" for i in range(3)), "StreamSummary"]
    await assert_no_leaks([], [egress])


@run_async
async def test_an_error_after_acceptance_is_a_routed_error_after_the_frames_before_it() -> None:
    egress = FakeEgress("egress-A")
    await egress.submit(AdmissionBatch([generation_job("r1"), generation_job("r2")]))
    egress.send("r1", frame("a"), frame("b"), RuntimeError("the engine went away"))
    egress.send("r2", frame("x"), summary(), END)
    reader = Reader(egress.producer, "ingress-1")
    await reader.ended()
    assert [x for r, x in routed(reader.items) if r == "r1"] == [
        "data: a\n\n", "data: b\n\n", repr(RuntimeError("the engine went away"))]
    assert [x for r, x in routed(reader.items) if r == "r2"] == ["data: x\n\n", "StreamSummary"]
    await assert_no_leaks([], [egress])


@run_async
async def test_an_engine_error_after_acceptance_comes_after_the_outputs_before_it() -> None:
    engine = FakeEngine("engine-A")
    replies = await engine.submit(AdmissionBatch([engine_request("r1"), engine_request("r2")]))
    assert [[o.replica for o in r.item] for r in replies] == [["engine-A"], ["engine-A"]]
    engine.push("r1", EngineOutput("r1", [1]))  # from the step delivery
    engine.send("r1", [EngineOutput("r1", [2])], RuntimeError("step failed"))  # from the job
    engine.push("r2", EngineOutput("r2", [5]))
    await wait_until(lambda: "r1" in engine.finally_ran)
    reader = Reader(engine.producer, "egress-1")
    await wait_until(lambda: len(reader.batches) >= 2)
    batch = reader.batches[1].items
    assert [(o.request_id, o.new_token_ids) for o in batch[:2]] == [("r1", [1, 2]), ("r2", [5])]
    assert isinstance(batch[2], RoutedError) and batch[2].request_id == "r1"
    assert "step failed" in str(batch[2].error) and len(batch) == 3
    engine.push("r2", EngineOutput("r2", [6], finish_reason="stop"))
    engine.send("r2", END)
    await reader.ended()
    await assert_no_leaks([], [engine])


# -- ending requests early ---------------------------------------------------------------------------------
@run_async
async def test_end_by_key_runs_the_deployments_end_and_unknown_keys_are_ignored() -> None:
    egress = FakeEgress("egress-A")
    await egress.submit(AdmissionBatch([generation_job("r1"), generation_job("r2")]))
    reader = Reader(egress.producer, "ingress-1")
    await egress.producer.abort(AbortRequest("egress-A", ["r1", "nope"]))
    await wait_until(lambda: egress.finally_ran == ["r1"])
    assert egress.ended == [["r1", "nope"]] and len(egress.producer) == 1
    egress.send("r2", summary(), END)
    await reader.ended()
    await egress.producer.abort(AbortRequest("egress-A", ["r2"]))  # finished: ignored
    assert egress.finally_ran == ["r1", "r2"]
    await assert_no_leaks([], [egress])


@run_async
async def test_a_deployments_own_end_may_be_a_coroutine() -> None:
    egress = FakeEgress("egress-A")
    ended: list[list[str]] = []

    async def end(keys: list[str]) -> None:
        await asyncio.sleep(0)
        ended.append(keys)
        egress.producer._cancel_tasks(keys)

    egress.producer.set_end(end)
    await egress.submit(AdmissionBatch([generation_job("r1")]))
    egress.producer.end(["r1"])
    await wait_until(lambda: egress.finally_ran == ["r1"])
    assert ended == [["r1"]]


@run_async
async def test_an_abort_naming_another_replica_is_forwarded_to_the_directory() -> None:
    """A draining replica is no routing candidate: an abort naming it lands on another one, which
    hands it to the directory; the named replica takes it there and ends the request."""
    directory = FakeDirectory()
    a = FakeEgress("egress-A", directory=directory)
    b = FakeEgress("egress-B", directory=directory)
    await a.submit(AdmissionBatch([generation_job("r1")]))
    await b.submit(AdmissionBatch([generation_job("r2")]))
    readers = [Reader(a.producer, "ingress-1"), Reader(b.producer, "ingress-1")]
    await b.producer.abort(AbortRequest("egress-A", ["r1"]))
    assert [(f.replica, f.request_ids) for f in directory.forwarded] == [("egress-A", ["r1"])]
    assert b.ended == [] and a.ended == [] and len(a.producer) == 1, "nothing ended on the wrong replica"
    a.producer.poll_forwarded(period_s=0.01)
    await wait_until(lambda: a.finally_ran == ["r1"])
    assert a.ended == [["r1"]] and directory.held == {}
    await b.producer.abort(AbortRequest("egress-B", ["r2"]))  # its own: ended here
    assert b.ended == [["r2"]] and len(directory.forwarded) == 1
    for reader in readers:
        await reader.ended()
    assert a.producer._poll is not None
    a.producer.close()
    a.producer.close()  # idempotent
    assert a.producer._poll is None
    await assert_no_leaks([], [a, b])


@run_async
async def test_taking_forwarded_aborts_survives_a_directory_failure() -> None:
    directory = FakeDirectory()
    calls = 0

    async def flaky(replica: str) -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("directory restarting")
        return await FakeDirectory._take(directory, replica)

    directory.take_aborts = flaky
    egress = FakeEgress("egress-A", directory=directory)
    await egress.submit(AdmissionBatch([generation_job("r1")]))
    directory.held["egress-A"] = ["r1"]
    egress.producer.poll_forwarded(period_s=0.01)
    await wait_until(lambda: egress.finally_ran == ["r1"])
    assert calls >= 2 and egress.ended == [["r1"]]
    egress.producer.close()
    await assert_no_leaks([], [egress])


@run_async
async def test_a_consumer_that_died_has_its_jobs_ended_and_its_mailbox_dropped() -> None:
    egress = FakeEgress("egress-A", watch_period_s=0.01)
    await egress.submit(AdmissionBatch([generation_job("d1", "ingress-dead"), generation_job("l1", "ingress-live"),
                                        generation_job("d2", "ingress-dead")]))
    dead_attach = egress.producer.attach("ingress-dead")
    assert (await anext(dead_attach)).items == []
    pending = asyncio.ensure_future(anext(dead_attach))
    live = Reader(egress.producer, "ingress-live")
    egress.send("d1", frame("x"))
    await asyncio.wait_for(asyncio.shield(pending), 1)  # its attach took it (Serve holds it for nobody)
    await wait_until(lambda: egress.liveness_checks != [])
    assert sorted(egress.liveness_checks[0]) == ["ingress-dead", "ingress-live"]
    assert egress.finally_ran == []

    egress.dead.add("ingress-dead")
    await wait_until(lambda: sorted(egress.finally_ran) == ["d1", "d2"])
    assert egress.producer.stats()["consumer_gone_aborts"] == 2
    assert "ingress-dead" not in egress.producer.hub._boxes, "its mailbox is dropped"
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(dead_attach), 1)  # its attach ends
    egress.producer.push("ingress-dead", [RoutedFrame("d1", frame("late"))])  # nobody reads it: dropped
    assert egress.producer.hub.num_pending() == 0
    assert len(egress.producer) == 1, "another consumer's job is untouched"

    egress.send("l1", summary(), END)
    await live.ended()
    assert routed(live.items) == [("l1", "StreamSummary")]
    await assert_no_leaks([], [egress])


# -- resumable jobs: detach, retarget, record, keep, on_end ----------------------------------------------------
class Resumable:
    """Starts FakeEgress jobs with ``record`` (every list of items due), ``keep`` and ``on_end``."""

    def __init__(self, egress: FakeEgress, keep: bool = True) -> None:
        self.egress = egress
        self.recorded: list[Any] = []
        self.keep_answer = keep
        self.keep_calls = 0
        self.ends = 0

    def _keep(self) -> bool:
        self.keep_calls += 1
        return self.keep_answer

    def _end(self) -> None:
        self.ends += 1

    def start(self, job: Any) -> producer_module.Job:
        return dataclasses.replace(self.egress.job(job), record=self.recorded.extend, keep=self._keep,
                                   on_end=self._end)

    async def submit(self, *jobs: Any) -> None:
        replies = await self.egress.producer.submit(AdmissionBatch(list(jobs)), self.start)
        assert all(r.error is None for r in replies)


@run_async
async def test_a_detached_job_records_its_items_and_pushes_them_to_no_mailbox() -> None:
    """After detach, a job's items reach its record callback only, never a consumer's mailbox."""
    egress = FakeEgress("egress-A")
    jobs = Resumable(egress)
    await jobs.submit(generation_job("r1"))
    reader = Reader(egress.producer, "ingress-1")
    egress.send("r1", frame("a"))
    await wait_until(lambda: len(reader.items) == 1)
    assert egress.producer.detach("r1") is True
    assert egress.producer.detach("nope") is False
    assert len(egress.producer.consumers) == 0, "no consumer to watch while detached"
    egress.send("r1", frame("b"))
    await wait_until(lambda: len(jobs.recorded) == 2)
    await reader.ended()  # its mailbox has no live request left: the attach ends
    assert routed(reader.items) == [("r1", "data: a\n\n")]
    assert routed(jobs.recorded) == [("r1", "data: a\n\n"), ("r1", "data: b\n\n")]
    assert egress.producer.hub.num_pending() == 0 and egress.finally_ran == []
    egress.send("r1", summary(), END)
    await wait_until(lambda: egress.finally_ran == ["r1"])
    assert routed(jobs.recorded)[-1] == ("r1", "StreamSummary")
    await assert_no_leaks([], [egress])


@run_async
async def test_retarget_sends_the_replayed_items_first_then_the_live_ones() -> None:
    """retarget: the new consumer's mailbox gets the missed items, then the job's own, in order."""
    egress = FakeEgress("egress-A")
    jobs = Resumable(egress)
    await jobs.submit(generation_job("r1"))
    egress.send("r1", frame("a"))
    await wait_until(lambda: len(jobs.recorded) == 1)
    egress.producer.detach("r1")
    egress.send("r1", frame("b"))
    await wait_until(lambda: len(jobs.recorded) == 2)
    egress.producer.retarget("r1", "ingress-2", list(jobs.recorded))
    assert len(egress.producer.consumers) == 1, "the new consumer is watched"
    egress.send("r1", frame("c"), summary(), END)
    reader = Reader(egress.producer, "ingress-2")
    await reader.ended()
    assert routed(reader.items) == [("r1", "data: a\n\n"), ("r1", "data: b\n\n"), ("r1", "data: c\n\n"),
                                    ("r1", "StreamSummary")]
    assert len(jobs.recorded) == 4, "a retargeted job records on"
    await assert_no_leaks([], [egress])


@run_async
async def test_retarget_of_a_job_still_attached_moves_its_live_items_to_the_new_consumer() -> None:
    """retarget of a job with a consumer: later items go to the new one, not the old one."""
    egress = FakeEgress("egress-A")
    jobs = Resumable(egress)
    await jobs.submit(generation_job("r1", "ingress-1"))
    old = Reader(egress.producer, "ingress-1")
    egress.producer.retarget("r1", "ingress-2", [])
    egress.send("r1", frame("x"), summary(), END)
    new = Reader(egress.producer, "ingress-2")
    await new.ended()
    await old.ended()
    assert routed(new.items) == [("r1", "data: x\n\n"), ("r1", "StreamSummary")]
    assert old.items == []
    await assert_no_leaks([], [egress])


@run_async
async def test_retarget_of_a_finished_job_delivers_just_the_items() -> None:
    """A job that ended before its reconnect: retarget's items are all its new consumer gets."""
    egress = FakeEgress("egress-A")
    jobs = Resumable(egress)
    await jobs.submit(generation_job("r1"))
    egress.producer.detach("r1")
    egress.send("r1", frame("a"), summary(), END)
    await wait_until(lambda: egress.finally_ran == ["r1"])
    egress.producer.retarget("r1", "ingress-2", list(jobs.recorded))
    reader = Reader(egress.producer, "ingress-2")
    await reader.ended()
    assert routed(reader.items) == [("r1", "data: a\n\n"), ("r1", "StreamSummary")]
    assert len(egress.producer.consumers) == 0, "nothing runs: nothing to watch"
    await assert_no_leaks([], [egress])


@run_async
async def test_on_end_runs_once_when_the_job_ends_or_is_ended() -> None:
    """on_end runs exactly once per job: after its last item, or when it is cancelled."""
    egress = FakeEgress("egress-A")
    jobs = Resumable(egress)
    await jobs.submit(generation_job("r1"), generation_job("r2"))
    reader = Reader(egress.producer, "ingress-1")
    egress.send("r1", frame("a"))
    await wait_until(lambda: len(jobs.recorded) == 1)
    assert jobs.ends == 0
    egress.send("r1", summary(), END)
    await wait_until(lambda: egress.finally_ran == ["r1"])
    await asyncio.sleep(0.02)
    assert jobs.ends == 1
    egress.producer.end(["r2"])
    await wait_until(lambda: egress.finally_ran == ["r1", "r2"])
    await asyncio.sleep(0.02)
    assert jobs.ends == 2
    await reader.ended()
    await assert_no_leaks([], [egress])


@run_async
async def test_a_job_whose_consumer_died_is_detached_when_keep_says_so() -> None:
    """Consumer gone and keep() True: the job runs on detached (recording), its mailbox is dropped."""
    egress = FakeEgress("egress-A")
    jobs = Resumable(egress, keep=True)
    await jobs.submit(generation_job("r1", "ingress-dead"))
    egress.send("r1", frame("a"))
    await wait_until(lambda: len(jobs.recorded) == 1)
    egress.dead.add("ingress-dead")
    await wait_until(lambda: jobs.keep_calls == 1)
    await wait_until(lambda: "ingress-dead" not in egress.producer.hub._boxes)
    assert egress.finally_ran == [] and len(egress.producer) == 1, "not cancelled"
    assert len(egress.producer.consumers) == 0
    egress.send("r1", frame("b"))
    await wait_until(lambda: len(jobs.recorded) == 2)
    assert egress.producer.hub.num_pending() == 0, "pushed nowhere"
    egress.producer.retarget("r1", "ingress-2", list(jobs.recorded))
    egress.send("r1", summary(), END)
    reader = Reader(egress.producer, "ingress-2")
    await reader.ended()
    assert routed(reader.items) == [("r1", "data: a\n\n"), ("r1", "data: b\n\n"), ("r1", "StreamSummary")]
    assert jobs.keep_calls == 1 and jobs.ends == 1
    await assert_no_leaks([], [egress])


@run_async
async def test_a_job_whose_consumer_died_is_cancelled_when_keep_refuses() -> None:
    """Consumer gone and keep() False: the job is cancelled as any other."""
    egress = FakeEgress("egress-A")
    jobs = Resumable(egress, keep=False)
    await jobs.submit(generation_job("r1", "ingress-dead"))
    egress.dead.add("ingress-dead")
    await wait_until(lambda: egress.finally_ran == ["r1"])
    assert jobs.keep_calls == 1 and jobs.ends == 1
    await assert_no_leaks([], [egress])


# -- whole bodies in pickled slices -------------------------------------------------------------------------------
def _joined(items: list[Any]) -> Any:
    """The body the :class:`BodyPart` items among ``items`` carry, unpickled."""
    return pickle.loads(b"".join(i.data for i in items if isinstance(i, BodyPart)))


def _completion_body(chars_per_choice: int, n: int = 2) -> dict[str, Any]:
    """Egress's non-streamed completion body: its size sits inside nested ``choices``."""
    # A text of its own per choice (pickle would send one shared string once).
    choices = [{"index": i, "text": (f"word{i} " * (chars_per_choice // 6 + 1))[:chars_per_choice],
                "finish_reason": "length",
                "logprobs": {"tokens": ["word"] * 1000, "token_logprobs": [-0.5] * 1000}} for i in range(n)]
    return renderer("completion").full_response("cmpl-1", 0, "m", choices,
                         {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})


def test_frames_sends_a_whole_body_in_pickled_slices_before_its_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(producer_module, "PART_BYTES", 1000)  # read at call time
    body = {"id": "cmpl-1", "text": "é" * 3000, "tokens": list(range(2000)), "usage": {"total_tokens": 3}}
    done = summary(body)
    routed_items = frames("r1", done)
    items = [f.item for f in routed_items]
    size = len(pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL))
    parts = items[:-1]
    assert all(isinstance(p, BodyPart) for p in parts) and len(parts) == -(-size // 1000) >= 5
    assert all(len(p.data) == 1000 for p in parts[:-1]) and 0 < len(parts[-1].data) <= 1000
    assert _joined(parts) == body
    assert items[-1] == dataclasses.replace(done, body=None)
    assert done.body is body, "the summary given is left as it was"
    assert all(f.request_id == "r1" for f in routed_items)
    assert [f.nbytes for f in routed_items[:-1]] == [len(p.data) + 64 for p in parts], "exact for a body part"
    one = frame("x")
    assert [f.item for f in frames("r1", one)] == [one]
    assert [f.item for f in frames("r1", summary())] == [summary()]


def test_a_whole_body_is_sliced_at_the_real_part_size() -> None:
    body = _completion_body(1_500_000)
    parts = [f.item for f in frames("r1", summary(body))][:-1]
    assert len(parts) >= 3 and all(len(p.data) <= chunking.PART_BYTES for p in parts)
    assert all(len(p.data) == chunking.PART_BYTES for p in parts[:-1])
    assert _joined(parts) == body


async def _run_body_through_the_channel(body: dict[str, Any]) -> tuple[list[ChannelBatch], dict[str, Any]]:
    egress = FakeEgress("egress-A")
    await egress.submit(AdmissionBatch([generation_job("r1")]))
    egress.send("r1", frame("first"), summary(body), END)
    reader = Reader(egress.producer, "ingress-1")
    await reader.ended()
    items = reader.items
    assert isinstance(items[-1].item, StreamSummary) and items[-1].item.body is None
    assert items[0].item == frame("first")
    assert all(isinstance(i.item, BodyPart) for i in items[1:-1])
    joined = _joined([i.item for i in items[1:-1]])
    await assert_no_leaks([], [egress])
    return reader.batches[1:], joined


def _check_batches(batches: list[ChannelBatch], limit: int) -> None:
    """Every batch of more than one item within ``limit`` (estimated), every batch under the
    message limit (pickled)."""
    for batch in batches:
        estimated = sum(i.nbytes for i in batch.items)
        assert len(batch.items) == 1 or estimated <= limit, (len(batch.items), estimated)
        assert len(pickle.dumps(batch)) <= MESSAGE_LIMIT


def _body_parts(batches: list[ChannelBatch]) -> list[BodyPart]:
    return [i.item for b in batches for i in b.items if isinstance(i.item, BodyPart)]


@run_async
async def test_a_big_body_crosses_the_channel_in_slices_and_batches_under_the_bounds() -> None:
    """Real bounds: 1 MiB slices, 2 MiB batches, and every batch under the 4 MiB message limit."""
    n = 300_000
    body = {"id": "x", "text": "é" * 1_000_000, "tokens": list(range(n)), "token_strs": [f"t{i}" for i in range(n)]}
    batches, joined = await _run_body_through_the_channel(body)
    assert joined == body
    assert len(_body_parts(batches)) >= 4 and len(batches) >= 2
    _check_batches(batches, channel.MAX_BATCH_BYTES)


@run_async
async def test_a_body_of_many_small_slices_fills_batches_up_to_the_byte_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(producer_module, "PART_BYTES", 2048)
    monkeypatch.setattr(channel, "MAX_BATCH_BYTES", 8192)
    body = {"id": "x", "text": "abc" * 20_000, "tokens": list(range(10_000)), "n": 2}
    batches, joined = await _run_body_through_the_channel(body)
    assert joined == body
    assert all(len(p.data) <= 2048 for p in _body_parts(batches))
    sizes = [len(b.items) for b in batches]
    assert sum(sizes) > 40 and max(sizes) >= 3, sizes  # the bound, not the item count, cut them
    assert all(size < channel.MAX_BATCH_ITEMS for size in sizes)
    _check_batches(batches, 8192)


@run_async
async def test_a_big_completion_body_crosses_the_channel_under_the_message_limit() -> None:
    """A realistic 6 MB OpenAI-shaped body (two choices of 3 MB text, with logprobs): split_reply
    could not cut it (its size sits inside ``choices``); pickled slices do."""
    body = _completion_body(3_000_000)
    assert len(pickle.dumps(body)) > 6_000_000
    batches, joined = await _run_body_through_the_channel(body)
    assert joined == body
    parts = _body_parts(batches)
    assert len(parts) >= 6 and all(len(p.data) <= chunking.PART_BYTES for p in parts)
    _check_batches(batches, channel.MAX_BATCH_BYTES)


# -- counters and leaks --------------------------------------------------------------------------------------------
@run_async
async def test_stats_count_calls_requests_batches_and_items() -> None:
    egress = FakeEgress("egress-A")
    egress.refuse["r3"] = KeyError("full")
    await egress.submit(AdmissionBatch([generation_job("r1"), generation_job("r2")]))
    await egress.submit(AdmissionBatch([generation_job("r3")]))
    egress.send("r1", frame("a"), frame("b"))
    egress.send("r2", frame("c"))
    await wait_until(lambda: egress.producer.hub.num_pending() == 3)
    stats = egress.producer.stats()
    assert stats == {"admitted_streams": 2, "admission_calls": 2, "admission_requests": 3,
                     "consumer_gone_aborts": 0, "channel_mailboxes": 1, "channel_pending": 3,
                     "channel_batches": 0, "channel_items": 0}
    reader = Reader(egress.producer, "ingress-1")
    await wait_until(lambda: len(reader.batches) == 2)  # the hello, then all three items
    egress.send("r1", summary(), END)
    egress.send("r2", summary(), END)
    await reader.ended()
    assert len(reader.batches) >= 3
    stats = egress.producer.stats()
    assert stats["admitted_streams"] == 0 and stats["channel_pending"] == 0 and stats["channel_mailboxes"] == 0
    assert stats["channel_batches"] == len(reader.batches) - 1, "hellos are not counted"
    assert stats["channel_items"] == len(reader.items) == 5
    await assert_no_leaks([], [egress])


@run_async
async def test_a_mailbox_no_attach_drains_is_dropped_after_the_unclaimed_ttl() -> None:
    """A refused request opened its consumer's mailbox; nobody attaches: it is kept for the
    unclaimed TTL (its consumer may still come), then dropped."""
    egress = FakeEgress("egress-A", unclaimed_ttl_s=0.3)
    egress.refuse["r1"] = KeyError("full")
    [refused] = await egress.submit(AdmissionBatch([generation_job("r1")]))
    assert isinstance(refused.error, KeyError)
    await asyncio.sleep(0.1)
    assert egress.producer.stats()["channel_mailboxes"] == 1, "kept before the TTL"
    await wait_until(lambda: len(egress.producer.hub) == 0, timeout=1)
    assert egress.producer.stats()["channel_mailboxes"] == 0
    assert leaks([], [egress]) == []


@run_async
async def test_items_of_a_short_request_wait_for_an_attach_within_the_unclaimed_ttl() -> None:
    """A request that ended before its consumer's attach opened: its items wait in the mailbox;
    an attach within the TTL takes them, and the mailbox goes with that attach."""
    egress = FakeEgress("egress-A", unclaimed_ttl_s=0.3)
    await egress.submit(AdmissionBatch([generation_job("r1")]))
    egress.send("r1", frame("a"), summary(), END)
    await wait_until(lambda: egress.finally_ran == ["r1"])
    await asyncio.sleep(0.15)
    assert egress.producer.hub.num_pending() == 2, "kept before the TTL"
    reader = Reader(egress.producer, "ingress-1")
    await wait_until(lambda: len(reader.items) == 2)
    await asyncio.sleep(0.3)  # past the TTL while attached: the attach's mailbox is not taken from it
    assert routed(reader.items) == [("r1", "data: a\n\n"), ("r1", "StreamSummary")]
    await reader.ended()
    await assert_no_leaks([], [egress])


@run_async
async def test_unclaimed_items_are_dropped_with_their_mailbox_after_the_ttl() -> None:
    egress = FakeEgress("egress-A", unclaimed_ttl_s=0.2)
    await egress.submit(AdmissionBatch([generation_job("r1")]))
    egress.send("r1", frame("a"), summary(), END)
    await wait_until(lambda: egress.finally_ran == ["r1"])
    assert egress.producer.hub.num_pending() == 2
    await wait_until(lambda: len(egress.producer.hub) == 0, timeout=1)
    assert egress.producer.hub.num_pending() == 0
    await assert_no_leaks([], [egress])


@run_async
async def test_an_earlier_requests_ttl_does_not_drop_a_later_requests_items() -> None:
    egress = FakeEgress("egress-A", unclaimed_ttl_s=0.4)
    egress.refuse["r1"] = KeyError("full")
    await egress.submit(AdmissionBatch([generation_job("r1")]))  # its close starts a TTL
    await asyncio.sleep(0.25)
    await egress.submit(AdmissionBatch([generation_job("r2")]))
    egress.send("r2", frame("a"), summary(), END)
    await wait_until(lambda: egress.finally_ran == ["r1", "r2"])
    await asyncio.sleep(0.25)  # past r1's deadline, well within r2's
    assert egress.producer.hub.num_pending() == 2, "r2's items were dropped before its TTL"


@run_async
async def test_an_orphaned_request_leaves_nothing_in_the_producer() -> None:
    egress = FakeEgress("egress-A")
    handle = FakeHandle([egress])
    consumer = Consumer(handle, "ingress-1", lost)
    hold = egress.hold("r1")
    call = consumer.open_frames(generation_job("r1"))
    with pytest.raises(TimeoutError):
        await call.start(0.05)
    egress.send("r1", frame("made before the abort came"))
    hold.set()
    await wait_until(lambda: egress.finally_ran == ["r1"])
    assert egress.ended == [["r1"]]
    await assert_no_leaks([consumer], [egress])
