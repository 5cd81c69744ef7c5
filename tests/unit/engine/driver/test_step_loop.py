"""The step loop alone (no asyncio): what it emits for adds, aborts, grammar builds and a crash."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from stages.engine.core.errors import EngineDeadError, RequestRejectedError
from stages.engine.core.structured import GrammarBackend
from stages.engine.driver.faults import StepFaults
from stages.engine.driver.messages import Abort, AddRequest, ArmFault, Dead, Fail, Kind, LoopEvent, Outputs
from stages.engine.driver.step_loop import StepLoop
from stages.transport.messages import EngineRequest
from tests.fakes import make_engine, params, reference


class SlowGrammars:
    """A grammar backend whose build waits for ``release`` (or raises ``error``); the real
    backend's ``build_in_background`` runs around it."""

    build_in_background = GrammarBackend.build_in_background

    compile_timeout_s = 10.0
    templates_built = 0
    mask_stats = SimpleNamespace(steps=0, rows=0, seconds=0.0, buckets=lambda: [])

    def __init__(self, error: Exception | None = None) -> None:
        self.release = threading.Event()
        self.error = error
        self._pool = ThreadPoolExecutor(1)

    def lookup(self, spec: Any) -> None:
        return None

    def build(self, spec: Any) -> object:
        self.release.wait(10)
        if self.error is not None:
            raise self.error
        return object()


