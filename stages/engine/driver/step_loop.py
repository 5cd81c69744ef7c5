"""The loop that drives :class:`LLMEngine`: take adds and aborts, step, hand the outputs on.

It owns all engine state and touches it from one thread only: ``add`` and ``abort`` are messages
in an inbox drained at the top of every step, so an abort frees the request's blocks at the
engine's next step. What it produces leaves through one callback, ``emit(kind, *args)``:

- ``("outputs", [EngineOutput, ...])`` after every step that produced something, and the
  acceptance of a new request (an empty output naming the replica);
- ``("fail", request_id, error)`` for a request refused at admission or failed in a step;
- ``("dead", error)`` once, when the loop crashes.

The same loop runs on a thread of the replica (:class:`stages.engine.driver.async_engine.AsyncEngine`'s
default: ``emit`` posts to the event loop) or alone in a child process
(:mod:`stages.engine.driver.core_process`: ``emit`` writes to a pipe), so it knows neither asyncio nor
the transport. No Ray, no asyncio imports.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stages.engine.core.engine import EngineStats, LLMEngine
from stages.engine.core.errors import EngineError, EngineOverloadedError
from stages.engine.driver.faults import StepFaults
from stages.engine.driver.priority import raise_thread_priority
from stages.transport.messages import EngineOutput, EngineRequest

logger = logging.getLogger(__name__)

#: Upper bounds (seconds) of the abort-latency histogram.
ABORT_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class CumulativeHistogram:
    """A tiny Prometheus-style histogram (cumulative bucket counts), safe to snapshot."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count)]`` including ``+Inf``."""
        out, total = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


@dataclass
class AddRequest:
    """One choice of an API request, handed to the loop (a picklable message)."""

    request_id: str
    index: int
    request: EngineRequest
    params: Any
    #: Choice 0 carries the group's size (checked against the waiting-queue bound); siblings 0.
    admit: int
    arrival: float
    #: The structured-output matcher template, when the caller built it (same process only).
    grammar_template: Any = None


@dataclass
class LoopStatus:
    """What the loop publishes after every step: the engine's gauges plus the loop's counters."""

    stats: EngineStats
    rejected_overloaded: int = 0
    abort_latency_counts: list[int] = field(default_factory=list)
    abort_latency_sum: float = 0.0
    #: Engine-side TTFTs (seconds) since the last status (the autoscaling signal).
    new_ttfts: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


#: Callback invoked on the loop's thread after every step: (engine, step outputs, step seconds).
StepHook = Callable[[LLMEngine, list[EngineOutput], float], None]
Emit = Callable[..., None]


