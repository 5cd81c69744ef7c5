"""The Ingress pieces without Ray: request lifecycle (ids, exactly-once close, cancel by id, the
directory sync) and the SSE response, driven through fake ASGI receive/send so every way a client
can leave is reproducible: before the body starts, during a heartbeat wait, during a long prefill,
and after the last token."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Iterable
from typing import Any

import pytest

from stages.engine.core.errors import EngineDeadError
from stages.ingress.lifecycle import Lifecycle, LiveRequest, Outcome, mint_request_id
from stages.ingress.sse import relay, sse_response
from stages.transport.messages import (
    AbortRequest,
    EngineMoved,
    EngineRequest,
    GenerationJob,
    SamplingParams,
    StreamFrame,
    StreamStart,
    StreamSummary,
)


class FakeSpan:
    def __init__(self) -> None:
        self.ended = 0
        self.events: list[str] = []

    def add_event(self, name: str, attrs: Any = None) -> None:
        self.events.append(name)

    def end(self) -> None:
        self.ended += 1


class FakeEgress:
    """An Egress stream: scripted ``(delay_s, item)`` pairs; records ``cancel()`` like a Serve
    ``DeploymentResponseGenerator``. ``None`` as an item means: never send anything more."""

    def __init__(self, script: Iterable[tuple[float, Any]]) -> None:
        self.script = list(script)
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self) -> FakeEgress:
        return self

    async def __anext__(self) -> Any:
        if not self.script:
            raise StopAsyncIteration
        delay, item = self.script.pop(0)
        await asyncio.sleep(delay)
        if item is None:
            await asyncio.sleep(3600)
        if isinstance(item, BaseException):
            raise item
        return item


def summary() -> StreamSummary:
    return StreamSummary(prompt_tokens=3, completion_tokens=2, cached_tokens=0, finish_reasons=["length"],
                         engine_timings={}, egress_busy=0.0)


def frame(i: int, tokens: int = 1, finish: str | None = None) -> StreamFrame:
    return StreamFrame(f"id: {i}\ndata: {{\"i\": {i}}}\n\n", 0, tokens, finish, i)


class Harness:
    def __init__(self) -> None:
        self.closed: list[tuple[str, Any]] = []
        self.lifecycle = Lifecycle("ingress-a", on_close=lambda live, s, t: self.closed.append((live.outcome, s)))
        self.live = self.lifecycle.open("completion", FakeSpan())
        req = EngineRequest(self.live.request_id, [1, 2, 3], SamplingParams())
        self.job = GenerationJob(req, "completion", "m", self.live.response_id, 0, stream=True, include_usage=True)

    def response(self, gen: FakeEgress, keepalive_s: float = 10.0) -> Any:
        return sse_response(gen, self.job, self.live, self.lifecycle, lambda live, s: {"total": 1.0},
                            keepalive_s=keepalive_s)


async def drive(response: Any, *, disconnect_after: float | None = None, block_start_s: float = 0.0
                ) -> list[bytes]:
    """Run an ASGI response; the client disconnects after ``disconnect_after`` seconds."""
    sent: list[bytes] = []

    async def receive() -> dict[str, Any]:
        if disconnect_after is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            await asyncio.sleep(block_start_s)
        elif message.get("body"):
            sent.append(message["body"])

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/", "headers": []}
    await asyncio.wait_for(response(scope, receive, send), 10)
    return sent


def test_minted_ids_are_unique_and_hyphen_free():
    ids = {mint_request_id() for _ in range(10_000)}
    assert len(ids) == 10_000 and not any("-" in i for i in ids)


def test_outcomes_read_as_the_log_and_metric_values_they_always_were():
    """Log lines and the ``reason`` label of ``request_aborted_total`` stay byte-identical."""
    import json

    assert [str(o) for o in Outcome] == ["ok", "cancelled", "client_gone", "timeout", "slow_reader", "error", "detached"]
    assert json.dumps({"outcome": Outcome.CLIENT_GONE}) == '{"outcome": "client_gone"}'
    assert f"{Outcome.SLOW_READER}" == "slow_reader" and Outcome.OK == "ok"
    lc = Lifecycle("ingress-a")
    live = lc.open("chat", FakeSpan())
    assert live.outcome is Outcome.OK
    lc.close(live, Outcome.TIMEOUT)
    assert live.outcome == "timeout"


def test_complete_stream_closes_once_with_ok_and_never_cancels():
    h = Harness()
    gen = FakeEgress([(0, frame(0)), (0, frame(1, finish="length")), (0, summary())])
    sent = asyncio.run(drive(h.response(gen)))
    text = b"".join(sent).decode()
    assert text.endswith("data: [DONE]\n\n") and '"usage"' in text
    assert [o for o, _ in h.closed] == ["ok"] and h.closed[0][1] is not None
    assert not gen.cancelled and h.live.request_id not in h.lifecycle.live


@pytest.mark.parametrize("case", ["before_body", "heartbeat_wait", "long_prefill", "after_last_token"])
def test_every_disconnect_cleans_up_exactly_once(case: str):
    h = Harness()
    if case == "before_body":
        # The client is gone while the response start is still being sent: the body never runs.
        gen = FakeEgress([(0, frame(0)), (0, summary())])
        sent = asyncio.run(drive(h.response(gen), disconnect_after=0.0, block_start_s=0.2))
        assert sent == []
    elif case == "heartbeat_wait":
        gen = FakeEgress([(0, None)])
        sent = asyncio.run(drive(h.response(gen, keepalive_s=0.02), disconnect_after=0.2))
        assert b": keep-alive\n" in sent
    elif case == "long_prefill":
        gen = FakeEgress([(5.0, frame(0))])  # no token yet when the client leaves
        sent = asyncio.run(drive(h.response(gen), disconnect_after=0.1))
        assert sent == []
    else:
        gen = FakeEgress([(0, frame(0)), (0, frame(1, finish="length")), (0, None)])
        sent = asyncio.run(drive(h.response(gen), disconnect_after=0.2))
        assert len(sent) == 2  # both tokens went out; the summary never came
    assert gen.cancelled, "the Egress call (and so the engine request) was not cancelled"
    assert [o for o, _ in h.closed] == ["client_gone"]
    assert h.live.closed and h.live.request_id not in h.lifecycle.live


def test_error_after_the_200_is_an_in_band_event_then_done():
    h = Harness()
    gen = FakeEgress([(0, frame(0)), (0, EngineDeadError("step loop died"))])
    text = b"".join(asyncio.run(drive(h.response(gen)))).decode()
    assert '"type":"service_unavailable"' in text and text.endswith("data: [DONE]\n\n")
    assert [o for o, _ in h.closed] == ["error"] and h.live.status == 503
    assert gen.cancelled


def test_relay_times_out_at_the_deadline():
    import time

    from stages.errors import RequestTimeoutError

    async def main() -> list[Any]:
        out = []
        with pytest.raises(RequestTimeoutError):
            async for item in relay(FakeEgress([(0, frame(0)), (0, None)]), 0.05, time.perf_counter() + 0.2):
                out.append(item)
        return out

    out = asyncio.run(main())
    assert isinstance(out[0], StreamFrame) and None in out  # heartbeats until the deadline


# -- lifecycle -------------------------------------------------------------------------------------------------
class FakeDirectory:
    """A directory client with one replica: records sync calls; cancel finds entries by key in
    what was synced."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[str], bool]] = []
        self.entries: dict[str, Any] = {}

    def members(self) -> list[str]:
        return ["d0"]

    async def ready_members(self) -> list[str]:
        return self.members()

    async def sync(self, member: str, owner: str, added: list[Any], removed: list[str], full: bool) -> None:
        self.calls.append(([e.request_id for e in added], list(removed), full))
        if full:  # replaces everything this owner had
            self.entries = {k: e for k, e in self.entries.items() if e.owner != owner}
        for e in added:
            self.entries[e.request_id] = e
        for rid in removed:
            self.entries.pop(rid, None)

    async def cancel(self, key: str, api_key_id: Any = None) -> list[Any]:
        return [e for e in self.entries.values() if key in (e.response_id, e.client_request_id)]


