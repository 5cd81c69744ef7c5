"""The caller side of a hop (stages/transport/consumer.py), without Ray: a real
:class:`~stages.transport.consumer.Consumer` talking through a fake Serve handle to real producers
(:class:`~stages.transport.producer.Producer` in fake Egress and engine replicas) in the same event
loop, so every round trip (submit, attach, abort) runs for real, messages pickled on the way."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest

from stages.api.render import renderer
from stages.transport import channel
from stages.transport import producer as producer_module
from stages.transport.consumer import Consumer
from stages.transport.messages import (
    BodyPart,
    EngineOutput,
    StreamStart,
    StreamSummary,
)
from tests.unit.transport.fakes import (
    END,
    FakeDirectory,
    FakeEgress,
    FakeEngine,
    FakeHandle,
    LostError,
    assert_no_leaks,
    engine_request,
    frame,
    generation_job,
    lost,
    run_async,
    summary,
    wait_until,
)


def aborts(handle: FakeHandle) -> list[tuple[str, list[str], str]]:
    """(replica named, ids, replica reached) per abort the handle carried."""
    return [(a.replica, a.request_ids, reached) for a, reached in handle.log.aborts]


async def read_until_summary(call: Any) -> list[Any]:
    items = []
    while True:
        item = await asyncio.wait_for(anext(call), 3)
        items.append(item)
        if isinstance(item, StreamSummary):
            return items


def frames_setup(*names: str, **kwargs: Any) -> tuple[list[FakeEgress], FakeHandle, Consumer]:
    stages = [FakeEgress(name, **kwargs) for name in names or ("egress-A",)]
    handle = FakeHandle(stages)
    return stages, handle, Consumer(handle, "ingress-1", lost)


def outputs_setup(n_engines: int = 1) -> tuple[list[FakeEngine], FakeHandle, Consumer]:
    engines = [FakeEngine(f"engine-{'AB'[i]}") for i in range(n_engines)]
    handle = FakeHandle(engines)
    return engines, handle, Consumer(handle, "egress-1", lost)


# -- acceptance and refusal -------------------------------------------------------------------------------
@run_async
async def test_requests_of_one_loop_turn_share_a_submit_and_each_is_accepted_or_refused() -> None:
    [egress], handle, consumer = frames_setup()
    egress.refuse["r2"] = KeyError("queue full")
    calls = {rid: consumer.open_frames(generation_job(rid)) for rid in ("r1", "r2", "r3")}
    starts = await asyncio.gather(*(c.start(2) for c in calls.values()), return_exceptions=True)
    assert handle.log.submits == [("egress-A", ["r1", "r2", "r3"])], "one call for the loop turn"
    assert starts[0] == StreamStart("engine-0", ["r1"], 3, egress_replica="egress-A")
    assert starts[2] == StreamStart("engine-0", ["r3"], 3, egress_replica="egress-A")
    assert isinstance(starts[1], KeyError)
    assert calls["r1"].replica == calls["r3"].replica == "egress-A"
    assert consumer.open_calls == 2 and aborts(handle) == []
    for rid in ("r1", "r3"):
        egress.send(rid, frame(rid), summary(), END)
    for rid in ("r1", "r3"):
        got = await read_until_summary(calls[rid])
        assert got == [frame(rid), summary()]
    assert [(named, reached) for named, reached, _ in handle.log.attaches] == [("egress-A", "egress-A")]
    assert aborts(handle) == []
    await assert_no_leaks([consumer], [egress])


@run_async
async def test_an_engine_request_is_accepted_with_its_first_outputs_and_refused_with_its_error() -> None:
    [engine], handle, consumer = outputs_setup()
    engine.refuse["bad"] = KeyError("full")
    good, bad = consumer.open_outputs(engine_request("good", n=2)), consumer.open_outputs(engine_request("bad"))
    first = await good.start(2)
    assert [(o.request_id, o.replica) for o in first] == [("good-0", "engine-A"), ("good-1", "engine-A")]
    with pytest.raises(KeyError):
        await bad.start(2)
    assert good.replica == "engine-A" and handle.log.submits == [("engine-A", ["good", "bad"])]
    good.cancel()
    await wait_until(lambda: engine.finally_ran == ["bad", "good-0"])
    await assert_no_leaks([consumer], [engine])


# -- items after the acceptance ------------------------------------------------------------------------------
@run_async
async def test_frames_reach_the_right_call_in_order_over_one_attach_per_replica() -> None:
    (a, b), handle, consumer = frames_setup("egress-A", "egress-B")
    handle.route = lambda batch: "egress-B" if batch.items[0].engine_request.request_id == "r2" else "egress-A"
    calls = {}
    for rid in ("r1", "r2", "r3"):  # one submit each (r2 goes elsewhere)
        calls[rid] = consumer.open_frames(generation_job(rid))
        await calls[rid].start(2)
    assert [c.replica for c in calls.values()] == ["egress-A", "egress-B", "egress-A"]
    for i in range(4):
        for rid, stage in (("r1", a), ("r2", b), ("r3", a)):
            stage.send(rid, frame(f"{rid}.{i}"))
        await asyncio.sleep(0)
    for rid, stage in (("r1", a), ("r2", b), ("r3", a)):
        stage.send(rid, summary(), END)
    for rid, call in calls.items():
        assert await read_until_summary(call) == [*(frame(f"{rid}.{i}") for i in range(4)), summary()]
    assert sorted((named, reached) for named, reached, _ in handle.log.attaches) == [
        ("egress-A", "egress-A"), ("egress-B", "egress-B")]
    assert any({i.request_id for i in batch.items} == {"r1", "r3"} for _, batch in handle.log.batches)
    await assert_no_leaks([consumer], [a, b])


@run_async
async def test_outputs_reach_the_right_call_merged_per_choice() -> None:
    [engine], handle, consumer = outputs_setup()
    one, two = consumer.open_outputs(engine_request("a", n=2)), consumer.open_outputs(engine_request("b"))
    streams = [one.outputs(), two.outputs()]
    firsts = [await anext(s) for s in streams]
    assert [[o.request_id for o in f] for f in firsts] == [["a-0", "a-1"], ["b"]]
    engine.push("a-0", EngineOutput("a-0", [1], index=0), EngineOutput("b", [7]), EngineOutput("a-1", [4], index=1))
    engine.push("a-0", EngineOutput("a-0", [2], index=0, finish_reason="length"))
    engine.send("b", [EngineOutput("b", [8], finish_reason="stop")], END)

    async def collect(stream: Any) -> list[tuple[str, list[int], str | None]]:
        got = []
        async for outs in stream:
            got += [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs]
        return got

    b_outs = await asyncio.wait_for(collect(streams[1]), 3)
    assert b_outs == [("b", [7, 8], "stop")] or b_outs == [("b", [7], None), ("b", [8], "stop")]
    assert two.finished and not one.finished
    engine.push("a-0", EngineOutput("a-1", [5], index=1, finish_reason="stop"))
    a_outs = await asyncio.wait_for(collect(streams[0]), 3)
    assert [t for rid, toks, _ in a_outs if rid == "a-0" for t in toks] == [1, 2]
    assert [t for rid, toks, _ in a_outs if rid == "a-1" for t in toks] == [4, 5]
    assert one.finished
    engine.send("a-0", END)
    one.cancel()
    two.cancel()
    assert aborts(handle) == [], "finished calls send nothing"
    await assert_no_leaks([consumer], [engine])


@run_async
async def test_an_error_after_acceptance_arrives_after_the_frames_before_it() -> None:
    [egress], handle, consumer = frames_setup()
    call = consumer.open_frames(generation_job("r1"))
    await call.start(2)
    egress.send("r1", frame("a"), frame("b"), RuntimeError("the engine went away"))
    assert await asyncio.wait_for(anext(call), 2) == frame("a")
    assert await asyncio.wait_for(anext(call), 2) == frame("b")
    with pytest.raises(RuntimeError, match="the engine went away"):
        await asyncio.wait_for(anext(call), 2)
    assert call.finished and consumer.open_calls == 0, "the error ended the request in Egress"
    call.cancel()
    assert aborts(handle) == []
    await assert_no_leaks([consumer], [egress])


@run_async
async def test_an_engine_error_after_acceptance_arrives_after_the_outputs_before_it() -> None:
    [engine], handle, consumer = outputs_setup()
    call = consumer.open_outputs(engine_request("r1"))
    stream = call.outputs()
    await anext(stream)
    engine.push("r1", EngineOutput("r1", [1]))
    engine.send("r1", [EngineOutput("r1", [2])], RuntimeError("step failed"))
    await wait_until(lambda: engine.finally_ran == ["r1"])
    got = await asyncio.wait_for(anext(stream), 2)
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in got] == [("r1", [1, 2], None)]
    with pytest.raises(RuntimeError, match="step failed"):
        await asyncio.wait_for(anext(stream), 2)
    assert call.finished
    call.cancel()  # what Egress's EngineStream.close does
    assert aborts(handle) == [] and consumer.open_calls == 0
    await assert_no_leaks([consumer], [engine])


# -- giving up --------------------------------------------------------------------------------------------------
@run_async
async def test_cancel_in_the_same_loop_turn_sends_nothing() -> None:
    [egress], handle, consumer = frames_setup()
    call = consumer.open_frames(generation_job("r1"))
    call.cancel()
    kept = consumer.open_frames(generation_job("r2"))
    await kept.start(2)
    assert handle.log.submits == [("egress-A", ["r2"])] and egress.started == ["r2"]
    await wait_until(lambda: len(handle.log.batches) == 1)  # its attach is open
    kept.cancel()
    await wait_until(lambda: egress.finally_ran == ["r2"])
    assert aborts(handle) == [("egress-A", ["r2"], "egress-A")]
    await assert_no_leaks([consumer], [egress])


@run_async
async def test_a_request_cancelled_right_after_acceptance_leaves_no_mailbox() -> None:
    """Cancelled before its channel's attach task first ran, it never attaches: the producer drops
    the consumer's mailbox after the unclaimed TTL (kept until then)."""
    [egress], handle, consumer = frames_setup(unclaimed_ttl_s=0.3)
    call = consumer.open_frames(generation_job("r1"))
    await call.start(2)
    call.cancel()  # the client went away as the acceptance came
    await wait_until(lambda: egress.finally_ran == ["r1"])
    assert aborts(handle) == [("egress-A", ["r1"], "egress-A")]
    await asyncio.sleep(0.1)
    assert len(egress.producer.hub) == 1 and handle.log.attaches == [], "kept before the TTL"
    await assert_no_leaks([consumer], [egress])
    assert len(egress.producer.hub) == 0


