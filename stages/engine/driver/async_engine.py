"""Streams each request's outputs from the engine's step loop to asyncio.

The loop (:class:`stages.engine.driver.step_loop.StepLoop`) runs wherever its driver puts it
(:mod:`stages.engine.driver.interface`: a thread of this process, or a child process); this side
is the same for both. ``add`` and ``abort`` are messages to the loop, taken at the top of its next
step, so an abort frees the request's blocks at the engine's next step.

Streaming: each API request (all its ``n`` choices) has one :class:`_Stream`. The driver hands
the loop's events to the event loop in one ``call_soon_threadsafe`` per delivery; the consumer
takes *everything* that accumulated since it last looked and merges it into one output per
choice. The first token therefore goes out at once, and under load one item carries several
tokens (and every choice) instead of one RPC per token per choice.

No Ray imports: the in-process benchmark and the tests use this directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from stages.config import EngineSettings
from stages.engine.core.engine import EngineStats
from stages.engine.core.errors import DuplicateRequestIdError, EngineDeadError
from stages.engine.driver.interface import Driver
from stages.engine.driver.messages import Abort, AddRequest, Dead, Fail, Kind, LoopEvent, Outputs
from stages.engine.driver.step_loop import ABORT_LATENCY_BUCKETS, CumulativeHistogram
from stages.transport.channel import merge_group
from stages.transport.messages import EngineOutput, EngineRequest, PrefixSummary

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
    """The ``n`` choices of one API request: the first one still open (choice 0, unless the request
    moved here after it finished) runs first, its siblings join once it has produced its first
    token, so they find the prompt's blocks in the prefix cache."""

    request: EngineRequest
    ids: list[str]
    stream: _Stream
    #: The index of the choice that runs first.
    leader: int = 0
    #: Choices handed to the step loop.
    added: set[str] = field(default_factory=set)
    #: Choices that have streamed their final item.
    finished: set[str] = field(default_factory=set)
    #: Siblings aborted before they were ever added.
    dropped: set[str] = field(default_factory=set)
    #: Set once the first item is taken when ``generate`` was given a ``sink``: later outputs go
    #: to it straight from the step's delivery, without waking the request's own task.
    sink: Callable[[list[EngineOutput]], None] | None = None


