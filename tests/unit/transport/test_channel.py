"""The shared engine → Egress channel, both sides, without Ray: the engine's mailboxes
(:class:`ChannelHub`) wired straight into Egress's demultiplexer (:class:`ChannelClient`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from stages.transport.channel import MAX_BATCH_ITEMS, ChannelHub, merge_group
from stages.transport.channel_client import ChannelClient, Inbox
from stages.transport.consumer import Consumer
from stages.transport.messages import (
    ChannelBatch,
    EngineOutput,
    RoutedError,
    RoutedFrame,
    StreamFrame,
    StreamSummary,
)
from tests.unit.transport import fakes
from tests.unit.transport.fakes import (
    END,
    FakeEgress,
    FakeHandle,
    assert_no_leaks,
    generation_job,
    wait_until,
)


class LostError(Exception):
    pass


def run_async(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run an async test on a fresh event loop (the suite has no asyncio plugin)."""
    @functools.wraps(test)
    def wrapper() -> None:
        asyncio.run(test())
    return wrapper


def out(rid: str, *tokens: int, finish: str | None = None) -> EngineOutput:
    return EngineOutput(rid, list(tokens), finish_reason=finish)


def wire(hub: ChannelHub, consumer: str = "egress-1") -> tuple[ChannelClient, list[str]]:
    """A client whose attach calls go straight to ``hub`` (recording each attach's replica)."""
    attaches: list[str] = []

    def attach(replica: str) -> AsyncIterator[ChannelBatch]:
        attaches.append(replica)
        return hub.attach(consumer)

    return ChannelClient(attach, LostError), attaches


async def drain(inbox: Inbox) -> list[int]:
    tokens: list[int] = []
    while not inbox.done:
        for o in await asyncio.wait_for(inbox.get(), 5):
            tokens += o.new_token_ids
    return tokens


def test_merge_group_keeps_one_output_per_request_in_first_seen_order():
    merged = merge_group([out("a", 1), out("b", 7), out("a", 2, finish="length")])
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in merged] == [
        ("a", [1, 2], "length"), ("b", [7], None)]


@run_async
async def test_outputs_reach_their_own_request_and_one_batch_carries_every_request():
    hub = ChannelHub("engine-A", merge=merge_group, linger_s=0.05)
    client, attaches = wire(hub)
    inbox_a, inbox_b = client.register(["a"]), client.register(["b"])
    hub.open("egress-1")
    hub.open("egress-1")
    client.bind(inbox_a, "engine-A")
    client.bind(inbox_b, "engine-A")
    # Pushed before the attach is even running: the mailbox keeps them.
    hub.push("egress-1", [out("a", 1), out("b", 10)])
    hub.push("egress-1", [out("a", 2), out("b", 11, finish="stop")])
    hub.push("egress-1", [out("a", 3, finish="length")])
    assert await drain(inbox_a) == [1, 2, 3]
    assert await drain(inbox_b) == [10, 11]
    assert attaches == ["engine-A"], "one attach serves every request on the replica"
    hub.close("egress-1")
    hub.close("egress-1")
    client.unregister(inbox_a)
    client.unregister(inbox_b)
    await asyncio.sleep(0.2)
    assert len(hub) == 0 and client.num_attached() == 0, "both sides let go once idle"


@run_async
async def test_consumer_that_falls_behind_gets_everything_in_one_batch():
    hub = ChannelHub("engine-A", merge=merge_group, linger_s=0.05)
    hub.open("c")
    for i in range(5):
        hub.push("c", [out("a", i), out("b", 100 + i)])
    stream = hub.attach("c")
    hello = await anext(stream)
    assert hello.replica == "engine-A" and hello.items == []
    batch = await anext(stream)
    assert [(o.request_id, o.new_token_ids) for o in batch.items] == [("a", [0, 1, 2, 3, 4]),
                                                                          ("b", [100, 101, 102, 103, 104])]
    hub.close("c")
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(stream), 2)  # no live request: ends after the linger
    assert len(hub) == 0