@run_async
async def test_cancel_before_acceptance_aborts_the_orphan_once_it_is_admitted() -> None:
    [egress], handle, consumer = frames_setup()
    keep = consumer.open_frames(generation_job("keep"))  # keeps the channel attached meanwhile
    await keep.start(2)
    hold = egress.hold("r1")
    call = consumer.open_frames(generation_job("r1"))
    with pytest.raises(TimeoutError):
        await call.start(0.05)  # the timeout cancels it
    assert consumer.open_calls == 1 and aborts(handle) == [] and not egress.finally_ran
    egress.send("r1", frame("made before the abort came"))
    hold.set()  # admitted after all: its acceptance comes back to nobody
    await wait_until(lambda: egress.finally_ran == ["r1"])
    await asyncio.sleep(0.05)
    # Ended exactly once: by whichever came first, its stray item or its late acceptance.
    assert aborts(handle) == [("egress-A", ["r1"], "egress-A")] and egress.ended == [["r1"]]
    call.cancel()
    egress.send("keep", summary(), END)
    assert await read_until_summary(keep) == [summary()]
    assert len(aborts(handle)) == 1
    await assert_no_leaks([consumer], [egress])


@run_async
async def test_a_cancelled_start_is_a_cancel_before_acceptance() -> None:
    [engine], handle, consumer = outputs_setup()
    keep = consumer.open_outputs(engine_request("keep"))
    await keep.start(2)
    hold = engine.hold("r1-0")
    call = consumer.open_outputs(engine_request("r1", n=2))
    waiting = asyncio.ensure_future(call.start())
    await wait_until(lambda: "r1-0" in engine.started)
    waiting.cancel()  # the request that waited went away
    with pytest.raises(asyncio.CancelledError):
        await waiting
    hold.set()
    await wait_until(lambda: "r1-0" in engine.finally_ran)
    assert aborts(handle) == [("engine-A", ["r1-0", "r1-1"], "engine-A")]
    assert engine.ended == [["r1-0", "r1-1"]]
    keep.cancel()
    await wait_until(lambda: "keep" in engine.finally_ran)
    assert consumer.client.strays_aborted == 0
    await assert_no_leaks([consumer], [engine])


