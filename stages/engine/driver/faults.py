"""Test-only fault injection into the engine step loop. Off unless explicitly enabled.

The fault tests need an exception raised *inside* the engine step (a CUDA error, a bug in a model
file) on a real replica. This hook makes one, on demand, and does nothing else:

- enabled only by ``engine.fault_injection: true`` in the app config or ``LIFECYCLE_FAULT_INJECTION=1``
  in the engine replica's environment; otherwise :meth:`StepFaults.arm` refuses
  (:class:`FaultInjectionDisabledError`) and the step loop pays one attribute check per step;
- armed through the Engine deployment's ``inject_fault`` method (a handle call, never HTTP);
- fires once, on the step thread, just before the next step that has work, exactly where a real
  exception from ``LLMEngine.step`` would surface (or where a hung kernel would block).

No Ray imports (the step loop is engine core).
"""

from __future__ import annotations

import os
import threading

#: Environment switch (any of 1/true/yes enables).
ENV_VAR = "LIFECYCLE_FAULT_INJECTION"
#: ``step_exception``: the step raises (the loop dies, every stream fails at once);
#: ``step_hang``: the step blocks (the loop stalls; only the stall detector notices).
KINDS = ("step_exception", "step_hang")
#: How long an injected hang lasts at most.
MAX_HANG_S = 600.0


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes")


class FaultInjectionDisabledError(RuntimeError):
    """``inject_fault`` was called on an engine whose fault injection is off (the default)."""


class InjectedStepFault(RuntimeError):
    """The exception an armed :class:`StepFaults` raises inside the step loop."""


class StepFaults:
    """One armed fault at a time; thread-safe (armed from the event loop, fired on the step thread)."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled or enabled_by_env()
        self._lock = threading.Lock()
        self._armed: str | None = None
        self._after_steps = 0
        self._release = threading.Event()

    def arm(self, kind: str = "step_exception", after_steps: int = 0) -> None:
        """Make the step that comes ``after_steps`` working steps from now raise."""
        if not self.enabled:
            raise FaultInjectionDisabledError(
                f"fault injection is off; set engine.fault_injection: true or {ENV_VAR}=1 (tests only)")
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(KINDS)}")
        with self._lock:
            self._armed, self._after_steps = kind, max(0, after_steps)
            self._release.clear()

    def release(self) -> None:
        """End an injected hang now (shutdown)."""
        self._release.set()

    def before_step(self) -> None:
        """Called by the step thread before each step with work; raises when a fault is due."""
        if self._armed is None:
            return
        with self._lock:
            if self._armed is None:
                return
            if self._after_steps > 0:
                self._after_steps -= 1
                return
            kind, self._armed = self._armed, None
        if kind == "step_hang":
            self._release.wait(MAX_HANG_S)
            return
        raise InjectedStepFault(f"injected fault: {kind}")