@run_async
async def test_attach_stays_open_while_a_request_is_live_and_ends_after_the_linger():
    hub = ChannelHub("engine-A", merge=merge_group, linger_s=0.1)
    hub.open("c")
    stream = hub.attach("c")
    await anext(stream)
    nxt = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.3)
    assert not nxt.done(), "a live request keeps the channel open past the linger"
    hub.close("c")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(nxt, 2)
    assert 0.05 < loop.time() - t0 < 1.0


@run_async
async def test_open_attaches_are_counted_until_they_end_or_are_cancelled():
    # Egress's autoscaling subtracts these from Serve's count of ongoing requests.
    hub = ChannelHub("egress-A", linger_s=0.05)
    ending, cancelled = hub.attach("c1"), hub.attach("c2")
    await anext(ending)
    await anext(cancelled)
    assert hub.attaches == 2
    with pytest.raises(StopAsyncIteration):  # no live request: ends after the linger
        await asyncio.wait_for(anext(ending), 1)
    assert hub.attaches == 1
    await cancelled.aclose()  # what Serve does when the consumer's call is cancelled
    assert hub.attaches == 0 and len(hub) == 0


@run_async
async def test_a_new_request_during_the_linger_keeps_the_channel():
    hub = ChannelHub("engine-A", merge=merge_group, linger_s=0.2)
    hub.open("c")
    stream = hub.attach("c")
    await anext(stream)
    hub.close("c")
    await asyncio.sleep(0.05)
    hub.open("c")
    hub.push("c", [out("x", 5)])
    batch = await asyncio.wait_for(anext(stream), 1)
    assert [o.new_token_ids for o in batch.items] == [[5]]


@run_async
async def test_a_newer_attach_replaces_the_old_one():
    hub = ChannelHub("engine-A", merge=merge_group)
    hub.open("c")
    old = hub.attach("c")
    await anext(old)
    pending = asyncio.ensure_future(anext(old))
    new = hub.attach("c")
    await anext(new)
    hub.push("c", [out("a", 1)])
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(pending, 1)
    assert [o.new_token_ids for o in (await asyncio.wait_for(anext(new), 1)).items] == [[1]]


@run_async
async def test_dropped_consumer_keeps_nothing():
    hub = ChannelHub("engine-A", merge=merge_group)
    hub.open("c")
    hub.push("c", [out("a", 1)])
    hub.drop("c")
    hub.push("c", [out("a", 2, finish="abort")])  # the abort after the consumer died
    hub.close("c")
    assert len(hub) == 0 and hub.num_pending() == 0


@run_async
async def test_client_attaches_again_after_the_channel_went_idle():
    hub = ChannelHub("engine-A", merge=merge_group, linger_s=0.05)
    client, attaches = wire(hub)
    for rid in ("a", "b"):
        hub.open("egress-1")  # the engine opens the request before it answers "accepted"
        inbox = client.register([rid])
        client.bind(inbox, "engine-A")
        hub.push("egress-1", [out(rid, 1, finish="stop")])
        assert await drain(inbox) == [1]
        hub.close("egress-1")
        client.unregister(inbox)
        await asyncio.sleep(0.3)  # past the linger: both sides let go
        assert len(hub) == 0 and client.num_attached() == 0
    assert attaches == ["engine-A", "engine-A"]


@run_async
async def test_attach_landing_on_another_replica_fails_the_requests():
    hub = ChannelHub("engine-B", merge=merge_group)  # the named replica is gone; the call went to B
    client, _ = wire(hub)
    inbox = client.register(["a"])
    client.bind(inbox, "engine-A")
    with pytest.raises(LostError):
        await asyncio.wait_for(inbox.get(), 2)


@run_async
async def test_channel_error_fails_every_request_on_that_replica_only():
    async def broken(replica: str) -> AsyncIterator[ChannelBatch]:
        yield ChannelBatch(replica, [])
        if replica == "engine-A":
            raise ConnectionError("replica died")
        await asyncio.sleep(10)

    client = ChannelClient(broken, LostError)
    a1, a2, b = client.register(["a1"]), client.register(["a2"]), client.register(["b"])
    client.bind(a1, "engine-A")
    client.bind(a2, "engine-A")
    client.bind(b, "engine-B")
    for inbox in (a1, a2):
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(inbox.get(), 2)
    get_b = asyncio.ensure_future(b.get())
    await asyncio.sleep(0.1)
    assert not get_b.done(), "another replica's requests are not touched"
    get_b.cancel()