@run_async
async def test_cancel_after_acceptance_aborts_by_id_where_it_runs() -> None:
    (a, b), handle, consumer = frames_setup("egress-A", "egress-B")
    handle.route = lambda batch: "egress-B"
    call = consumer.open_frames(generation_job("r1"))
    await call.start(2)
    b.send("r1", frame("x"))
    assert await asyncio.wait_for(anext(call), 2) == frame("x")
    call.cancel()
    call.cancel()
    await wait_until(lambda: b.finally_ran == ["r1"])
    assert aborts(handle) == [("egress-B", ["r1"], "egress-B")] and b.ended == [["r1"]] and a.ended == []
    assert consumer.open_calls == 0 and not consumer.client._inboxes
    await assert_no_leaks([consumer], [a, b])


@run_async
async def test_cancel_after_acceptance_of_an_engine_request_aborts_every_choice() -> None:
    [engine], handle, consumer = outputs_setup()
    call = consumer.open_outputs(engine_request("r1", n=2))
    stream = call.outputs()
    await anext(stream)
    engine.push("r1-0", EngineOutput("r1-0", [3]))
    assert [o.new_token_ids for o in await asyncio.wait_for(anext(stream), 2)] == [[3]]
    call.cancel()
    await wait_until(lambda: engine.finally_ran == ["r1-0"])
    assert aborts(handle) == [("engine-A", ["r1-0", "r1-1"], "engine-A")]
    assert engine.ended == [["r1-0", "r1-1"]]
    await asyncio.sleep(0.05)
    assert consumer.client.strays_aborted == 0, "the abort outputs that follow are dropped quietly"
    await assert_no_leaks([consumer], [engine])


