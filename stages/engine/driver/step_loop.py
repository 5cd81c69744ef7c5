"""The loop that drives :class:`LLMEngine`: take adds and aborts, step, hand the outputs on.

It owns all engine state and touches it from one thread only: every message
(:mod:`stages.engine.driver.messages`) goes into an inbox drained at the top of every step, so an
abort frees the request's blocks at the engine's next step. What it produces leaves through one
callback, ``emit(event)``: an :class:`Outputs` after every step that produced something (and a new
request's acceptance), a :class:`Fail` for a request refused at admission or failed in a step, and
one :class:`Dead` when the loop crashes.

While it steps, the tensors a step frees are reallocated by the next, so the heap is left alone;
once it has had no work for :data:`IDLE_TRIM_S` (after start-up, and after each busy spell), it
returns the freed pages to the system (``malloc_trim``, 5-10 ms): the scratch of a long prompt's
steps (~50 MB after 1,500 tokens) is not held by an idle engine, and the next burst's first step
faults it back in (a few ms, once).

A structured-output grammar missing from the engine's cache is built on the grammar pool, never
on this thread (a build can take seconds, and every request would wait for it); the add comes
back to the inbox with its template. An abort that arrives meanwhile is kept and applied when it
does: the add is dropped, and its stream gets a final ``abort`` item.

The same loop runs on a thread of the replica (:mod:`stages.engine.driver.in_process`) or alone in
a child process (:mod:`stages.engine.driver.core_process`), so it knows neither asyncio nor how
its events travel. No Ray, no asyncio imports.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stages.engine.core.engine import EngineStats, LLMEngine
from stages.engine.core.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
)
from stages.engine.driver.faults import StepFaults
from stages.engine.driver.messages import (
    Abort,
    AddRequest,
    ArmFault,
    Dead,
    Fail,
    GrammarBuilt,
    Kind,
    LoopEvent,
    LoopStatus,
    Outputs,
    ToLoop,
)
from stages.engine.driver.priority import raise_thread_priority
from stages.heap import trim_now
from stages.transport.messages import EngineOutput, GrammarSpec, PrefixSummary

if TYPE_CHECKING:
    from stages.engine.driver.tracing import EngineTracer

logger = logging.getLogger(__name__)

#: Seconds between two summaries of the prefix cache at most (routers read one a second).
PREFIX_SUMMARY_INTERVAL_S = 0.25
#: Upper bounds (seconds) of the abort-latency histogram.
ABORT_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: Seconds without work after which the loop trims the heap (once per busy spell).
IDLE_TRIM_S = 1.0


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


Emit = Callable[[LoopEvent], None]


class StepLoop:
    """Runs ``engine`` until stopped; see the module docstring for what goes in and out.

    ``tracer``, when given, gets every finished request (its spans are emitted where the loop
    runs); its count is on the status as ``traced_requests``."""

    def __init__(self, engine: LLMEngine, emit: Emit, *, max_waiting: int, replica: str, faults: StepFaults,
                 thread_nice: int | None, tracer: EngineTracer | None = None) -> None:
        self.engine = engine
        self.emit = emit
        self.max_waiting = max_waiting
        self.replica = replica
        #: Test-only fault hook (:mod:`stages.engine.driver.faults`); off unless enabled.
        self.faults = faults
        #: Nice value for the loop's thread (:mod:`stages.engine.driver.priority`); ``None`` leaves it.
        self.thread_nice = thread_nice
        self.tracer = tracer
        if tracer is not None:
            engine.on_finish = tracer.on_finish
        self._inbox: queue.SimpleQueue[ToLoop] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self.dead: BaseException | None = None
        self.stats: EngineStats = engine.stats()
        #: The prefix cache as routers see it, rebuilt at most every PREFIX_SUMMARY_INTERVAL_S.
        self.prefix: PrefixSummary = self._summarise()
        self._prefix_at = time.monotonic()
        #: Adds whose grammar is being built, and those of them aborted meanwhile (this thread only).
        self._building: set[str] = set()
        self._cancelled: set[str] = set()
        #: How long aborts took to free blocks, from the consumer leaving to the step that freed them.
        self.abort_latency = CumulativeHistogram(ABORT_LATENCY_BUCKETS)
        self.rejected_overloaded = 0
        #: Heap trims when idle (for tests).
        self.trimmed = 0
        self.step_started = None
        self._handlers: dict[Kind, Callable[[Any], None]] = {
            Kind.ADD: self._add, Kind.ABORT: self._abort, Kind.GRAMMAR_BUILT: self._grammar_built,
            Kind.ARM_FAULT: self._arm_fault}

    # -- any thread -------------------------------------------------------------------------------
    def send(self, message: ToLoop) -> None:
        """Queue ``message`` for the next step."""
        self._inbox.put(message)
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self.faults.release()

    @property
    def step_started(self) -> float | None:
        """Monotonic time the step in progress began; ``None`` between steps."""
        return self._step_started

    @step_started.setter
    def step_started(self, value: float | None) -> None:
        self._step_started = value

    def status(self) -> LoopStatus:
        """The latest gauges and counters (``new_ttfts`` left empty: see :meth:`take_ttfts`)."""
        counters = {"traced_requests": self.tracer.num_traced} if self.tracer is not None else {}
        return LoopStatus(self.stats, self.rejected_overloaded, list(self.abort_latency.counts),
                          self.abort_latency.sum, counters=counters, prefix=self.prefix)

    def _summarise(self) -> PrefixSummary:
        bm = self.engine.block_manager
        return PrefixSummary.of(bm.block_size, bm.cache_version, bm.cached_hashes())

    def _refresh_prefix(self) -> None:
        """Rebuild :attr:`prefix` when the cache changed and the last one is old enough: a summary
        walks every cached block, so it is built a few times a second at most, not every step."""
        now = time.monotonic()
        if (now - self._prefix_at >= PREFIX_SUMMARY_INTERVAL_S
                and self.engine.block_manager.cache_version != self.prefix.version):
            self.prefix = self._summarise()
            self._prefix_at = now

    def take_ttfts(self) -> list[float]:
        """Engine-side TTFTs (seconds) of the requests that got their first token since the last
        call, oldest first (the engine appends on this loop's thread; popping is thread-safe)."""
        recent = self.engine.recent_ttfts
        return [recent.popleft() for _ in range(len(recent))]

    # -- the loop's own thread --------------------------------------------------------------------
    def run(self) -> None:
        """Step until :meth:`stop`; a crash is emitted as :class:`Dead` and ends the loop."""
        engine = self.engine
        if self.thread_nice is not None:
            # On the replica's log ("lifecycle.*" is what a replica writes at INFO).
            logging.getLogger("lifecycle.engine").info(
                "engine %s: %s", self.replica or "step loop",
                raise_thread_priority(self.thread_nice, engine.config.num_threads))
        # Also once at start: what the process freed after the model's load (~190 MB in the app).
        trim_due = True
        try:
            while not self._stop:
                self._drain_inbox()
                if not engine.has_unfinished():
                    self.stats = engine.stats()
                    self._refresh_prefix()
                    self.idle()
                    woken = self._wake.wait(timeout=IDLE_TRIM_S)
                    self._wake.clear()
                    if trim_due and not woken:
                        self.trimmed += 1
                        trim_now()
                        trim_due = False
                    continue
                trim_due = True
                self.step_started = time.monotonic()
                self.faults.before_step()
                outputs = engine.step()
                self.step_started = None
                self.stats = engine.stats()
                self._refresh_prefix()
                if outputs:
                    self.emit(Outputs(outputs))
                for rid, error in engine.take_failures():
                    self.emit(Fail(rid, error))
                self.stepped()
        except BaseException as exc:  # noqa: BLE001 - any crash makes the engine dead, loudly
            logger.exception("engine step loop died")
            self.dead = exc
            # The text, not the exception: what crashed may not pickle, and every stream reads it.
            self.emit(Dead(EngineDeadError(f"engine step loop died: {exc!r}")))
            return
        for rid in list(engine.requests):
            engine.abort(rid)

    def stepped(self) -> None:
        """Called after every step (a subclass publishes its status here)."""

    def idle(self) -> None:
        """Called each time the loop finds no work, before it waits."""

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handlers[message.kind](message)

    def _arm_fault(self, arm: ArmFault) -> None:
        self.faults.arm(arm.fault, arm.after_steps)

    def _abort(self, abort: Abort) -> None:
        rid = abort.request_id
        if rid in self._building:
            self._cancelled.add(rid)  # dropped when its grammar comes back
        elif self.engine.abort(rid):
            # Blocks are free now; the latency runs from the consumer leaving to here.
            self.abort_latency.observe(time.monotonic() - abort.asked)

    def _add(self, add: AddRequest) -> None:
        """Runs on the loop's thread, so the queue check sees the scheduler's exact waiting count."""
        request = add.request
        try:
            grammars = self.engine.grammars
            if (request.grammar is not None and add.grammar_template is None and grammars is not None
                    and grammars.lookup(request.grammar) is None):
                self._build_grammar(add, request.grammar)
                return  # it comes back with its template, built off this thread
            waiting = len(self.engine.scheduler.waiting)
            if add.admit and waiting + add.admit > self.max_waiting:
                self.rejected_overloaded += 1
                raise EngineOverloadedError(
                    f"The server is busy: {waiting} requests are waiting (limit {self.max_waiting}). "
                    "Retry later.", replica=self.replica, retry_after=1.0)
            req = self.engine.add_request(add.request_id, request.prompt_token_ids, add.params, add.arrival,
                                          grammar=request.grammar, grammar_template=add.grammar_template,
                                          output_token_ids=request.carried(add.index))
            req.trace = request.trace_context or None
            req.route = request.route
            if add.admit:
                # An empty first item says "accepted": callers can commit to a 200 response now and
                # still report queue-full or invalid requests with their own status before it.
                self.emit(Outputs([EngineOutput(add.request_id, [], num_prompt_tokens=req.num_prompt_tokens,
                                                index=add.index, replica=self.replica)]))
        except EngineError as exc:
            self.emit(Fail(add.request_id, exc))

    def _build_grammar(self, add: AddRequest, spec: GrammarSpec) -> None:
        grammars = self.engine.grammars
        self._building.add(add.request_id)

        def done(template: Any, error: EngineError | None) -> None:
            add.grammar_template = template
            self.send(GrammarBuilt(add, error))

        grammars.build_in_background(spec, done)

    def _grammar_built(self, built: GrammarBuilt) -> None:
        add = built.add
        rid = add.request_id
        self._building.discard(rid)
        if rid in self._cancelled:
            self._cancelled.discard(rid)
            self.emit(Outputs([EngineOutput(rid, [], finish_reason="abort", index=add.index)]))
        elif built.error is not None:
            self.emit(Fail(rid, built.error))
        else:
            self._add(add)