def test_close_is_exactly_once_and_directory_sync_is_batched_and_ordered():
    async def main() -> tuple[FakeDirectory, list[str]]:
        directory = FakeDirectory()
        closes: list[str] = []
        lc = Lifecycle("a", directory=directory, sync_delay_s=0, on_close=lambda live, s, t: closes.append(live.request_id))
        first = lc.open("chat", FakeSpan())
        await asyncio.sleep(0.01)  # the first flush goes out (a full sync)
        many = [lc.open("chat", FakeSpan()) for _ in range(5)]
        short = lc.open("chat", FakeSpan())
        assert lc.close(short, "ok") and not lc.close(short, "error")  # the second close is a no-op
        await asyncio.sleep(0.01)
        for live in [first, *many]:
            lc.close(live, "ok")
        await asyncio.sleep(0.01)
        return directory, closes

    directory, closes = asyncio.run(main())
    assert directory.entries == {}
    assert directory.calls[0][2] is True  # the first sync of a replica is a full one
    flat_added = [rid for added, _, _ in directory.calls for rid in added]
    assert len(flat_added) == 6  # the request opened and closed within one batch was never sent
    assert len(directory.calls) <= 4  # batched: far fewer calls than opens + closes
    assert len(closes) == 7 == len(set(closes))


class ServeLikeDirectory(FakeDirectory):
    """Like Serve for an Ingress replica: a handle call made in the context of a request is that
    request's child, and cancelling the request cancels its in-flight children."""

    request: contextvars.ContextVar[str | None] = contextvars.ContextVar("serve_request", default=None)

    def __init__(self) -> None:
        super().__init__()
        self.children: dict[str, list[asyncio.Future[None]]] = {}

    async def sync(self, *args: Any) -> None:
        parent = self.request.get()
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if parent is not None:
            self.children.setdefault(parent, []).append(gate)
        asyncio.get_running_loop().call_later(0.02, lambda: gate.done() or gate.set_result(None))
        await gate  # the RPC in flight
        await super().sync(*args)

    def cancel_request(self, parent: str) -> int:
        gates = [g for g in self.children.pop(parent, []) if not g.done()]
        for gate in gates:
            gate.cancel()
        return len(gates)


