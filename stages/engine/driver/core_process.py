"""The step loop in a process of its own (``engine.core_process: true``).

Why: in the replica the step thread shares one interpreter with the replica's event loop (Serve's
RPCs, the channel pushes, the reports). Every torch op and kernel call drops the GIL and takes it
back, so the step thread waits whenever the loop holds it. Here :class:`StepLoop` runs alone in a
child process, as vLLM's V1 engine core does; the replica keeps the asyncio side
(:class:`stages.engine.driver.async_engine.AsyncEngine`) and talks to it over one socket pair.

What crosses, all pickled (:mod:`multiprocessing.connection` framing):
- to the child: ``("add", AddRequest)``, ``("abort", (id, asked))``, ``("fault", (kind, after))``,
  ``("stop", None)``;
- to the parent: ``("ready", CoreInfo)`` once the model is loaded, then one ``("batch", [...])``
  per step (and per inbox drain that produced something): the loop's emitted messages
  (``outputs`` / ``fail`` / ``dead``) followed by its :class:`LoopStatus`.

One value is shared instead of sent: when the step in progress began (a double in a ``memfd``
both processes map), so the parent's stall check sees a hung step that sends nothing.

The child is ``python -m stages.engine.driver.core_process`` (a plain interpreter: nothing of Ray's
worker is imported or re-run there). It ends with its parent: the socket closes when the parent
dies however it dies, and the child stops after its step in progress, or exits outright 5 s
later. (Not ``PR_SET_PDEATHSIG``: it fires when the *thread* that spawned the child ends, and the
replica spawns it from a pool thread.) A child that exits makes the engine dead, and
the replica's health check replaces the replica. Structured-output grammars are built in the
child, on its grammar pool, never on the step thread. Tracing is configured in the child from the
same settings, so the engine's spans still join the request's trace.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from stages.config import EngineSettings, TracingSettings
from stages.engine.core.engine import EngineStats
from stages.engine.core.errors import EngineDeadError, EngineError, RequestRejectedError
from stages.engine.driver.step_loop import AddRequest, LoopStatus, StepLoop

logger = logging.getLogger("lifecycle.engine")

#: How long the parent waits for the child to load the model and say it is ready.
READY_TIMEOUT_S = 600.0


@dataclass
class CoreSpec:
    """Everything the child needs to build its engine and loop (sent as the first message)."""

    model: str
    config: EngineSettings
    max_waiting: int = 256
    replica: str = ""
    thread_nice: int | None = None
    fault_injection: bool = False
    tracing: TracingSettings | None = None


@dataclass
class CoreInfo:
    """What the child tells the parent once its engine is built."""

    pid: int
    max_model_len: int
    num_blocks: int
    stats: EngineStats
    extra: dict[str, Any] = field(default_factory=dict)


class CoreProcess:
    """The parent's side: spawn the child, send it requests, hand what it emits to ``emit``."""

    def __init__(self, spec: CoreSpec) -> None:
        self.spec = spec
        self.info: CoreInfo | None = None
        self.dead: BaseException | None = None
        self.status: LoopStatus | None = None
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
        """Monotonic time the child's step in progress began (``CLOCK_MONOTONIC`` is system-wide),
        ``None`` between steps."""
        value = struct.unpack_from("d", self._slot, 0)[0]
        return None if math.isnan(value) else value

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, emit: Callable[[list[tuple[Any, ...]]], None]) -> CoreInfo:
        """Spawn the child and block until its engine is loaded. ``emit`` gets each batch of the
        child's messages, on a reader thread of this process."""
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        # The child imports this package the way this process does, wherever Ray put it.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._proc = subprocess.Popen([sys.executable, "-m", "stages.engine.driver.core_process", str(child_sock.fileno()),
                                       str(self._slot_fd)],
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
        kind, info = self._conn.recv()
        if kind != "ready":
            raise EngineDeadError(f"the engine core process failed to start: {info!r}")
        self.info = info
        self.status = LoopStatus(info.stats, extra=dict(info.extra))
        self._reader = threading.Thread(target=self._read, args=(emit,), name="engine-core-reader", daemon=True)
        self._reader.start()
        return info

    def send(self, kind: str, payload: Any) -> None:
        """Queue a message for the child's next step (dropped once the child is gone)."""
        if self._conn is None or self.dead is not None:
            return
        try:
            with self._send_lock:
                self._conn.send((kind, payload))
        except (OSError, ValueError):  # the child is gone; the reader reports it
            pass

    def take_ttfts(self) -> list[float]:
        ttfts = self._ttfts  # popleft against the reader's append: safe across threads
        return [ttfts.popleft() for _ in range(len(ttfts))]

    def alive(self) -> bool:
        return self.dead is None and self._proc is not None and self._proc.poll() is None

    def _read(self, emit: Callable[[list[tuple[Any, ...]]], None]) -> None:
        assert self._conn is not None and self._proc is not None
        while True:
            try:
                kind, messages = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind != "batch":
                continue
            status = messages[-1][1] if messages and messages[-1][0] == "status" else None
            if status is not None:
                messages = messages[:-1]
                self._ttfts.extend(status.new_ttfts)
                self.status = status
            for message in messages:
                if message[0] == "dead":
                    self.dead = message[1]
            if messages:
                emit(messages)
        if self.dead is None and not self._stopping:
            code = self._proc.wait()
            self.dead = EngineDeadError(f"the engine core process exited (code {code})")
            emit([("dead", self.dead)])

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the child to stop (pending requests are aborted there); kill it if it does not."""
        self._stopping = True
        if self._proc is None:
            return
        self.send("stop", None)
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
    """:class:`StepLoop` whose messages are buffered and written to the parent once per step."""

    def __init__(self, engine: Any, conn: Connection, slot: mmap.mmap, tracer: Any, **kwargs: Any) -> None:
        self._slot = slot  # before StepLoop's __init__ sets step_started
        self._buffer: list[tuple[Any, ...]] = []
        self._conn = conn
        self._conn_lock = threading.Lock()
        self._tracer = tracer
        super().__init__(engine, self._buffer_message, build_grammar=self._build_grammar, **kwargs)
        self._building: set[str] = set()
        self._cancelled: set[str] = set()
        #: The step count when the loop last published an idle status (once per idle spell).
        self._idle_at = -1

    @property  # type: ignore[override]
    def step_started(self) -> float | None:
        value = struct.unpack_from("d", self._slot, 0)[0]
        return None if math.isnan(value) else value

    @step_started.setter
    def step_started(self, value: float | None) -> None:
        struct.pack_into("d", self._slot, 0, math.nan if value is None else value)

    def _buffer_message(self, kind: str, *args: Any) -> None:
        if kind == "dead":  # what crashed may not pickle; its text does
            args = (EngineDeadError(f"engine step loop died: {args[0]!r}"),)
        self._buffer.append((kind, *args))
        if kind == "dead":
            self._flush()

    def _flush(self, with_status: bool = True) -> None:
        batch = self._buffer
        self._buffer = []
        if with_status:
            status = self.status()
            status.extra["traced_requests"] = self._tracer.num_traced
            batch.append(("status", status))
        if batch:
            with self._conn_lock:
                self._conn.send(("batch", batch))

    def _drain_inbox(self) -> None:
        super()._drain_inbox()
        if self._buffer:  # acceptances and refusals go out now, not after the step
            self._flush(with_status=False)

    def stepped(self) -> None:
        self._flush()

    def idle(self) -> None:
        if self._buffer or self.engine.num_steps != self._idle_at:
            self._idle_at = self.engine.num_steps
            self._flush()

    def send(self, kind: str, payload: Any) -> None:
        if kind == "abort" and payload[0] in self._building:
            self._cancelled.add(payload[0])  # its add is still being built: drop it when it returns
            return
        super().send(kind, payload)

    def _build_grammar(self, add: AddRequest) -> bool:
        grammars = self.engine.grammars
        self._building.add(add.request_id)

        def build() -> None:
            started = time.monotonic()
            try:
                add.grammar_template = grammars.build(add.request.grammar)
                if time.monotonic() - started > grammars.compile_timeout_s:
                    raise RequestRejectedError(f"building the {add.request.grammar.kind} grammar took longer "
                                               f"than {grammars.compile_timeout_s:g} s")
            except EngineError as exc:
                self._finish_build(add, exc)
                return
            except Exception as exc:  # noqa: BLE001 - a broken grammar ends its request only
                self._finish_build(add, RequestRejectedError(f"the grammar failed to build: {exc}"))
                return
            self._finish_build(add, None)

        grammars._pool.submit(build)
        return True

    def _finish_build(self, add: AddRequest, error: EngineError | None) -> None:
        rid = add.request_id
        self._building.discard(rid)
        if rid in self._cancelled:
            self._cancelled.discard(rid)
        elif error is not None:
            super().send("reject", (rid, error))
        else:
            super().send("add", add)


#: Seconds a child whose parent is gone waits for its step loop to stop before it exits anyway.
ORPHAN_GRACE_S = 5.0


def _child_main(fd: int, slot_fd: int) -> None:
    from stages.engine.core.engine import LLMEngine
    from stages.engine.driver.faults import StepFaults
    from stages.engine.driver.tracing import EngineTracer
    from stages.telemetry import configure_logging, configure_tracing

    configure_logging()
    conn = Connection(fd)
    spec: CoreSpec = conn.recv()
    configure_tracing(spec.tracing, component="engine")
    try:
        engine = LLMEngine.from_config(spec.model, spec.config)
    except BaseException as exc:  # noqa: BLE001 - the parent says why the replica failed
        conn.send(("error", repr(exc)))
        raise
    tracer = EngineTracer()
    engine.on_finish = tracer.on_finish
    loop = _ChildLoop(engine, conn, mmap.mmap(slot_fd, mmap.PAGESIZE), tracer, max_waiting=spec.max_waiting, replica=spec.replica,
                      faults=StepFaults(spec.fault_injection), thread_nice=spec.thread_nice)

    def read() -> None:
        while True:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError, pickle.UnpicklingError):
                # The parent is gone: nobody will read what this loop makes. A step that does not
                # end (a hung kernel) must not keep the process, and its memory, alive.
                loop.stop()
                time.sleep(ORPHAN_GRACE_S)
                os._exit(1)
            if kind == "stop":
                loop.stop()
                return
            loop.send(kind, payload)

    conn.send(("ready", CoreInfo(os.getpid(), engine.max_model_len, engine.block_manager.num_blocks, engine.stats(),
                                 {"traced_requests": 0})))
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