@run_async
async def test_cancel_after_finish_sends_nothing() -> None:
    [egress], handle, consumer = frames_setup()
    call = consumer.open_frames(generation_job("r1"))
    await call.start(2)
    egress.send("r1", summary(), END)
    await read_until_summary(call)
    assert call.finished
    call.cancel()
    [engine], engine_handle, to_engine = outputs_setup()
    out_call = to_engine.open_outputs(engine_request("e1"))
    stream = out_call.outputs()
    await anext(stream)
    engine.send("e1", [EngineOutput("e1", [1], finish_reason="stop")], END)
    await asyncio.wait_for(anext(stream), 2)
    assert out_call.finished  # read, though the generator was not run to its end
    out_call.cancel()
    await asyncio.sleep(0.05)
    assert aborts(handle) == [] and aborts(engine_handle) == []
    await assert_no_leaks([consumer, to_engine], [egress, engine])


@run_async
async def test_cancel_after_refusal_sends_nothing() -> None:
    [egress], handle, consumer = frames_setup()
    egress.refuse["r1"] = KeyError("full")
    call = consumer.open_frames(generation_job("r1"))
    with pytest.raises(KeyError):
        await call.start(2)
    call.cancel()
    call.cancel()
    assert aborts(handle) == [] and consumer.open_calls == 0


@run_async
async def test_a_request_whose_admission_reply_was_lost_is_ended_once_by_its_stray_items() -> None:
    """The batch call failed as a whole: the caller cannot know where (or whether) the request runs,
    so cancelling sends nothing; its items then name the replica, which ends it, once."""
    [egress], handle, consumer = frames_setup()
    keep = consumer.open_frames(generation_job("keep"))  # keeps the channel attached
    await keep.start(2)
    handle.lose_reply = ConnectionError("reply lost")
    call = consumer.open_frames(generation_job("r1"))
    with pytest.raises(ConnectionError):
        await call.start(2)
    handle.lose_reply = None
    call.cancel()
    assert aborts(handle) == [] and len(egress.producer) == 2, "it runs there all the same"
    egress.send("r1", frame("a"), frame("b"))
    await wait_until(lambda: egress.finally_ran == ["r1"])
    egress.send("keep", frame("c"))
    assert await asyncio.wait_for(anext(keep), 2) == frame("c")
    assert aborts(handle) == [("egress-A", ["r1"], "egress-A")] and consumer.client.strays_aborted == 1
    egress.send("keep", summary(), END)
    await read_until_summary(keep)
    await assert_no_leaks([consumer], [egress])


