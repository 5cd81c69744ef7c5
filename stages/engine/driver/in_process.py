"""The step loop on a thread of this process.

Why a thread at all: a step is mostly torch work that releases the GIL, so the event loop (Ray's
RPCs, new requests, aborts) stays responsive while the model runs, and new requests join the batch
at the next step. Messages reach the loop through its inbox; each event it emits is handed to
``deliver`` from the loop's thread. Gauges and counters are read straight from the loop.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from stages.config import EngineSettings
from stages.engine.core.engine import LLMEngine
from stages.engine.driver.faults import StepFaults
from stages.engine.driver.interface import Deliver
from stages.engine.driver.messages import LoopEvent, LoopStatus, ToLoop
from stages.engine.driver.step_loop import StepLoop

if TYPE_CHECKING:
    from stages.engine.driver.tracing import EngineTracer


class InProcessDriver:
    """Runs ``engine``'s :class:`StepLoop` on a daemon thread (see :class:`~stages.engine.driver.interface.Driver`).

    ``faults`` is the loop's fault hook
    itself (tests arm it directly), and ``tracer`` gets every finished request."""

    def __init__(self, engine: LLMEngine, *, replica: str = "", faults: StepFaults | None = None,
                 tracer: EngineTracer | None = None) -> None:
        """The loop's own settings (waiting-queue bound, step thread priority) are the engine's
        config section's."""
        self.engine = engine
        self.config: EngineSettings = engine.config
        self.max_waiting = engine.config.max_waiting_requests
        thread_nice = engine.config.step_thread_nice
        self.replica = replica
        self._deliver: Deliver | None = None
        self.loop = StepLoop(engine, self._emit, max_waiting=self.max_waiting, replica=replica,
                             faults=faults or StepFaults(), thread_nice=thread_nice, tracer=tracer)
        self.thread: threading.Thread | None = None

    def start(self, deliver: Deliver) -> None:
        if self.thread is not None:
            return
        self._deliver = deliver
        self.thread = threading.Thread(target=self.loop.run, name="engine-step-loop", daemon=True)
        self.thread.start()

    def _emit(self, event: LoopEvent) -> None:
        assert self._deliver is not None
        self._deliver([event])

    def send(self, message: ToLoop) -> None:
        self.loop.send(message)

    def arm_fault(self, fault: str, after_steps: int) -> None:
        self.loop.faults.arm(fault, after_steps)  # at once: the loop reads it before its next step

    def shutdown(self, timeout: float = 30.0) -> None:
        self.loop.stop()
        if self.thread is not None:
            self.thread.join(timeout=timeout)

    @property
    def dead(self) -> BaseException | None:
        return self.loop.dead

    def alive(self) -> bool:
        return self.loop.dead is None and self.thread is not None and self.thread.is_alive()

    def step_started(self) -> float | None:
        return self.loop.step_started

    def status(self) -> LoopStatus:
        return self.loop.status()

    def take_ttfts(self) -> list[float]:
        return self.loop.take_ttfts()

    @property
    def pid(self) -> int | None:
        return os.getpid()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_blocks(self) -> int:
        return self.engine.block_manager.num_blocks