@run_async
async def test_channel_that_keeps_ending_empty_fails_its_requests():
    async def empty(replica: str) -> AsyncIterator[ChannelBatch]:
        yield ChannelBatch(replica, [])  # hello, then the stream ends: the replica lost them

    client = ChannelClient(empty, LostError)
    inbox = client.register(["a"])
    client.bind(inbox, "engine-A")
    with pytest.raises(LostError):
        await asyncio.wait_for(inbox.get(), 2)


@run_async
async def test_inbox_hands_over_what_arrived_before_the_failure():
    inbox = Inbox(["a"])
    inbox.push(out("a", 1))
    inbox.fail(LostError("x"))
    assert [o.new_token_ids for o in await inbox.get()] == [[1]]
    with pytest.raises(LostError):
        await inbox.get()


def test_inbox_counts_choices_finished_on_the_acceptance_item():
    inbox = Inbox(["r-0", "r-1"])
    inbox.note([out("r-0", 4, finish="length")])
    assert not inbox.done
    inbox.push(out("r-1", 5, finish="stop"))
    assert not inbox.done, "delivered is not taken: the final output must still be read"
    asyncio.run(inbox.get())
    assert inbox.done


# -- the Egress → Ingress frame channel -----------------------------------------------------------
def frame(rid: str, text: str) -> RoutedFrame:
    return RoutedFrame(rid, StreamFrame(text, 0, 1, None))


def summary(rid: str) -> RoutedFrame:
    return RoutedFrame(rid, StreamSummary(1, 2, 0, ["stop"], {}, 0.0))


@run_async
async def test_frames_of_many_requests_share_one_batch_and_keep_their_order():
    """Read through :class:`~stages.transport.consumer.FrameCall` (which replaced ``FrameStream``),
    from a real producer (:class:`~stages.transport.producer.Producer`) behind a fake handle."""
    egress = FakeEgress("egress-A")  # frames are not merged
    handle = FakeHandle([egress])
    consumer = Consumer(handle, "ingress-1", LostError)
    streams = {rid: consumer.open_frames(generation_job(rid)) for rid in ("r1", "r2")}
    for stream in streams.values():
        await asyncio.wait_for(stream.start(), 2)
    for i in range(3):
        egress.send("r1", fakes.frame(f"a{i}"))
        egress.send("r2", fakes.frame(f"b{i}"))
    egress.send("r1", fakes.summary(), END)
    egress.send("r2", fakes.summary(), END)
    for rid, prefix in (("r1", "a"), ("r2", "b")):
        got = [await asyncio.wait_for(anext(streams[rid]), 2) for _ in range(4)]
        assert [g.data for g in got[:3]] == [f"data: {prefix}{i}\n\n" for i in range(3)]
        assert isinstance(got[3], StreamSummary)
    assert [(named, reached) for named, reached, _ in handle.log.attaches] == [("egress-A", "egress-A")]
    assert any({i.request_id for i in b.items} == {"r1", "r2"} for _, b in handle.log.batches), \
        "one batch carries the frames of both requests"
    assert not consumer.client._inboxes, "a stream lets go of its inbox at its summary"
    await assert_no_leaks([consumer], [egress])


@run_async
async def test_an_error_after_the_start_arrives_after_the_frames_before_it():
    hub = ChannelHub("egress-A")
    client, _ = wire(hub, consumer="ingress-1")
    inbox = client.register_frames("r1")
    hub.open("ingress-1")
    hub.push("ingress-1", [frame("r1", "hello"), RoutedError("r1", LostError("engine went away"))])
    client.bind(inbox, "egress-A")
    assert (await asyncio.wait_for(anext(inbox), 2)).data == "hello"
    with pytest.raises(LostError, match="engine went away"):
        await asyncio.wait_for(anext(inbox), 2)
    assert inbox.finished, "an error the producer sent ends the request there"