@run_async
async def test_a_request_cancelled_while_its_batch_call_failed_is_still_ended() -> None:
    """Cancelled before the acceptance, then its batch call failed as a whole (no on_orphan): its
    stray items still end it in the producer, once."""
    [egress], handle, consumer = frames_setup()
    keep = consumer.open_frames(generation_job("keep"))  # keeps the channel attached
    await keep.start(2)
    hold = egress.hold("r1")
    call = consumer.open_frames(generation_job("r1"))
    with pytest.raises(TimeoutError):
        await call.start(0.05)
    handle.lose_reply = ConnectionError("reply lost")
    hold.set()
    await wait_until(lambda: "r1" in egress.producer._jobs)
    await asyncio.sleep(0.02)
    handle.lose_reply = None
    egress.send("r1", frame("a"), frame("b"))
    await wait_until(lambda: egress.finally_ran == ["r1"])
    egress.send("keep", frame("c"))
    assert await asyncio.wait_for(anext(keep), 2) == frame("c")
    await asyncio.sleep(0.05)
    assert consumer.client.strays_aborted == 1 and aborts(handle) == [("egress-A", ["r1"], "egress-A")]
    assert egress.ended == [["r1"]]
    egress.send("keep", summary(), END)
    await read_until_summary(keep)
    await assert_no_leaks([consumer], [egress])


# -- the channel and the replica -----------------------------------------------------------------------------
@run_async
async def test_a_replica_that_is_gone_fails_its_calls_and_the_abort_is_forwarded() -> None:
    """Its attach lands on another replica (the hello names it): the call fails with the lost
    error; cancelling still sends the abort, which lands on a live replica that forwards it to the
    directory, from where the named replica (if it still runs) takes it."""
    directory = FakeDirectory()
    (a, b), handle, consumer = frames_setup("egress-A", "egress-B", directory=directory)
    call = consumer.open_frames(generation_job("r1"))
    await call.start(2)
    assert call.replica == "egress-A"
    await wait_until(lambda: consumer.client.num_attached() == 1)
    handle.gone.add("egress-A")
    a.producer.hub.drop("ingress-1")  # its attach ends: the client attaches again, elsewhere
    with pytest.raises(LostError):
        await asyncio.wait_for(anext(call), 2)
    assert ("egress-A", "egress-B", "ingress-1") in handle.log.attaches
    call.cancel()
    await wait_until(lambda: directory.forwarded != [])
    assert aborts(handle) == [("egress-A", ["r1"], "egress-B")]
    assert [(f.replica, f.request_ids) for f in directory.forwarded] == [("egress-A", ["r1"])]
    assert b.ended == [] and a.ended == []
    a.producer.poll_forwarded(period_s=0.01)
    await wait_until(lambda: a.finally_ran == ["r1"])
    assert a.ended == [["r1"]]
    a.producer.close()
    assert a.producer._poll is None


# -- whole bodies -------------------------------------------------------------------------------------------------
def _body_parts(handle: FakeHandle) -> list[BodyPart]:
    return [i.item for _, b in handle.log.batches for i in b.items if isinstance(i.item, BodyPart)]


@run_async
async def test_a_whole_body_of_many_slices_arrives_joined_on_the_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(producer_module, "PART_BYTES", 2048)
    monkeypatch.setattr(channel, "MAX_BATCH_BYTES", 8192)
    [egress], handle, consumer = frames_setup()
    call = consumer.open_frames(generation_job("r1"))
    await call.start(2)
    body = {"id": "cmpl-r1", "text": "é" * 5000, "tokens": list(range(3000)), "token_strs": ["tok"] * 500,
            "usage": {"total_tokens": 3}}
    egress.send("r1", summary(body), END)
    [done] = await read_until_summary(call)
    assert done.body == body and list(done.body) == list(body)
    assert done == summary(body)
    parts = _body_parts(handle)
    assert len(parts) >= 10 and all(len(p.data) <= 2048 for p in parts), "the body went in many slices"
    for _, batch in handle.log.batches:
        assert len(batch.items) == 1 or sum(i.nbytes for i in batch.items) <= 8192
        assert len(pickle.dumps(batch)) <= 4 * 1024 * 1024
    assert max(len(b.items) for _, b in handle.log.batches) >= 3
    assert call.finished and consumer.open_calls == 0
    await assert_no_leaks([consumer], [egress])