def test_a_request_cancelled_by_serve_still_leaves_the_directory():
    """The CI leak: a client left, Serve cancelled that Ingress request and with it every handle
    call made in its context, including the directory sync that its own close had started."""

    async def main() -> tuple[ServeLikeDirectory, int]:
        directory = ServeLikeDirectory()
        lc = Lifecycle("a", directory=directory, sync_delay_s=0)
        live = lc.open("chat", FakeSpan())
        await asyncio.sleep(0.05)  # registered

        async def request_handler() -> None:  # runs in the request's context, then is cancelled
            ServeLikeDirectory.request.set("req-1")
            lc.close(live, "client_gone")
            await asyncio.sleep(0)

        await asyncio.create_task(request_handler())
        cancelled = directory.cancel_request("req-1")  # what Serve does once the request is cancelled
        await asyncio.sleep(0.1)
        return directory, cancelled

    directory, cancelled = asyncio.run(main())
    assert cancelled == 0  # the sync was not the request's child
    assert directory.entries == {}


def test_a_sync_cancelled_under_the_flusher_is_resent_as_a_full_sync():
    async def main() -> FakeDirectory:
        directory = FakeDirectory()
        plain_sync, calls = directory.sync, [0]

        async def flaky(*args: Any) -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise asyncio.CancelledError  # the callee was cancelled, not the flusher
            await plain_sync(*args)

        directory.sync = flaky  # type: ignore[method-assign]
        lc = Lifecycle("a", directory=directory, sync_delay_s=0)
        live = lc.open("chat", FakeSpan())
        await asyncio.sleep(0.01)
        lc.close(live, "ok")
        await asyncio.sleep(0.01)
        return directory

    directory = asyncio.run(main())
    assert directory.entries == {}
    assert directory.calls[-1] == ([], [], True)  # the lost batch was healed by a full resync


def test_cancel_before_the_engine_has_it_is_applied_when_it_starts():
    async def main() -> list[AbortRequest]:
        aborts: list[AbortRequest] = []

        async def abort(req: AbortRequest) -> None:
            aborts.append(req)

        lc = Lifecycle("a", abort=abort)
        live = lc.open("chat", FakeSpan(), client_request_id="label-1")
        cancelled = await lc.cancel("label-1")
        assert [e.response_id for e in cancelled] == [live.response_id]
        await asyncio.sleep(0)
        assert aborts == []  # nowhere to send it yet
        lc.started(live, StreamStart("engine-7", [f"{live.request_id}-0", f"{live.request_id}-1"], 3))
        await asyncio.sleep(0)
        return aborts

    aborts = asyncio.run(main())
    assert len(aborts) == 1 and aborts[0].replica == "engine-7" and len(aborts[0].request_ids) == 2


def test_a_cancel_during_a_move_is_sent_again_to_where_the_request_went():
    """The abort of a cancel that came while the request was moving went to the lost replica;
    when the move is known, it goes to the new one, under the ids the request has there."""

    async def main() -> list[AbortRequest]:
        aborts: list[AbortRequest] = []

        async def abort(req: AbortRequest) -> None:
            aborts.append(req)

        lc = Lifecycle("a", abort=abort)
        live = lc.open("chat", FakeSpan())
        lc.started(live, StreamStart("engine-1", [live.request_id], 3))
        assert lc.cancel_local(live.request_id)
        await asyncio.sleep(0)
        lc.moved(live, EngineMoved("engine-2", [f"{live.request_id}.1"]))
        await asyncio.sleep(0)
        return aborts

    aborts = asyncio.run(main())
    assert [(a.replica, a.request_ids) for a in aborts] == [("engine-1", [aborts[0].request_ids[0]]),
                                                           ("engine-2", [aborts[0].request_ids[0] + ".1"])]


