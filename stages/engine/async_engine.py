"""Drives :class:`LLMEngine` on a background thread and streams each request's outputs to asyncio.

Why a thread: a step is mostly torch work that releases the GIL, so the event loop (Ray's RPCs,
new requests, aborts) stays responsive while the model runs, and new requests join the batch at
the next step. All engine state is touched by the step thread only: ``add`` and ``abort`` are
messages in an inbox drained at the top of every step, so an abort frees the request's blocks at
the engine's next step.

Streaming: each API request (all its ``n`` choices) has one :class:`_Stream`. The step thread hands
every step's outputs to the event loop in one ``call_soon_threadsafe``; the consumer takes
*everything* that accumulated since it last looked and merges it into one output per choice. The
first token therefore goes out at once, and under load one item carries several tokens (and every
choice) instead of one RPC per token per choice.

No Ray imports: the in-process benchmark and the tests use this directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from stages.channel import merge_group
from stages.engine.engine import EngineStats, LLMEngine
from stages.engine.errors import (
    DuplicateRequestIdError,
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    RequestRejectedError,
)
from stages.engine.faults import StepFaults
from stages.engine.priority import raise_thread_priority
from stages.protocol import EngineOutput, EngineRequest

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """Mailbox of one API request (all its choices), living on the event loop."""

    pending: list[EngineOutput] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    error: BaseException | None = None

    def push(self, out: EngineOutput) -> None:
        self.pending.append(out)
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()


@dataclass
class _Group:
    """The ``n`` choices of one API request: choice 0 runs first, its siblings join once it has
    produced its first token, so they find the prompt's blocks in the prefix cache."""

    request: EngineRequest
    ids: list[str]
    stream: _Stream
    #: Choices handed to the step thread.
    added: set[str] = field(default_factory=set)
    #: Choices that have streamed their final item.
    finished: set[str] = field(default_factory=set)
    #: Siblings aborted before they were ever added.
    dropped: set[str] = field(default_factory=set)
    #: The structured-output matcher template, built before choice 0 is added (never on the step thread).
    grammar_template: Any = None
    #: Set once the first item is taken when ``generate`` was given a ``sink``: later outputs go
    #: to it straight from the step's delivery, without waking the request's own task.
    sink: Callable[[list[EngineOutput]], None] | None = None


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


#: Callback invoked on the step thread after every step: (engine, step outputs, step seconds).
StepHook = Callable[[LLMEngine, list[EngineOutput], float], None]