@run_async
async def test_cancel_cancels_the_requests_own_stream_and_a_failed_one_fails_the_request():
    """There is no per-request control stream any more: cancelling is an abort by id to the Egress
    replica that accepted the job (its job ends there) and lets go of the inbox; a request fails
    when its replica's channel fails (the attach call raises)."""
    egress = FakeEgress("egress-A")
    handle = FakeHandle([egress])
    consumer = Consumer(handle, "ingress-1", LostError)
    stream = consumer.open_frames(generation_job("r1"))
    await asyncio.wait_for(stream.start(), 2)
    stream.cancel()
    assert not consumer.client._inboxes
    await wait_until(lambda: egress.finally_ran == ["r1"])
    assert egress.ended == [["r1"]]
    await wait_until(lambda: consumer.client.num_attached() == 0)

    handle.attach_error = ConnectionError("Egress replica died")
    broken = consumer.open_frames(generation_job("r2"))
    await asyncio.wait_for(broken.start(), 2)
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(anext(broken), 2)
    broken.cancel()


@run_async
async def test_a_consumer_far_behind_gets_its_backlog_in_bounded_batches_in_order():
    hub = ChannelHub("egress-A")
    hub.open("c")
    hub.push("c", [frame("r1", str(i)) for i in range(MAX_BATCH_ITEMS + 44)])
    stream = hub.attach("c")
    await anext(stream)  # hello
    first, second = await anext(stream), await anext(stream)
    assert [len(first.items), len(second.items)] == [MAX_BATCH_ITEMS, 44]
    assert [f.item.data for f in first.items + second.items] == [str(i) for i in range(MAX_BATCH_ITEMS + 44)]


# -- items nobody waits for: the request is ended where it runs, once ----------------------------------
@run_async
async def test_an_item_no_request_waits_for_ends_its_request_in_the_producer_once() -> None:
    """A batch call that failed as a whole leaves its requests running on a replica the caller
    never learned. Their items name it: each such request is aborted there, once, while the
    requests still waited for get their items; ended requests and ones whose owner already
    aborted them cost nothing."""
    hub = ChannelHub("engine-A", merge=list, linger_s=0.05)
    strays: list[tuple[str, str]] = []
    client = ChannelClient(lambda replica: hub.attach("egress-1"), LostError,
                           on_stray=lambda replica, rid: strays.append((replica, rid)))
    lost, cancelled, finished = client.register(["lost"]), client.register(["cancelled"]), client.register(["done"])
    client.unregister(lost)  # its acceptance failed: whether it runs is unknown
    client.unregister(cancelled, aborted=True)  # its owner has aborted it
    client.unregister(finished)
    live = client.register(["live"])
    for _ in range(4):
        hub.open("egress-1")
    client.bind(live, "engine-A")
    hub.push("egress-1", [out("lost", 1), out("cancelled", 2), out("done", 3, finish="stop"), out("live", 4)])
    hub.push("egress-1", [out("lost", 5), out("live", 6, finish="length")])
    assert await drain(live) == [4, 6]
    await asyncio.sleep(0.01)
    assert strays == [("engine-A", "lost")], "one abort, to the replica that sent the items"
    assert client.strays_aborted == 1


@run_async
async def test_frames_of_a_job_nobody_waits_for_cancel_it_unless_they_end_it() -> None:
    async def attach(replica: str) -> AsyncIterator[ChannelBatch]:
        yield ChannelBatch(replica, [])
        yield ChannelBatch(replica, [
            RoutedFrame("running", item=StreamFrame("data: x\n\n", 0, 1)),
            RoutedFrame("ended", item=StreamSummary(1, 1, 0, ["stop"], {}, 0.0)),
            RoutedError("failed", RuntimeError("boom")),
            RoutedFrame("waited", item=StreamFrame("data: y\n\n", 0, 1))])
        await asyncio.Event().wait()

    strays: list[tuple[str, str]] = []
    client = ChannelClient(attach, LostError, on_stray=lambda replica, rid: strays.append((replica, rid)))
    waited = client.register_frames("waited")
    client.bind(waited, "egress-B")
    frame = await asyncio.wait_for(anext(waited), 5)
    assert frame.data == "data: y\n\n"
    assert strays == [("egress-B", "running")]
    client.unregister(waited, aborted=True)