class AsyncEngine:
    """The asyncio side of an engine: per-request streams over a step loop run by ``driver``.

    The replica name (on the acceptance item of every stream, so an abort by id can be routed
    back here), the waiting-queue bound and the engine config are the driver's: each is given
    once, where the loop is built. The waiting-queue bound is checked by the loop when it takes a
    request in, against the scheduler's own queue: it is exact under bursts.
    """

    def __init__(self, driver: Driver, *, stall_timeout_s: float = 60.0) -> None:
        self.driver = driver
        self.stall_timeout_s = stall_timeout_s
        #: Engine request id → the group it belongs to (every choice of a group maps to it).
        self._groups: dict[str, _Group] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Tokens produced for consumers that had already gone (counted on the event loop).
        self.tokens_after_gone = 0
        self._handlers: dict[Kind, Callable[[Any], None]] = {
            Kind.OUTPUTS: self._on_outputs, Kind.FAIL: self._on_fail, Kind.DEAD: self._on_dead}

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the step loop; outputs are delivered on ``loop`` (default: the running loop). It
        may block while the model loads (a child process): run it off the loop then."""
        if self._loop is not None:
            return
        target = loop or asyncio.get_running_loop()

        def deliver(events: list[LoopEvent]) -> None:
            try:
                target.call_soon_threadsafe(self._on_events, events)
            except RuntimeError:  # loop closed during shutdown
                pass

        self.driver.start(deliver)
        self._loop = target

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the step loop (pending requests are aborted)."""
        self.driver.shutdown(timeout)

    @property
    def replica(self) -> str:
        return self.driver.replica

    @property
    def max_waiting(self) -> int:
        return self.driver.max_waiting

    @property
    def config(self) -> EngineSettings:
        return self.driver.config

    @property
    def dead(self) -> BaseException | None:
        """What killed the step loop, or ``None``."""
        return self.driver.dead

    @property
    def is_alive(self) -> bool:
        return self.driver.alive()

    @property
    def max_model_len(self) -> int:
        return self.driver.max_model_len

    @property
    def num_blocks(self) -> int:
        return self.driver.num_blocks

    def stalled_for(self) -> float:
        """Seconds the current step has been running (0 between steps: an idle loop is fine)."""
        started = self.driver.step_started()
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

    def stats(self) -> EngineStats:
        """The latest snapshot (taken by the step loop after each step)."""
        return self.driver.status().stats

    def prefix_summary(self) -> PrefixSummary | None:
        """What the prefix cache holds, as of the loop's latest summary (for the routers)."""
        return self.driver.status().prefix

    def take_ttfts(self) -> list[float]:
        """Engine-side TTFTs (seconds) of the requests that got their first token since the last
        call, oldest first (the autoscaling signal)."""
        return self.driver.take_ttfts()

    def loop_counters(self) -> dict[str, Any]:
        """Counters kept where the step loop runs (``traced_requests``)."""
        return dict(self.driver.status().counters)

    def cancellation_stats(self) -> dict[str, Any]:
        """Open streams, tokens generated for consumers already gone, abort-latency histogram."""
        status = self.driver.status()
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
        self.driver.arm_fault(kind, after_steps)  # raises unless fault injection is on

    # -- requests ---------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest, sink: Callable[[list[EngineOutput]], None] | None = None,
                       ) -> AsyncIterator[list[EngineOutput]]:
        """Stream the outputs of all ``request.n`` choices: each item holds one merged output per
        choice that produced something. The first item is the leading choice's acceptance (``replica`` set;
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
        group = _Group(request, ids, _Stream())
        for index in request.finished_choices:  # finished before the request moved here
            group.finished.add(ids[index])
            group.dropped.add(ids[index])
        group.leader = min(set(range(len(ids))) - set(request.finished_choices))
        for rid in ids:
            self._groups[rid] = group
        self._add(group, group.leader)
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
                    self.driver.send(Abort(rid, time.monotonic()))

    def _take(self, group: _Group, outs: list[EngineOutput]) -> list[EngineOutput]:
        """Merge one group's outputs into one per choice; note finished choices, and start the
        siblings once the leading choice has produced (its prompt is computed and cached by then)."""
        items = merge_group(outs)
        ids = group.ids
        for out in items:
            if out.finish_reason is not None:
                group.finished.add(out.request_id)
            if (out.index == group.leader and (out.new_token_ids or out.finish_reason)
                    and len(group.added) + len(group.dropped) < len(ids)):
                for i in range(len(ids)):
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
        admit = len(group.ids) - len(group.request.finished_choices) if index == group.leader else 0
        self.driver.send(AddRequest(rid, index, req, params, admit, time.monotonic()))

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
        self.driver.send(Abort(request_id, time.monotonic()))

    # -- what the step loop emits (on the event loop) --------------------------------------------------
    def _on_events(self, events: list[LoopEvent]) -> None:
        handlers = self._handlers
        for event in events:
            handlers[event.kind](event)

    def _on_fail(self, event: Fail) -> None:
        group = self._groups.get(event.request_id)
        if group is not None:
            group.stream.fail(event.error)

    def _on_dead(self, event: Dead) -> None:
        for group in self._live_groups():
            group.stream.fail(event.error)

    def _on_outputs(self, event: Outputs) -> None:
        direct: dict[int, tuple[_Group, list[EngineOutput]]] = {}
        for out in event.outputs:
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
            sink = group.sink
            assert sink is not None
            try:
                sink(self._take(group, outs))
            except Exception as exc:  # noqa: BLE001 - a broken sink ends its own request only
                logger.exception("output sink of %s failed", group.ids[0])
                group.stream.fail(exc)
                continue
            if len(group.finished) == len(group.ids):
                group.stream.event.set()  # its task ends the iteration

    def _live_groups(self) -> list[_Group]:
        return list({id(g): g for g in self._groups.values()}.values())