class StepLoop:
    """Runs ``engine`` until stopped; see the module docstring for what goes in and out."""

    def __init__(self, engine: LLMEngine, emit: Emit, *, max_waiting: int = 256, replica: str = "",
                 faults: StepFaults | None = None, thread_nice: int | None = None,
                 step_hook: StepHook | None = None, build_grammar: Callable[[AddRequest], bool] | None = None,
                 ) -> None:
        self.engine = engine
        self.emit = emit
        self.max_waiting = max_waiting
        self.replica = replica
        #: Test-only fault hook (:mod:`stages.engine.driver.faults`); off unless enabled.
        self.faults = faults or StepFaults()
        #: Nice value for the loop's thread (:mod:`stages.engine.driver.priority`); ``None`` leaves it.
        self.thread_nice = thread_nice
        self.step_hook = step_hook
        #: Where an add whose grammar template is missing goes to be built off this thread; it
        #: returns ``False`` when it did not take the add (then the engine rejects it).
        self.build_grammar = build_grammar
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self.dead: BaseException | None = None
        self.stats: EngineStats = engine.stats()
        #: Monotonic time the step in progress began; ``None`` between steps.
        self.step_started: float | None = None
        #: How long aborts took to free blocks, from the consumer leaving to the step that freed them.
        self.abort_latencies: deque[float] = deque(maxlen=4096)
        self.abort_latency = CumulativeHistogram(ABORT_LATENCY_BUCKETS)
        self.rejected_overloaded = 0

    # -- any thread -------------------------------------------------------------------------------
    def send(self, kind: str, payload: Any) -> None:
        """Queue ``("add", AddRequest)``, ``("abort", (request_id, asked_monotonic))`` or
        ``("fault", (kind, after_steps))`` for the next step."""
        self._inbox.put((kind, payload))
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self.faults.release()

    def status(self) -> LoopStatus:
        """The latest gauges and counters (consumes the TTFTs gathered since the last call)."""
        recent = self.engine.recent_ttfts
        return LoopStatus(self.stats, self.rejected_overloaded, list(self.abort_latency.counts),
                          self.abort_latency.sum, [recent.popleft() for _ in range(len(recent))])

    # -- the loop's own thread --------------------------------------------------------------------
    def run(self) -> None:
        """Step until :meth:`stop`; a crash is emitted as ``("dead", error)`` and ends the loop."""
        engine = self.engine
        if self.thread_nice is not None:
            # On the replica's log ("lifecycle.*" is what a replica writes at INFO).
            logging.getLogger("lifecycle.engine").info(
                "engine %s: %s", self.replica or "step loop",
                raise_thread_priority(self.thread_nice, engine.config.num_threads))
        try:
            while not self._stop:
                self._drain_inbox()
                if not engine.has_unfinished():
                    self.stats = engine.stats()
                    self.idle()
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                self.step_started = t0 = time.monotonic()
                self.faults.before_step()
                outputs = engine.step()
                self.step_started, now = None, time.monotonic()
                self.stats = engine.stats()
                if outputs:
                    self.emit("outputs", outputs)
                for rid, error in engine.take_failures():
                    self.emit("fail", rid, error)
                self.stepped()
                if self.step_hook is not None:
                    self.step_hook(engine, outputs, now - t0)
        except BaseException as exc:  # noqa: BLE001 - any crash makes the engine dead, loudly
            logger.exception("engine step loop died")
            self.dead = exc
            self.emit("dead", exc)
            return
        for rid in list(engine.requests):
            engine.abort(rid)

    def stepped(self) -> None:
        """Called after every step (a subclass publishes its status here)."""

    def idle(self) -> None:
        """Called each time the loop finds no work, before it waits."""

    def _drain_inbox(self) -> None:
        engine = self.engine
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                rid, asked = payload
                if engine.abort(rid):
                    # Blocks are free now; the latency runs from the consumer leaving to here.
                    latency = time.monotonic() - asked
                    self.abort_latencies.append(latency)
                    self.abort_latency.observe(latency)
            elif kind == "fault":
                self.faults.arm(*payload)
            elif kind == "reject":  # an add refused before it reached the engine (its grammar)
                self.emit("fail", *payload)

    def _add(self, add: AddRequest) -> None:
        """Runs on the loop's thread, so the queue check sees the scheduler's exact waiting count."""
        request = add.request
        try:
            grammars = self.engine.grammars
            if (request.grammar is not None and add.grammar_template is None and grammars is not None
                    and grammars.lookup(request.grammar) is None and self.build_grammar is not None
                    and self.build_grammar(add)):
                return  # it comes back with its template, built off this thread
            waiting = len(self.engine.scheduler.waiting)
            if add.admit and waiting + add.admit > self.max_waiting:
                self.rejected_overloaded += 1
                raise EngineOverloadedError(
                    f"The server is busy: {waiting} requests are waiting (limit {self.max_waiting}). "
                    "Retry later.", replica=self.replica, retry_after=1.0)
            req = self.engine.add_request(add.request_id, request.prompt_token_ids, add.params, add.arrival,
                                          grammar=request.grammar, grammar_template=add.grammar_template)
            req.trace = request.trace_context or None
            if add.index == 0:
                # An empty first item says "accepted": callers can commit to a 200 response now and
                # still report queue-full or invalid requests with their own status before it.
                self.emit("outputs", [EngineOutput(add.request_id, [], num_prompt_tokens=req.num_prompt_tokens,
                                                   index=0, replica=self.replica)])
        except EngineError as exc:
            self.emit("fail", add.request_id, exc)