@run_async
async def test_a_big_completion_body_arrives_joined_under_the_real_bounds() -> None:
    """A realistic 6 MB OpenAI-shaped body (its size inside nested choices) crosses in slices."""
    choices = [{"index": i, "text": f"w{i} " * 1_000_000, "finish_reason": "length", "logprobs": None}
               for i in range(2)]
    body = renderer("completion").full_response("cmpl-r1", 0, "m", choices,
                         {"prompt_tokens": 3, "completion_tokens": 2_000_000, "total_tokens": 2_000_003})
    [egress], handle, consumer = frames_setup()
    call = consumer.open_frames(generation_job("r1"))
    await call.start(2)
    egress.send("r1", frame("before"), summary(body), END)
    got = await read_until_summary(call)
    assert got[0] == frame("before") and got[1].body == body and len(got) == 2
    parts = _body_parts(handle)
    assert len(parts) >= 6 and all(len(p.data) <= producer_module.PART_BYTES for p in parts)
    for _, batch in handle.log.batches:
        assert len(batch.items) == 1 or sum(i.nbytes for i in batch.items) <= channel.MAX_BATCH_BYTES
        # Without the summary: the log holds the very object FrameCall filled the body in.
        sent = [i for i in batch.items if not isinstance(i.item, StreamSummary)]
        assert len(pickle.dumps(sent)) <= 4 * 1024 * 1024
    await assert_no_leaks([consumer], [egress])


@run_async
async def test_async_for_over_a_frame_call_ends_after_its_summary() -> None:
    [egress], handle, consumer = frames_setup()
    call = consumer.open_frames(generation_job("r1"))
    await call.start(2)
    egress.send("r1", frame("a"), frame("b"), summary({"id": "cmpl-r1"}), END)

    async def read_all() -> list[Any]:
        return [item async for item in call]

    items = await asyncio.wait_for(read_all(), 3)
    assert items == [frame("a"), frame("b"), summary({"id": "cmpl-r1"})]
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(call), 1)  # and stays ended
    assert call.finished and consumer.open_calls == 0
    await assert_no_leaks([consumer], [egress])


# -- a whole session -----------------------------------------------------------------------------------------------
@run_async
async def test_nothing_is_left_after_a_mixed_session_on_both_hops() -> None:
    """Accepted, refused, cancelled before and after acceptance, failed and finished requests
    over two producer replicas per hop: every task, mailbox, inbox and call is gone after."""
    (ea, eb), frame_handle, ingress = frames_setup("egress-A", "egress-B")
    frame_handle.route = lambda batch: "egress-A" if len(frame_handle.log.submits) % 2 else "egress-B"
    engines, engine_handle, egress = outputs_setup(2)
    engine_handle.route = lambda batch: "engine-B" if batch.items[0].request_id.endswith("b") else "engine-A"
    for stage in (ea, eb):
        stage.refuse["refused"] = KeyError("full")
    calls = {rid: ingress.open_frames(generation_job(rid)) for rid in ("ok", "refused", "failed", "cancelled")}
    starts = dict(zip(calls, await asyncio.gather(*(c.start(2) for c in calls.values()), return_exceptions=True), strict=True))
    assert isinstance(starts.pop("refused"), KeyError)
    stage_of = {rid: {"egress-A": ea, "egress-B": eb}[s.egress_replica] for rid, s in starts.items()}
    stage_of["ok"].send("ok", frame("1"), summary(), END)
    stage_of["failed"].send("failed", frame("2"), RuntimeError("boom"))
    calls["cancelled"].cancel()
    assert await read_until_summary(calls["ok"]) == [frame("1"), summary()]
    assert await asyncio.wait_for(anext(calls["failed"]), 2) == frame("2")
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(anext(calls["failed"]), 2)
    requests = [engine_request("ea"), engine_request("eb"), engine_request("ec")]
    requests[1].avoid_replicas = ["engine-C"]  # a submit call of its own (the router places calls)
    out_calls = [egress.open_outputs(r) for r in requests]
    streams = [c.outputs() for c in out_calls]
    for s in streams:
        await anext(s)
    for rid, engine in (("ea", engines[0]), ("eb", engines[1])):
        engine.send(rid, [EngineOutput(rid, [1], finish_reason="stop")], END)
    for s in streams[:2]:
        async for _ in s:
            pass
    out_calls[2].cancel()
    for c in out_calls[:2]:
        c.cancel()
    await wait_until(lambda: "ec" in engines[0].finally_ran)
    assert aborts(engine_handle) == [("engine-A", ["ec"], "engine-A")]
    assert [(r, ids) for r, ids, _ in aborts(frame_handle)] == [(starts["cancelled"].egress_replica, ["cancelled"])]
    await assert_no_leaks([ingress, egress], [ea, eb, *engines])
    assert sum(s.producer.stats()["admission_requests"] for s in (ea, eb)) == 4
    assert all(s.producer.stats()["admitted_streams"] == 0 for s in (ea, eb, *engines))
