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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from stages.engine.engine import EngineStats, LLMEngine, StepOutput
from stages.protocol import EngineOutput, EngineRequest, TokenLogprob

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop crashed; the engine cannot serve any more requests."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured bound."""


@dataclass
class _Stream:
    """Per-request mailbox living on the event loop."""

    pending: list[StepOutput] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    error: BaseException | None = None

    def push(self, out: StepOutput) -> None:
        self.pending.append(out)
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()


def merge_outputs(request_id: str, outs: list[StepOutput]) -> EngineOutput:
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


#: Callback invoked on the step thread after every step: (engine, step outputs, step seconds).
StepHook = Callable[[LLMEngine, list[StepOutput], float], None]


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
            raise QueueFullError(f"{self._stats.num_waiting} requests are waiting (limit {self.max_waiting})")
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
        self._send("abort", request_id)

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
                engine.abort(payload)

    def _deliver_add(self, request: EngineRequest, arrival: float) -> None:
        rid = request.request_id
        try:
            self.engine.add_request(rid, request.prompt_token_ids, request.sampling_params, arrival)
        except ValueError as exc:
            self._call_loop(self._fail_stream, rid, exc)
        finally:
            self._call_loop(self._add_delivered)

    def _add_delivered(self) -> None:
        self._in_flight_adds -= 1

    def _fail_stream(self, rid: str, exc: BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            stream.fail(exc)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.push(out)

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
