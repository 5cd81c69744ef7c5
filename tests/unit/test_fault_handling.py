"""The fault-handling pieces without Ray: the test-only step fault hook, the consumer liveness
watch, the heartbeat's liveness check, the engine liveness view, and the bounded stream buffer
with the slow-reader abort (driven through a fake ASGI send that blocks like a full socket)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from stages.engine.core.errors import EngineDeadError
from stages.engine.driver.async_engine import AsyncEngine
from stages.engine.driver.faults import FaultInjectionDisabledError, StepFaults
from stages.engine.driver.in_process import InProcessDriver
from stages.errors import EngineUnavailableError
from stages.ingress.backpressure import StreamBuffer
from stages.ingress.sse import relay, sse_response
from stages.ingress.views import EngineLiveness
from stages.transport.liveness import ConsumerWatch
from stages.transport.messages import EngineReport, EngineRequest
from tests.fakes import make_engine, params
from tests.unit.ingress.test_lifecycle import FakeEgress, Harness, frame, summary


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- the step fault hook -------------------------------------------------------------------------
def test_fault_hook_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIFECYCLE_FAULT_INJECTION", raising=False)
    with pytest.raises(FaultInjectionDisabledError):
        StepFaults().arm("step_exception")
    monkeypatch.setenv("LIFECYCLE_FAULT_INJECTION", "1")
    StepFaults().arm("step_exception")  # enabled by the environment


def test_injected_step_exception_fails_every_stream_and_kills_the_loop() -> None:
    async def main() -> tuple[list[BaseException], str | None, bool]:
        faults = StepFaults(enabled=True)
        eng = AsyncEngine(InProcessDriver(make_engine(), faults=faults))
        # Armed before the requests start, to fire 20 working steps in: the fake runner steps in
        # microseconds, so arming on a consumer's first output raced the requests' own end (256
        # tokens' room), and both streams could finish cleanly first.
        faults.arm("step_exception", after_steps=20)
        eng.start()

        async def consume(rid: str) -> BaseException | None:
            try:
                async for _ in eng.generate(EngineRequest(rid, [1, 2, 3], params(max_tokens=10_000))):
                    pass
            except BaseException as exc:  # noqa: BLE001 - what the stream ended with
                return exc
            return None

        errors = await asyncio.wait_for(asyncio.gather(consume("a"), consume("b")), 60)
        problem = eng.health_problem()
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate(EngineRequest("c", [1], params(max_tokens=2))):
                pass
        eng.shutdown()
        return errors, problem, eng.is_alive

    errors, problem, alive = run(main())
    assert all(isinstance(e, EngineDeadError) and "injected fault" in str(e) for e in errors), errors
    assert problem is not None and "step loop died" in problem and not alive


# -- consumer liveness ---------------------------------------------------------------------------
def test_streams_of_a_dead_consumer_are_ended_and_others_kept() -> None:
    async def main() -> tuple[list[str], int, int]:
        dead: set[str] = set()
        ended: list[str] = []

        async def is_gone(names: list[str]) -> list[str]:
            return [n for n in names if n in dead]

        watch = ConsumerWatch(ended.append, is_gone=is_gone, period_s=0.01)
        watch.add("egress-1", "r1")
        watch.add("egress-1", "r2")
        watch.add("egress-2", "r3")
        watch.add("", "untracked")  # no consumer name: not watched
        await asyncio.sleep(0.05)
        assert ended == []
        dead.add("egress-1")
        await asyncio.sleep(0.05)
        watch.discard("egress-2", "r3")
        return sorted(ended), watch.ended, len(watch)

    ended, count, left = run(main())
    assert ended == ["r1", "r2"] and count == 2 and left == 0


def test_a_failing_liveness_check_ends_nothing() -> None:
    async def main() -> list[str]:
        ended: list[str] = []

        async def broken(names: list[str]) -> list[str]:
            raise ConnectionError("GCS unreachable")

        watch = ConsumerWatch(ended.append, is_gone=broken, period_s=0.01)
        watch.add("egress-1", "r1")
        await asyncio.sleep(0.05)
        return ended

    assert run(main()) == []


# -- the heartbeat must not keep a dead request open -----------------------------------------------
def test_heartbeat_ends_a_silent_stream_whose_engine_is_gone() -> None:
    async def main() -> tuple[int, BaseException | None]:
        checks = 0

        async def alive() -> str | None:
            nonlocal checks
            checks += 1
            return "engine replica e1 stopped reporting" if checks >= 3 else None

        ticks = 0
        try:
            async for item in relay(FakeEgress([(0, None)]), keepalive_s=0.01, alive=alive):
                ticks += item is None
        except EngineUnavailableError as exc:
            return ticks, exc
        return ticks, None

    ticks, exc = run(asyncio.wait_for(main(), 5))
    assert ticks == 2 and exc is not None and "stopped reporting" in exc.message


class FakeDirectory:
    def __init__(self) -> None:
        self.reports: list[EngineReport] = []
        self.fail = False

    async def engines(self) -> list[EngineReport]:
        if self.fail:
            raise ConnectionError("directory restarting")
        return list(self.reports)


def test_engine_liveness_needs_a_grace_period_and_ignores_an_unreachable_directory() -> None:
    async def main() -> list[str | None]:
        d = FakeDirectory()
        d.reports = [EngineReport("e1", "n", 100, True)]
        view = EngineLiveness(d, max_age_s=0.0, grace_s=0.05)
        out = [await view.problem("e1")]
        d.fail = True
        out.append(await view.problem("e1"))  # no answer: the last view stands
        d.fail, d.reports = False, []
        out.append(await view.problem("e1"))  # gone, but within the grace period
        await asyncio.sleep(0.06)
        out.append(await view.problem("e1"))
        d.reports = [EngineReport("e1", "n", 100, False)]
        out.append(await view.problem("e1"))
        return out

    assert run(main()) == [None, None, None, "engine replica e1 stopped reporting",
                           "engine replica e1 is not making progress"]


# -- slow readers ---------------------------------------------------------------------------------
def test_stream_buffer_bounds_the_backlog_and_replaces_it_on_abort() -> None:
    async def main() -> tuple[bool, bool, list[bytes | None], int]:
        buf = StreamBuffer(10)
        first = buf.put(b"12345")
        second = buf.put(b"123456")  # 11 bytes waiting: over the bound
        peak = buf.peak
        buf.replace([b"err", b"done"])
        got = [await buf.get(), await buf.get()]
        return first, second, got, peak

    first, second, got, peak = run(main())
    assert first and not second and peak == 11
    assert got == [b"errdone", None]


async def _drive_slow_client(response: Any, stall_after: int, read_after_s: float) -> list[bytes]:
    """A client that takes ``stall_after`` writes, then stops reading (each ``send`` waits, as
    uvicorn's does on a full socket) for ``read_after_s`` seconds, then reads on."""
    sent: list[bytes] = []
    resume = asyncio.Event()
    asyncio.get_running_loop().call_later(read_after_s, resume.set)

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            if len(sent) >= stall_after:
                await resume.wait()
            sent.append(message["body"])

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/", "headers": []}
    await asyncio.wait_for(response(scope, receive, send), 10)
    return sent


def test_a_client_that_stops_reading_is_aborted_with_the_documented_error() -> None:
    h = Harness()
    gen = FakeEgress([(0.001, frame(i)) for i in range(500)] + [(0, summary())])
    response = sse_response(gen, h.job, h.live, h.lifecycle, lambda live, s: {"total": 1.0}, keepalive_s=10.0,
                            max_buffer_bytes=1024, slow_reader_grace_s=5.0)
    sent = run(_drive_slow_client(response, stall_after=3, read_after_s=0.3))
    text = b"".join(sent).decode()
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "slow_reader" and error["code"] == "stream_buffer_exceeded", error
    assert len(events) < 60, "the backlog was sent instead of being dropped"
    assert gen.cancelled, "the Egress call (and so the engine request) was not cancelled"
    assert [o for o, _ in h.closed] == ["slow_reader"] and h.live.status == 408


def test_a_client_that_never_reads_again_is_disconnected_after_the_grace_period() -> None:
    h = Harness()
    gen = FakeEgress([(0.001, frame(i)) for i in range(500)] + [(0, summary())])
    response = sse_response(gen, h.job, h.live, h.lifecycle, lambda live, s: {"total": 1.0}, keepalive_s=10.0,
                            max_buffer_bytes=1024, slow_reader_grace_s=0.2)
    sent = run(_drive_slow_client(response, stall_after=3, read_after_s=3600))  # returns: no hang
    assert len(sent) == 3 and gen.cancelled
    assert [o for o, _ in h.closed] == ["slow_reader"]


def test_a_client_that_keeps_up_is_never_cut() -> None:
    h = Harness()
    gen = FakeEgress([(0.0005, frame(i)) for i in range(300)] + [(0, summary())])
    response = sse_response(gen, h.job, h.live, h.lifecycle, lambda live, s: {"total": 1.0}, keepalive_s=10.0,
                            max_buffer_bytes=1024)
    text = b"".join(run(_drive_slow_client(response, stall_after=10**9, read_after_s=0))).decode()
    assert text.count("data: {\"i\"") == 300 and text.endswith("data: [DONE]\n\n")
    assert [o for o, _ in h.closed] == ["ok"] and not gen.cancelled