def test_cancel_by_label_reaches_other_replicas_through_the_directory():
    async def main() -> tuple[list[Any], list[Any]]:
        directory = FakeDirectory()
        here = Lifecycle("a", directory=directory, sync_delay_s=0)
        there = Lifecycle("b", directory=directory, sync_delay_s=0)
        mine = here.open("chat", FakeSpan(), client_request_id="shared")
        theirs = there.open("chat", FakeSpan(), client_request_id="shared")
        await asyncio.sleep(0.01)
        found = await here.cancel("shared")
        unknown = await here.cancel("nothing-by-that-name")
        assert mine.cancel_requested and not theirs.cancel_requested  # theirs is the owner's to act on
        return found, unknown

    found, unknown = asyncio.run(main())
    assert sorted(e.owner for e in found) == ["a", "b"] and unknown == []


def test_find_local_respects_the_creating_api_key():
    lc = Lifecycle("a")
    live: LiveRequest = lc.open("chat", FakeSpan(), client_request_id="x", api_key_id="key-1")
    assert lc.find_local(live.response_id, "key-2") == []
    assert lc.find_local(live.response_id, "key-1") == [live]
    assert lc.find_local("x", "key-1") == [live]


def test_heartbeats_between_events_are_invisible_to_the_official_client():
    """The openai client keeps the last ``id:``; a heartbeat ended by a blank line became an event
    with empty data there, which it failed to parse mid-stream."""
    from openai._streaming import SSEDecoder

    h = Harness()
    gen = FakeEgress([(0, frame(0)), (0.12, frame(1)), (0, summary())])
    raw = b"".join(asyncio.run(drive(h.response(gen, keepalive_s=0.03))))
    assert b": keep-alive" in raw
    decoder = SSEDecoder()
    events = []
    for line in raw.decode().split("\n"):
        event = decoder.decode(line)
        if event is not None:
            events.append(event)
            if event.data == "[DONE]":
                break  # where the client stops reading
    assert [e.id for e in events] == [str(i) for i in range(len(events))]
    assert all(e.data for e in events) and events[-1].data == "[DONE]"


def test_the_directory_sync_waits_its_delay_and_batches_what_changed_meanwhile():
    """No sync call goes out right after a request opens (it would share the loop with that
    request's Egress call); one call after the delay carries every change made meanwhile, and a
    request opened and closed within it is never sent at all."""

    async def main() -> tuple[list[Any], list[Any], FakeDirectory]:
        directory = FakeDirectory()
        lc = Lifecycle("a", directory=directory, sync_delay_s=0.05)
        first = lc.open("chat", FakeSpan())
        await asyncio.sleep(0.01)
        early = list(directory.calls)
        second = lc.open("chat", FakeSpan())
        brief = lc.open("chat", FakeSpan())
        lc.close(brief, "ok")
        await asyncio.sleep(0.08)
        after_delay = list(directory.calls)
        lc.close(first, "ok")
        lc.close(second, "ok")
        await asyncio.sleep(0.08)
        return early, after_delay, directory

    early, after_delay, directory = asyncio.run(main())
    assert early == []
    assert len(after_delay) == 1 and after_delay[0][2] is True and len(after_delay[0][0]) == 2
    assert len(directory.calls) == 2 and directory.entries == {}


def test_a_finished_request_leaves_the_directory_without_waiting_the_delay():
    """So a cancel of a request that has just finished is a 404 on every replica."""

    async def main() -> tuple[FakeDirectory, float]:
        directory = FakeDirectory()
        lc = Lifecycle("a", directory=directory, sync_delay_s=0.3)
        live = lc.open("chat", FakeSpan())
        await asyncio.sleep(0.4)
        assert live.request_id in directory.entries
        other = lc.open("chat", FakeSpan())  # its add waits out the delay...
        await asyncio.sleep(0.005)
        t0 = time.perf_counter()
        lc.close(live, "ok")  # ...but this removal ends the wait
        while live.request_id in directory.entries:
            await asyncio.sleep(0.001)
        gone_in = time.perf_counter() - t0
        lc.close(other, "ok")
        await asyncio.sleep(0.4)
        return directory, gone_in

    directory, gone_in = asyncio.run(main())
    assert gone_in < 0.15, gone_in
    assert directory.entries == {}
