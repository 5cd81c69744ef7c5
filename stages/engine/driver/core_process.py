"""The step loop alone in a child process: the driver (parent side) and the child's main.

Why: the replica's event loop (Ray's RPCs, the transport) holds the GIL, and the step loop waits
for it whenever the loop holds it. Here :class:`StepLoop` runs alone in a child process, as vLLM's
V1 engine core does; the replica keeps the asyncio side
(:class:`stages.engine.driver.async_engine.AsyncEngine`) and talks to the child over one socket
pair, with the messages of :mod:`stages.engine.driver.messages`, pickled
(:mod:`multiprocessing.connection` framing):

- to the child: a :class:`LoopSpec` first, then :class:`AddRequest`, :class:`Abort`,
  :class:`ArmFault` and :class:`Stop`;
- to the parent: :class:`Ready` once the model is loaded (or :class:`StartFailed`), then one
  :class:`StepBatch` per step (and per inbox drain that produced something): the loop's events
  and, after a step, its :class:`LoopStatus`.

One value is shared instead of sent: when the step in progress began (a double in a ``memfd``
both processes map), so the parent's stall check sees a hung step that sends nothing.

The child is ``python -m stages.engine.driver.core_process`` (a plain interpreter: nothing of Ray's
worker is imported or re-run there). It ends with its parent: the socket closes when the parent
dies however it dies, and the child stops after its step in progress, or exits outright
``ORPHAN_GRACE_S`` later. (Not ``PR_SET_PDEATHSIG``: it fires when the *thread* that spawned the
child ends, and the replica spawns it from a pool thread.) A child that exits makes the engine
dead, and the replica's health check replaces the replica. Tracing is configured in the child from
the same settings, so the engine's spans still join the request's trace.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

from stages.config import EngineSettings
from stages.engine.core.errors import EngineDeadError
from stages.engine.driver.faults import StepFaults
from stages.engine.driver.interface import Deliver
from stages.engine.driver.messages import (
    ArmFault,
    Dead,
    Kind,
    LoopEvent,
    LoopSpec,
    LoopStatus,
    Ready,
    StartFailed,
    StepBatch,
    Stop,
    ToLoop,
)
from stages.engine.driver.step_loop import StepLoop

logger = logging.getLogger("lifecycle.engine")

#: How long the parent waits for the child to load the model and say it is ready.
READY_TIMEOUT_S = 600.0
#: Seconds a child whose parent is gone waits for its step loop to stop before it exits anyway.
ORPHAN_GRACE_S = 5.0


def _read_slot(slot: mmap.mmap) -> float | None:
    value = struct.unpack_from("d", slot, 0)[0]
    return None if math.isnan(value) else value


class ChildProcessDriver:
    """The parent's side: spawn the child, send it messages, hand its events to ``deliver``
    (see :class:`~stages.engine.driver.interface.Driver`)."""

    def __init__(self, spec: LoopSpec) -> None:
        self.spec = spec
        self.config: EngineSettings = spec.config
        self.max_waiting = spec.max_waiting
        self.replica = spec.replica
        self.ready: Ready | None = None
        self._dead: BaseException | None = None
        self._status: LoopStatus | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._stopping = False
        #: Engine-side TTFTs from the child's statuses (appended by the reader, drained by the loop).
        self._ttfts: deque[float] = deque(maxlen=4096)
        #: When the child's step in progress began (NaN between steps), written by the child.
        self._slot_fd = os.memfd_create("lifecycle-step-started")
        os.ftruncate(self._slot_fd, mmap.PAGESIZE)
        self._slot = mmap.mmap(self._slot_fd, mmap.PAGESIZE)
        struct.pack_into("d", self._slot, 0, math.nan)

    def step_started(self) -> float | None:
        """Monotonic time the child's step in progress began (``CLOCK_MONOTONIC`` is system-wide)."""
        return _read_slot(self._slot)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def dead(self) -> BaseException | None:
        return self._dead

    @property
    def max_model_len(self) -> int:
        assert self.ready is not None, "start() first"
        return self.ready.max_model_len

    @property
    def num_blocks(self) -> int:
        assert self.ready is not None, "start() first"
        return self.ready.num_blocks

    def status(self) -> LoopStatus:
        assert self._status is not None, "start() first"
        return self._status

    def start(self, deliver: Deliver) -> None:
        """Spawn the child and block until its engine is loaded; ``deliver`` gets each batch of
        its events, on a reader thread of this process."""
        if self.ready is not None:
            return
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        # The child imports this package the way this process does, wherever Ray put it.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._proc = subprocess.Popen([sys.executable, "-m", "stages.engine.driver.core_process",
                                       str(child_sock.fileno()), str(self._slot_fd)],
                                      pass_fds=(child_sock.fileno(), self._slot_fd), env=env, close_fds=True)
        child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self._conn.send(self.spec)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._conn.poll(1.0):
            if self._proc.poll() is not None:
                raise EngineDeadError(f"the engine core process exited with code {self._proc.returncode} "
                                      "before it was ready (its log says why)")
            if time.monotonic() > deadline:
                self.shutdown()
                raise EngineDeadError(f"the engine core process was not ready after {READY_TIMEOUT_S:.0f} s")
        first: Ready | StartFailed = self._conn.recv()
        if isinstance(first, StartFailed):
            raise EngineDeadError(f"the engine core process failed to start: {first.reason!r}")
        self.ready = first
        self._status = first.status
        self._reader = threading.Thread(target=self._read, args=(deliver,), name="engine-core-reader", daemon=True)
        self._reader.start()

    def send(self, message: ToLoop) -> None:
        if self._conn is None or self._dead is not None:
            return
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):  # the child is gone; the reader reports it
            pass

    def arm_fault(self, fault: str, after_steps: int) -> None:
        StepFaults(self.spec.fault_injection).arm(fault, after_steps)  # refused here, as in the child
        self.send(ArmFault(fault, after_steps))

    def take_ttfts(self) -> list[float]:
        ttfts = self._ttfts  # popleft against the reader's append: safe across threads
        return [ttfts.popleft() for _ in range(len(ttfts))]

    def alive(self) -> bool:
        return self._dead is None and self._proc is not None and self._proc.poll() is None

    def _read(self, deliver: Deliver) -> None:
        assert self._conn is not None and self._proc is not None
        while True:
            try:
                batch: StepBatch = self._conn.recv()
            except (EOFError, OSError):
                break
            if batch.status is not None:
                self._ttfts.extend(batch.status.new_ttfts)
                if batch.status.prefix is None and self._status is not None:
                    batch.status.prefix = self._status.prefix
                self._status = batch.status
            events = batch.events
            if events:
                last = events[-1]  # a Dead is always the last event the child sends
                if isinstance(last, Dead):
                    self._dead = last.error
                deliver(events)
        if self._dead is None and not self._stopping:
            code = self._proc.wait()
            self._dead = EngineDeadError(f"the engine core process exited (code {code})")
            deliver([Dead(self._dead)])

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the child to stop (pending requests are aborted there); kill it if it does not."""
        self._stopping = True
        if self._proc is None:
            return
        self.send(Stop())
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._conn is not None:
            self._conn.close()
        if self._slot_fd >= 0:  # a second shutdown (a failed start, then the replica's __del__)
            os.close(self._slot_fd)  # the mapping stays valid (and readable) after this
            self._slot_fd = -1


# -- the child ----------------------------------------------------------------------------------------
class _ChildLoop(StepLoop):
    """:class:`StepLoop` whose events are buffered and written to the parent once per step."""

    def __init__(self, engine: Any, conn: Connection, slot: mmap.mmap, **kwargs: Any) -> None:
        self._slot = slot  # before StepLoop's __init__ sets step_started
        self._buffer: list[LoopEvent] = []
        self._conn = conn
        self._conn_lock = threading.Lock()
        super().__init__(engine, self._buffer_event, **kwargs)
        #: The step count when the loop last published an idle status (once per idle spell).
        self._idle_at = -1
        #: The prefix summary the parent has (a summary crosses the pipe once).
        self._prefix_sent: Any = None

    @property
    def step_started(self) -> float | None:
        return _read_slot(self._slot)

    @step_started.setter
    def step_started(self, value: float | None) -> None:
        struct.pack_into("d", self._slot, 0, math.nan if value is None else value)

    def _buffer_event(self, event: LoopEvent) -> None:
        self._buffer.append(event)
        if event.kind is Kind.DEAD:
            self._flush()

    def _flush(self, with_status: bool = True) -> None:
        events, self._buffer = self._buffer, []
        status = None
        if with_status:
            status = self.status()
            status.new_ttfts = self.take_ttfts()
            if status.prefix is self._prefix_sent:
                status.prefix = None  # unchanged: the parent keeps the last one
            else:
                self._prefix_sent = status.prefix
        if events or status is not None:
            with self._conn_lock:
                self._conn.send(StepBatch(events, status))

    def _drain_inbox(self) -> None:
        super()._drain_inbox()
        if self._buffer:  # acceptances and refusals go out now, not after the step
            self._flush(with_status=False)

    def stepped(self) -> None:
        self._flush()

    def idle(self) -> None:
        if self._buffer or self.engine.num_steps != self._idle_at or self.prefix is not self._prefix_sent:
            self._idle_at = self.engine.num_steps
            self._flush()


def _child_main(fd: int, slot_fd: int) -> None:
    from stages.engine.core.engine import LLMEngine
    from stages.engine.driver.tracing import EngineTracer
    from stages.telemetry import configure_logging, configure_tracing

    configure_logging()
    conn = Connection(fd)
    spec: LoopSpec = conn.recv()
    configure_tracing(spec.tracing, component="engine")
    try:
        engine = LLMEngine.from_config(spec.model, spec.config)
    except BaseException as exc:  # noqa: BLE001 - the parent says why the replica failed
        conn.send(StartFailed(repr(exc)))
        raise
    loop = _ChildLoop(engine, conn, mmap.mmap(slot_fd, mmap.PAGESIZE), max_waiting=spec.max_waiting,
                      replica=spec.replica, faults=StepFaults(spec.fault_injection), thread_nice=spec.thread_nice,
                      tracer=EngineTracer())

    def read() -> None:
        while True:
            try:
                message: ToLoop = conn.recv()
            except (EOFError, OSError, pickle.UnpicklingError):
                # The parent is gone: nobody will read what this loop makes. A step that does not
                # end (a hung kernel) must not keep the process, and its memory, alive.
                loop.stop()
                time.sleep(ORPHAN_GRACE_S)
                os._exit(1)
            if message.kind is Kind.STOP:
                loop.stop()
                return
            loop.send(message)

    conn.send(Ready(os.getpid(), engine.max_model_len, engine.block_manager.num_blocks, loop.status()))
    threading.Thread(target=read, name="engine-core-inbox", daemon=True).start()
    loop.run()
    try:
        from opentelemetry import trace

        provider = trace.get_tracer_provider()
        if hasattr(provider, "shutdown"):
            provider.shutdown()  # flush the spans still batched
    finally:
        conn.close()


if __name__ == "__main__":
    # Through the package, not this ``__main__`` copy: what is pickled must name
    # ``stages.engine.driver.core_process``, the module the parent knows.
    from stages.engine.driver import core_process

    core_process._child_main(int(sys.argv[1]), int(sys.argv[2]))