class AsyncEngine:
    """Thread-driven engine with an asyncio streaming API.

    ``replica`` names this engine replica on the acceptance item of every stream, so an abort by
    id can be routed back here. The waiting-queue bound is checked by the step thread when it
    takes a request in, against the scheduler's own queue: it is exact under bursts.
    """

    def __init__(self, engine: LLMEngine, *, max_waiting: int = 256, step_hook: StepHook | None = None,
                 replica: str = "", stall_timeout_s: float = 60.0, faults: StepFaults | None = None,
                 thread_nice: int | None = None) -> None:
        self.engine = engine
        #: Nice value for the step thread (:mod:`stages.engine.priority`); ``None`` leaves it.
        self.thread_nice = thread_nice
        #: Test-only fault hook (:mod:`stages.engine.faults`); off unless enabled.
        self.faults = faults or StepFaults()
        self.max_waiting = max_waiting
        self.step_hook = step_hook
        self.replica = replica
        self.stall_timeout_s = stall_timeout_s
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        #: Engine request id → the group it belongs to (every choice of a group maps to it).
        self._groups: dict[str, _Group] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.dead: BaseException | None = None
        self._stats = engine.stats()
        #: Monotonic time the step in progress began; ``None`` between steps.
        self._step_started: float | None = None
        # Cancellation accounting: how long aborts took to free blocks (step thread), and tokens
        # produced for consumers that had already gone (event loop).
        self.abort_latencies: deque[float] = deque(maxlen=4096)
        self.abort_latency = CumulativeHistogram(ABORT_LATENCY_BUCKETS)
        self.tokens_after_gone = 0
        self.rejected_overloaded = 0

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the step thread; outputs are delivered on ``loop`` (default: the running loop)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the step thread (pending requests are aborted)."""
        self._stop = True
        self._wake.set()
        self.faults.release()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    def stalled_for(self) -> float:
        """Seconds the current step has been running (0 between steps: an idle loop is fine)."""
        started = self._step_started
        return 0.0 if started is None else max(0.0, time.monotonic() - started)

    def health_problem(self) -> str | None:
        """Why this engine cannot serve, or ``None``: the loop died, its thread is gone, or it has
        had work without finishing a step for ``stall_timeout_s``. An idle loop is healthy."""
        if self.dead is not None:
            return f"engine step loop died: {self.dead!r}"
        if self._thread is None or not self._thread.is_alive():
            return "engine step loop is not running"
        stalled = self.stalled_for()
        if stalled > self.stall_timeout_s:
            return f"engine step loop has made no progress for {stalled:.0f} s"
        return None

    def stats(self) -> EngineStats:
        """The latest snapshot (taken by the step thread after each step)."""
        return self._stats

    def cancellation_stats(self) -> dict[str, Any]:
        """Open streams, tokens generated for consumers already gone, abort-latency histogram."""
        return {"num_streams": len(self._live_groups()), "tokens_after_gone": self.tokens_after_gone,
                "rejected_overloaded": self.rejected_overloaded,
                "abort_latency_buckets": self.abort_latency.buckets(), "abort_latency_sum": self.abort_latency.sum}

    def snapshot(self) -> dict[str, Any]:
        """Every gauge and counter in one plain dict (what ``/metrics`` and the router read)."""
        return {**self._stats.to_dict(), **self.cancellation_stats(),
                "max_num_seqs": self.engine.config.max_num_seqs, "block_size": self.engine.config.block_size,
                "max_waiting": self.max_waiting, "stalled_s": self.stalled_for()}

    # -- requests ---------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest, sink: Callable[[list[EngineOutput]], None] | None = None,
                       ) -> AsyncIterator[list[EngineOutput]]:
        """Stream the outputs of all ``request.n`` choices: each item holds one merged output per
        choice that produced something. The first item is choice 0's acceptance (``replica`` set;
        merged with its first tokens when they came before the consumer looked). Leaving the
        iteration early (break, cancellation, client gone) aborts every unfinished choice in the
        engine.

        With ``sink``, only the first item is yielded: every later one is handed to ``sink`` on the
        event loop as each step's outputs arrive, and the iteration ends (or raises the request's
        error) when the last choice finishes. ``sink`` must not block or raise. Why: a replica
        that forwards every request's tokens to a shared channel would otherwise wake one task
        per request per step, loop work that holds the GIL the step thread needs."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead!r}")
        ids = request.choice_ids()
        for rid in ids:
            if rid in self._groups:
                raise DuplicateRequestIdError(f"engine request id {rid!r} is already in use")
        template = None
        if request.grammar is not None:
            if self.engine.grammars is None:
                raise RequestRejectedError("structured outputs are not available on this engine")
            template = await self.engine.grammars.prepare(request.grammar)  # on a worker thread
        group = _Group(request, ids, _Stream(), grammar_template=template)
        for rid in ids:
            self._groups[rid] = group
        self._add(group, 0)
        stream = group.stream
        try:
            while len(group.finished) < len(ids):
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    raise stream.error
                outs, stream.pending = stream.pending, []
                if not outs:
                    continue
                items = self._take(group, outs)
                if group.sink is not None:  # pushed here, not by a step (a sibling dropped unstarted)
                    group.sink(items)
                    continue
                yield items
                if sink is not None and group.sink is None:
                    group.sink = sink
                    if stream.pending:  # arrived while the first item was on its way
                        outs, stream.pending = stream.pending, []
                        sink(self._take(group, outs))
        finally:
            for rid in ids:
                self._groups.pop(rid, None)
                if rid in group.added and rid not in group.finished:
                    self._send("abort", (rid, time.monotonic()))

    def _take(self, group: _Group, outs: list[EngineOutput]) -> list[EngineOutput]:
        """Merge one group's outputs into one per choice; note finished choices, and start the
        siblings once choice 0 has produced (its prompt is computed and cached by then)."""
        items = merge_group(outs)
        ids = group.ids
        for out in items:
            if out.finish_reason is not None:
                group.finished.add(out.request_id)
            if out.index == 0 and (out.new_token_ids or out.finish_reason) and len(group.added) < len(ids):
                for i in range(1, len(ids)):
                    self._add(group, i)
        return items

    def _add(self, group: _Group, index: int) -> None:
        rid = group.ids[index]
        if rid in group.dropped or rid in group.added:
            return
        group.added.add(rid)
        req = group.request
        params = req.sampling_params
        if index and params.seed is not None:  # distinct choices from one seed: seed + index
            params = dataclasses.replace(params, seed=params.seed + index)
        self._send("add", (rid, index, req, params, len(group.ids) if index == 0 else 0, time.monotonic(),
                           group.grammar_template))

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` (no-op if unknown or finished). Its stream ends with a final
        ``finish_reason="abort"`` item; a sibling choice not yet started ends at once."""
        group = self._groups.get(request_id)
        if group is not None and request_id not in group.added:
            if request_id not in group.dropped:
                group.dropped.add(request_id)
                group.stream.push(EngineOutput(request_id, [], finish_reason="abort",
                                               index=group.ids.index(request_id)))
            return
        self._send("abort", (request_id, time.monotonic()))

    def _send(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    # -- the step thread ----------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        engine = self.engine
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._deliver_add(*payload)
            elif kind == "abort":
                rid, asked = payload
                if engine.abort(rid):
                    # Blocks are free now; the latency runs from the consumer leaving to here.
                    latency = time.monotonic() - asked
                    self.abort_latencies.append(latency)
                    self.abort_latency.observe(latency)

    def _deliver_add(self, rid: str, index: int, request: EngineRequest, params: Any, admit: int,
                     arrival: float, grammar_template: Any = None) -> None:
        """Runs on the step thread, so the queue check sees the scheduler's exact waiting count."""
        try:
            waiting = len(self.engine.scheduler.waiting)
            if admit and waiting + admit > self.max_waiting:
                self.rejected_overloaded += 1
                raise EngineOverloadedError(
                    f"The server is busy: {waiting} requests are waiting (limit {self.max_waiting}). "
                    "Retry later.", replica=self.replica, retry_after=1.0)
            req = self.engine.add_request(rid, request.prompt_token_ids, params, arrival, grammar=request.grammar,
                                          grammar_template=grammar_template)
            req.trace = request.trace_context or None
            if index == 0:
                # An empty first item says "accepted": callers can commit to a 200 response now and
                # still report queue-full or invalid requests with their own status before it.
                self._call_loop(self._dispatch, [EngineOutput(rid, [], num_prompt_tokens=req.num_prompt_tokens,
                                                              index=0, replica=self.replica)])
        except EngineError as exc:
            self._call_loop(self._fail_stream, rid, exc)

    def _fail_stream(self, rid: str, exc: BaseException) -> None:
        group = self._groups.get(rid)
        if group is not None:
            group.stream.fail(exc)

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        direct: dict[int, tuple[_Group, list[EngineOutput]]] = {}
        for out in outputs:
            group = self._groups.get(out.request_id)
            if group is not None:
                out.index = group.ids.index(out.request_id) if len(group.ids) > 1 else 0
                if group.sink is not None and group.stream.error is None:
                    direct.setdefault(id(group), (group, []))[1].append(out)
                else:
                    group.stream.push(out)
            elif out.finish_reason != "abort":
                self.tokens_after_gone += len(out.new_token_ids)  # nobody will read these
        for group, outs in direct.values():
            try:
                group.sink(self._take(group, outs))  # type: ignore[misc]
            except Exception as exc:  # noqa: BLE001 - a broken sink ends its own request only
                logger.exception("output sink of %s failed", group.ids[0])
                group.stream.fail(exc)
                continue
            if len(group.finished) == len(group.ids):
                group.stream.event.set()  # its task ends the iteration

    def _call_loop(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _run(self) -> None:
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
                    self._stats = engine.stats()
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                self._step_started = t0 = time.monotonic()
                self.faults.before_step()
                outputs = engine.step()
                self._step_started, now = None, time.monotonic()
                self._stats = engine.stats()
                if outputs:
                    self._call_loop(self._dispatch, outputs)
                for rid, error in engine.take_failures():
                    self._call_loop(self._fail_stream, rid, error)
                if self.step_hook is not None:
                    self.step_hook(engine, outputs, now - t0)
        except BaseException as exc:  # noqa: BLE001 - any crash makes the engine dead, loudly
            logger.exception("engine step loop died")
            self.dead = exc
            error = EngineDeadError(f"engine step loop died: {exc!r}")
            self._call_loop(self._fail_all, error)
            return
        for rid in list(engine.requests):
            engine.abort(rid)

    def _fail_all(self, error: BaseException) -> None:
        for group in self._live_groups():
            group.stream.fail(error)

    def _live_groups(self) -> list[_Group]:
        return list({id(g): g for g in self._groups.values()}.values())
