"""Drives :class:`LLMEngine` on a background thread and streams each request's outputs to asyncio.

Why a thread: a step is mostly torch work that releases the GIL, so the event loop (Ray's RPCs,
new requests, aborts) stays responsive while the model runs, and new requests join the batch at
the next step. All engine state is touched by the step thread only: ``add`` and ``abort`` are
messages in an inbox drained at the top of every step, so an abort frees the request's blocks at
the engine's next step.

Streaming: each request has a :class:`_Stream`. The step thread hands every step's outputs to the
event loop in one ``call_soon_threadsafe``; the consumer takes *everything* that accumulated since
it last looked and merges it into one :class:`EngineOutput`. The first token therefore goes out at
once, and under load one item carries several tokens instead of one RPC per token.

No Ray imports: the in-process benchmark and the tests use this directly.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from stages.engine.engine import EngineStats, LLMEngine
from stages.errors import EngineUnavailableError, InvalidRequestError, QueueFullError
from stages.protocol import EngineOutput, EngineRequest, TokenLogprob

logger = logging.getLogger(__name__)


class EngineDeadError(EngineUnavailableError):
    """The step loop crashed; the engine cannot serve any more requests."""


@dataclass
class _Stream:
    """Per-request mailbox living on the event loop."""

    pending: list[EngineOutput] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    error: BaseException | None = None

    def push(self, out: EngineOutput) -> None:
        self.pending.append(out)
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()


def merge_outputs(request_id: str, outs: list[EngineOutput]) -> EngineOutput:
    """Coalesce consecutive step outputs of one request into one streamed item."""
    tokens: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    timings: dict[str, float] = {}
    for o in outs:
        tokens.extend(o.new_token_ids)
        if o.logprobs is not None:
            logprobs = (logprobs or []) + o.logprobs
        timings.update(o.timings)
    last = outs[-1]
    return EngineOutput(request_id, tokens, logprobs, last.finish_reason, last.stop_token_id,
                        last.num_prompt_tokens, last.num_cached_tokens, timings)


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
    """Thread-driven engine with an asyncio streaming API."""

    def __init__(self, engine: LLMEngine, *, max_waiting: int = 256,
                 step_hook: StepHook | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.step_hook = step_hook
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.dead: BaseException | None = None
        self._stats = engine.stats()
        # Requests accepted but not yet seen by the step thread count towards the queue bound.
        self._in_flight_adds = 0
        # Cancellation accounting: how long aborts took to free blocks (step thread), and tokens
        # produced for consumers that had already gone (event loop).
        self.abort_latencies: deque[float] = deque(maxlen=4096)
        self.abort_latency = CumulativeHistogram(ABORT_LATENCY_BUCKETS)
        self.tokens_after_gone = 0

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
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The latest snapshot (taken by the step thread after each step)."""
        return self._stats

    def cancellation_stats(self) -> dict[str, Any]:
        """Open streams, tokens generated for consumers already gone, abort-latency histogram."""
        return {"num_streams": len(self._streams), "tokens_after_gone": self.tokens_after_gone,
                "abort_latency_buckets": self.abort_latency.buckets(), "abort_latency_sum": self.abort_latency.sum}

    # -- requests ---------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream ``request``'s outputs. Leaving the iteration early (break, cancellation, client
        gone) aborts the request in the engine."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead!r}")
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        if self._stats.num_waiting + self._in_flight_adds >= self.max_waiting:
            raise QueueFullError(f"The server is busy: {self._stats.num_waiting} requests are waiting "
                                 f"(limit {self.max_waiting}). Retry later.", retry_after=1.0)
        stream = _Stream()
        self._streams[rid] = stream
        self._in_flight_adds += 1
        self._send("add", (request, time.monotonic()))
        finished = False
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    raise stream.error
                outs, stream.pending = stream.pending, []
                if not outs:
                    continue
                item = merge_outputs(rid, outs)
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Ask the step thread to abort ``request_id`` (no-op if unknown or finished)."""
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
                request, arrival = payload
                self._deliver_add(request, arrival)
            elif kind == "abort":
                rid, asked = payload
                if engine.abort(rid):
                    # Blocks are free now; the latency runs from the consumer leaving to here.
                    latency = time.monotonic() - asked
                    self.abort_latencies.append(latency)
                    self.abort_latency.observe(latency)

    def _deliver_add(self, request: EngineRequest, arrival: float) -> None:
        rid = request.request_id
        try:
            req = self.engine.add_request(rid, request.prompt_token_ids, request.sampling_params, arrival)
            req.trace = request.trace_context or None
            # An empty first item says "accepted": callers can commit to a 200 response now and
            # still report queue-full or invalid requests with their own status before it.
            self._call_loop(self._dispatch, [EngineOutput(rid, [], num_prompt_tokens=req.num_prompt_tokens)])
        except ValueError as exc:
            self._call_loop(self._fail_stream, rid, InvalidRequestError(str(exc)))
        finally:
            self._call_loop(self._add_delivered)

    def _add_delivered(self) -> None:
        self._in_flight_adds -= 1

    def _fail_stream(self, rid: str, exc: BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            stream.fail(exc)

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.push(out)
            elif out.finish_reason != "abort":
                self.tokens_after_gone += len(out.new_token_ids)  # nobody will read these

    def _call_loop(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                self._drain_inbox()
                if not engine.has_unfinished():
                    self._stats = engine.stats()
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                t0 = time.monotonic()
                outputs = engine.step()
                elapsed = time.monotonic() - t0
                self._stats = engine.stats()
                if outputs:
                    self._call_loop(self._dispatch, outputs)
                if self.step_hook is not None:
                    self.step_hook(engine, outputs, elapsed)
        except BaseException as exc:  # noqa: BLE001 - any crash makes the engine dead, loudly
            logger.exception("engine step loop died")
            self.dead = exc
            error = EngineDeadError(f"engine step loop died: {exc!r}")
            self._call_loop(self._fail_all, error)
            return
        for rid in list(engine.requests):
            engine.abort(rid)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(error)
