"""Streams each request's outputs from the engine's step loop to asyncio.

The loop (:class:`stages.engine.driver.step_loop.StepLoop`) runs on a background thread of this process,
or alone in a child process (:mod:`stages.engine.driver.core_process`). Why a thread at all: a step is
mostly torch work that releases the GIL, so the event loop (Ray's RPCs, new requests, aborts)
stays responsive while the model runs, and new requests join the batch at the next step. All
engine state is touched by the loop only: ``add`` and ``abort`` are messages in its inbox, drained
at the top of every step, so an abort frees the request's blocks at the engine's next step.

Streaming: each API request (all its ``n`` choices) has one :class:`_Stream`. The step loop hands
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
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from stages.transport.channel import merge_group
from stages.engine.driver.core_process import CoreProcess
from stages.config import EngineSettings
from stages.engine.core.engine import EngineStats, LLMEngine
from stages.engine.core.errors import DuplicateRequestIdError, EngineDeadError, RequestRejectedError
from stages.engine.driver.faults import StepFaults
from stages.engine.driver.step_loop import (
    ABORT_LATENCY_BUCKETS,
    AddRequest,
    CumulativeHistogram,
    LoopStatus,
    StepHook,
    StepLoop,
)
from stages.transport.messages import EngineOutput, EngineRequest

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


class AsyncEngine:
    """The asyncio side of an engine: per-request streams over a :class:`StepLoop`.

    The loop runs on a thread of this process (``AsyncEngine(engine)``), or in a child process
    (``AsyncEngine(core=CoreProcess(...))``, :mod:`stages.engine.driver.core_process`): everything below
    is the same for both, since the loop's messages arrive here the same way.

    ``replica`` names this engine replica on the acceptance item of every stream, so an abort by
    id can be routed back here. The waiting-queue bound is checked by the loop when it takes a
    request in, against the scheduler's own queue: it is exact under bursts.
    """

    def __init__(self, engine: LLMEngine | None = None, *, max_waiting: int = 256,
                 step_hook: StepHook | None = None, replica: str = "", stall_timeout_s: float = 60.0,
                 faults: StepFaults | None = None, thread_nice: int | None = None,
                 core: CoreProcess | None = None) -> None:
        if (engine is None) == (core is None):
            raise ValueError("give an engine (step loop on a thread) or a core process, not both")
        #: The engine, when its loop runs in this process (``None`` with a core process).
        self.engine = engine
        self.core = core
        #: Test-only fault hook (:mod:`stages.engine.driver.faults`); off unless enabled. With a core
        #: process this copy only checks that arming is allowed; the child's copy fires.
        self.faults = faults or StepFaults(core.spec.fault_injection if core is not None else False)
        self.max_waiting = max_waiting
        self.replica = replica
        self.stall_timeout_s = stall_timeout_s
        self._steps = (StepLoop(engine, self._from_thread, max_waiting=max_waiting, replica=replica,
                                faults=self.faults, thread_nice=thread_nice, step_hook=step_hook)
                       if engine is not None else None)
        self.config: EngineSettings = engine.config if engine is not None else core.spec.config  # type: ignore[union-attr]
        #: Engine request id → the group it belongs to (every choice of a group maps to it).
        self._groups: dict[str, _Group] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        #: Tokens produced for consumers that had already gone (counted on the event loop).
        self.tokens_after_gone = 0

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the step loop; outputs are delivered on ``loop`` (default: the running loop). With
        a core process this blocks until the child has loaded the model (run it off the loop)."""
        if self._thread is not None or (self.core is not None and self.core.info is not None):
            return
        self._loop = loop or asyncio.get_running_loop()
        if self.core is not None:
            self.core.start(lambda messages: self._call_loop(self._on_messages, messages))
            return
        assert self._steps is not None
        self._thread = threading.Thread(target=self._steps.run, name="engine-step-loop", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the step loop (pending requests are aborted)."""
        if self.core is not None:
            self.core.shutdown()
            return
        assert self._steps is not None
        self._steps.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def dead(self) -> BaseException | None:
        """What killed the step loop, or ``None``."""
        return self.core.dead if self.core is not None else self._steps.dead  # type: ignore[union-attr]

    @property
    def is_alive(self) -> bool:
        if self.core is not None:
            return self.core.alive()
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def max_model_len(self) -> int:
        if self.core is not None:
            assert self.core.info is not None, "start() first"
            return self.core.info.max_model_len
        return self.engine.max_model_len  # type: ignore[union-attr]

    @property
    def num_blocks(self) -> int:
        if self.core is not None:
            assert self.core.info is not None, "start() first"
            return self.core.info.num_blocks
        return self.engine.block_manager.num_blocks  # type: ignore[union-attr]

    @property
    def abort_latencies(self) -> deque[float]:
        """Recent abort latencies (seconds): the thread-driven loop only (tests)."""
        assert self._steps is not None, "kept by the step loop's own process"
        return self._steps.abort_latencies

    def stalled_for(self) -> float:
        """Seconds the current step has been running (0 between steps: an idle loop is fine)."""
        started = self.core.step_started() if self.core is not None else self._steps.step_started  # type: ignore[union-attr]
        return 0.0 if started is None else max(0.0, time.monotonic() - started)

    def health_problem(self) -> str | None:
        """Why this engine cannot serve, or ``None``: the loop died, its thread (or process) is
        gone, or it has had work without finishing a step for ``stall_timeout_s``. An idle loop
        is healthy."""
        if self.dead is not None:
            return f"engine step loop died: {self.dead!r}"
        if not self.is_alive:
            return "engine step loop is not running"
        stalled = self.stalled_for()
        if stalled > self.stall_timeout_s:
            return f"engine step loop has made no progress for {stalled:.0f} s"
        return None

    def _status(self) -> LoopStatus:
        if self.core is not None:
            assert self.core.status is not None, "start() first"
            return self.core.status
        steps = self._steps
        assert steps is not None
        return LoopStatus(steps.stats, steps.rejected_overloaded, list(steps.abort_latency.counts),
                          steps.abort_latency.sum)

    def stats(self) -> EngineStats:
        """The latest snapshot (taken by the step loop after each step)."""
        return self._status().stats

    def take_ttfts(self) -> list[float]:
        """Engine-side TTFTs (seconds) of the requests that got their first token since the last
        call, oldest first (the autoscaling signal)."""
        if self.core is not None:
            return self.core.take_ttfts()
        recent = self.engine.recent_ttfts  # type: ignore[union-attr]
        return [recent.popleft() for _ in range(len(recent))]

    def loop_counters(self) -> dict[str, Any]:
        """Counters kept where the step loop runs (traced requests, with a core process)."""
        return dict(self._status().extra)

    def cancellation_stats(self) -> dict[str, Any]:
        """Open streams, tokens generated for consumers already gone, abort-latency histogram."""
        status = self._status()
        histogram = CumulativeHistogram(ABORT_LATENCY_BUCKETS)
        histogram.counts = list(status.abort_latency_counts) or histogram.counts
        return {"num_streams": len(self._live_groups()), "tokens_after_gone": self.tokens_after_gone,
                "rejected_overloaded": status.rejected_overloaded,
                "abort_latency_buckets": histogram.buckets(), "abort_latency_sum": status.abort_latency_sum}

    def snapshot(self) -> dict[str, Any]:
        """Every gauge and counter in one plain dict (what ``/metrics`` and the router read)."""
        return {**self.stats().to_dict(), **self.cancellation_stats(),
                "max_num_seqs": self.config.max_num_seqs, "block_size": self.config.block_size,
                "max_waiting": self.max_waiting, "stalled_s": self.stalled_for()}

    def arm_fault(self, kind: str = "step_exception", after_steps: int = 0) -> None:
        """Tests only: make an upcoming step raise or hang (:mod:`stages.engine.driver.faults`)."""
        self.faults.arm(kind, after_steps)  # raises unless fault injection is on
        if self.core is not None:
            self.core.send("fault", (kind, after_steps))

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
        if request.grammar is not None and self.engine is not None:  # a core process builds its own
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
        self._send("add", AddRequest(rid, index, req, params, len(group.ids) if index == 0 else 0, time.monotonic(),
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
        if self.core is not None:
            self.core.send(kind, payload)
        else:
            self._steps.send(kind, payload)  # type: ignore[union-attr]

    # -- what the step loop emits (on the event loop) --------------------------------------------------
    def _from_thread(self, kind: str, *args: Any) -> None:
        self._call_loop(self._on_messages, [(kind, *args)])

    def _on_messages(self, messages: list[tuple[Any, ...]]) -> None:
        for kind, *args in messages:
            if kind == "outputs":
                self._dispatch(args[0])
            elif kind == "fail":
                self._fail_stream(*args)
            elif kind == "dead":
                self._fail_all(args[0] if isinstance(args[0], EngineDeadError)
                               else EngineDeadError(f"engine step loop died: {args[0]!r}"))

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

    def _fail_all(self, error: BaseException) -> None:
        for group in self._live_groups():
            group.stream.fail(error)

    def _live_groups(self) -> list[_Group]:
        return list({id(g): g for g in self._groups.values()}.values())
