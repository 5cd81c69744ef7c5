"""What :class:`~stages.engine.driver.async_engine.AsyncEngine` needs from whatever runs its step loop.

Two drivers implement it: :class:`~stages.engine.driver.in_process.InProcessDriver` (the loop on a
thread of this process) and :class:`~stages.engine.driver.core_process.ChildProcessDriver` (the
loop alone in a child process). Both carry the same messages
(:mod:`stages.engine.driver.messages`) and hand the loop's events to ``deliver``, so the asyncio
side is written once and never asks which driver it has. :func:`build_driver` picks one from the
``engine.core_process`` setting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from stages.config import EngineSettings
from stages.engine.driver.messages import LoopEvent, LoopSpec, LoopStatus, ToLoop

#: Receives the loop's events, in order, on a thread of the driver's (never the event loop's).
Deliver = Callable[[list[LoopEvent]], None]


class Driver(Protocol):
    """Runs one engine's step loop somewhere and carries messages to and from it."""

    #: The engine replica's name, on every acceptance (so an abort by id can be routed back).
    replica: str
    #: The waiting-queue bound the loop enforces.
    max_waiting: int
    config: EngineSettings

    def start(self, deliver: Deliver) -> None:
        """Start the loop; its events go to ``deliver``. May block while the model loads (run it
        off the event loop)."""

    def send(self, message: ToLoop) -> None:
        """Queue ``message`` for the loop's next step (dropped once the loop is gone)."""

    def arm_fault(self, fault: str, after_steps: int) -> None:
        """Tests only: make an upcoming step raise or hang; raises unless fault injection is on."""

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop (pending requests are aborted); a second call is a no-op."""

    @property
    def dead(self) -> BaseException | None:
        """What killed the loop, or ``None``."""

    def alive(self) -> bool:
        """Whether the loop is running (started, not dead, its thread or process still there)."""

    def step_started(self) -> float | None:
        """Monotonic time the step in progress began; ``None`` between steps."""

    def status(self) -> LoopStatus:
        """The loop's latest gauges and counters (after :meth:`start`)."""

    def take_ttfts(self) -> list[float]:
        """Engine-side TTFTs (seconds) since the last call, oldest first."""

    @property
    def pid(self) -> int | None:
        """The process the loop runs in (``None`` before a child is spawned)."""

    @property
    def max_model_len(self) -> int:
        """The engine's context length (after :meth:`start`)."""

    @property
    def num_blocks(self) -> int:
        """The engine's KV-cache blocks (after :meth:`start`)."""


def build_driver(spec: LoopSpec, child_process: bool) -> Driver:
    """The driver for ``spec``: a child process (the model loads there, in :meth:`Driver.start`)
    or a thread of this process (the model loads here, now). Engine spans are traced where the
    loop runs."""
    if child_process:
        from stages.engine.driver.core_process import ChildProcessDriver

        return ChildProcessDriver(spec)
    from stages.engine.core.engine import LLMEngine
    from stages.engine.driver.faults import StepFaults
    from stages.engine.driver.in_process import InProcessDriver
    from stages.engine.driver.tracing import EngineTracer

    return InProcessDriver(LLMEngine.from_config(spec.model, spec.config), replica=spec.replica,
                           faults=StepFaults(spec.fault_injection), tracer=EngineTracer())