class Harness:
    def __init__(self, engine: Any = None, **kw: Any) -> None:
        self.engine = engine or make_engine()
        self.events: list[LoopEvent] = []
        self.loop = StepLoop(self.engine, self.events.append, max_waiting=8, replica="r0",
                             faults=kw.pop("faults", StepFaults()), thread_nice=None, **kw)
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()

    def wait_for(self, predicate: Any, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, self.events
            time.sleep(0.005)

    def outputs(self, rid: str) -> list[Any]:
        return [o for e in self.events if isinstance(e, Outputs) for o in e.outputs if o.request_id == rid]

    def finished(self, rid: str) -> bool:
        return any(o.finish_reason for o in self.outputs(rid))

    def stop(self) -> None:
        self.loop.stop()
        self.thread.join(10)


def _add(rid: str, prompt: list[int], max_tokens: int, grammar: Any = None) -> AddRequest:
    request = EngineRequest(rid, prompt, params(max_tokens=max_tokens), grammar=grammar)
    return AddRequest(rid, 0, request, request.sampling_params, 1, time.monotonic())


def test_an_add_is_accepted_then_streamed_to_its_end() -> None:
    h = Harness()
    h.loop.send(_add("a", [5, 6, 7], 5))
    h.wait_for(lambda: h.finished("a"))
    h.stop()
    outs = h.outputs("a")
    assert outs[0].replica == "r0" and outs[0].new_token_ids == []  # the acceptance
    assert [t for o in outs for t in o.new_token_ids] == reference([5, 6, 7], 5)


def test_the_heap_is_trimmed_once_per_busy_spell_after_it_goes_idle(monkeypatch) -> None:
    from stages.engine.driver import step_loop

    trims: list[float] = []
    monkeypatch.setattr(step_loop, "IDLE_TRIM_S", 0.2)
    monkeypatch.setattr(step_loop, "trim_now", lambda: trims.append(time.monotonic()) or True)
    started = time.monotonic()
    h = Harness()
    time.sleep(0.6)
    assert len(trims) == 1 and trims[0] - started >= 0.2  # once after start-up (the load's leftovers)
    for n, rid in enumerate(("a", "b"), start=2):
        h.loop.send(_add(rid, [5, 6, 7], 5))
        h.wait_for(lambda rid=rid: h.finished(rid))
        finished = time.monotonic()
        h.wait_for(lambda n=n: len(trims) == n)
        assert trims[-1] - finished >= 0.1  # after a quiet interval, not between steps
        time.sleep(0.6)
        assert len(trims) == n  # once, however long it stays idle
    h.stop()
    assert h.loop.trimmed == 3


def _slow_engine(step_s: float = 0.002) -> Any:
    """A fake engine whose steps take ``step_s`` and whose requests can run for thousands of
    tokens: a request aborted mid-way is still running when the abort arrives, however loaded the
    machine is."""
    engine = make_engine(num_blocks=4096, model_max_len=16384)
    execute = engine.runner.execute

    def slow(*args: Any, **kw: Any) -> Any:
        time.sleep(step_s)
        return execute(*args, **kw)

    engine.runner.execute = slow
    return engine


def test_an_abort_frees_the_request_and_is_timed() -> None:
    h = Harness(_slow_engine())
    h.loop.send(_add("a", [5, 6, 7], 10_000))
    h.wait_for(lambda: len(h.outputs("a")) > 2)
    h.loop.send(Abort("a", time.monotonic()))
    h.wait_for(lambda: h.finished("a"))
    h.stop()
    assert h.outputs("a")[-1].finish_reason == "abort" and not h.engine.requests
    assert sum(h.loop.abort_latency.counts) == 1


def test_an_abort_while_the_grammar_builds_ends_the_stream_without_adding_it() -> None:
    engine = make_engine()
    engine.grammars = SlowGrammars()
    h = Harness(engine)
    h.loop.send(_add("g", [1, 2, 3], 50, grammar=SimpleNamespace(kind="regex")))
    h.wait_for(lambda: "g" in h.loop._building)
    h.loop.send(Abort("g", time.monotonic()))
    time.sleep(0.05)  # the abort is taken while the build is still running
    engine.grammars.release.set()
    h.wait_for(lambda: h.finished("g"))
    h.stop()
    assert [(o.finish_reason, o.new_token_ids) for o in h.outputs("g")] == [("abort", [])]
    assert not engine.requests and not h.loop._building and not h.loop._cancelled


def test_a_grammar_that_fails_to_build_is_a_rejection_and_the_loop_goes_on() -> None:
    engine = make_engine()
    engine.grammars = SlowGrammars(error=ValueError("bad pattern"))
    engine.grammars.release.set()
    h = Harness(engine)
    h.loop.send(_add("g", [1, 2, 3], 5, grammar=SimpleNamespace(kind="regex")))
    h.wait_for(lambda: any(isinstance(e, Fail) for e in h.events))
    h.stop()
    (fail,) = [e for e in h.events if isinstance(e, Fail)]
    assert fail.request_id == "g" and isinstance(fail.error, RequestRejectedError)
    assert "bad pattern" in str(fail.error)
    assert h.loop.dead is None and not engine.requests and not h.loop._building


def test_a_grammar_slower_than_the_compile_timeout_is_rejected() -> None:
    engine = make_engine()
    engine.grammars = SlowGrammars()
    engine.grammars.compile_timeout_s = 0.05
    h = Harness(engine)
    h.loop.send(_add("g", [1, 2, 3], 5, grammar=SimpleNamespace(kind="regex")))
    h.wait_for(lambda: "g" in h.loop._building)
    time.sleep(0.1)
    engine.grammars.release.set()
    h.wait_for(lambda: any(isinstance(e, Fail) for e in h.events))
    h.stop()
    (fail,) = [e for e in h.events if isinstance(e, Fail)]
    assert isinstance(fail.error, RequestRejectedError) and "longer than 0.05 s" in str(fail.error)
    assert not engine.requests and not h.loop._building


def test_a_crash_is_one_dead_event_with_the_text_of_what_crashed() -> None:
    faults = StepFaults(enabled=True)
    h = Harness(faults=faults)
    h.loop.send(_add("a", [1, 2], 10_000))
    h.wait_for(lambda: len(h.outputs("a")) > 1)
    h.loop.send(ArmFault("step_exception", 0))  # armed through the inbox, as a child's is
    # "a" may already have run to the model's length (fake steps are fast): a request sent after
    # the fault guarantees a step with work once it is armed.
    h.loop.send(_add("b", [3, 4], 10_000))
    h.thread.join(10)
    dead = [e for e in h.events if e.kind is Kind.DEAD]
    assert len(dead) == 1 and dead[0] is h.events[-1] and isinstance(dead[0], Dead)
    assert isinstance(dead[0].error, EngineDeadError) and "injected fault" in str(dead[0].error)
    assert h.loop.dead is not None
