"""Every message between an :class:`~stages.engine.driver.async_engine.AsyncEngine` and its step loop.

The loop runs on a thread of the replica or alone in a child process
(:mod:`stages.engine.driver.in_process`, :mod:`stages.engine.driver.core_process`); the same
messages travel either way, so the two drivers differ only in how a message is carried. Each is a
dataclass whose ``kind`` (a :class:`Kind`, not pickled) says what it is: receivers dispatch on it,
never on a string.

- to the loop: :class:`AddRequest`, :class:`Abort`, :class:`ArmFault`, :class:`Stop` (and
  :class:`GrammarBuilt`, which the loop posts to itself);
- from the loop: :class:`Outputs`, :class:`Fail`, :class:`Dead`, the loop's events, plus its
  :class:`LoopStatus`;
- the child process's framing: :class:`LoopSpec` first (parent to child), then :class:`Ready` or
  :class:`StartFailed`, then one :class:`StepBatch` per step.

The wire stays cheap: a step's events and its status cross the process boundary as one pickled
:class:`StepBatch`, and a step's outputs are one :class:`Outputs` holding every request's output.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

from stages.config import EngineSettings, TracingSettings
from stages.engine.core.engine import EngineStats
from stages.transport.messages import EngineOutput, EngineRequest, PrefixSummary


class Kind(enum.Enum):
    """What a message is."""

    ADD = enum.auto()
    ABORT = enum.auto()
    ARM_FAULT = enum.auto()
    STOP = enum.auto()
    GRAMMAR_BUILT = enum.auto()
    OUTPUTS = enum.auto()
    FAIL = enum.auto()
    DEAD = enum.auto()
    STATUS = enum.auto()
    SPEC = enum.auto()
    READY = enum.auto()
    START_FAILED = enum.auto()
    STEP_BATCH = enum.auto()


# -- to the loop ------------------------------------------------------------------------------------
@dataclass
class AddRequest:
    """One choice of an API request, for the loop to add to the engine."""

    kind: ClassVar[Kind] = Kind.ADD
    request_id: str
    index: int
    request: EngineRequest
    params: Any
    #: The group's first choice carries the group's size (checked against the waiting-queue bound,
    #: and its acceptance is the stream's first item); its siblings 0.
    admit: int
    arrival: float
    #: The structured-output matcher template, once the loop has had it built off its thread.
    grammar_template: Any = None


@dataclass
class Abort:
    """Abort ``request_id``; ``asked`` (monotonic) is when its consumer left, for the abort latency."""

    kind: ClassVar[Kind] = Kind.ABORT
    request_id: str
    asked: float


@dataclass
class ArmFault:
    """Tests only: arm the loop's :class:`~stages.engine.driver.faults.StepFaults`."""

    kind: ClassVar[Kind] = Kind.ARM_FAULT
    fault: str
    after_steps: int


@dataclass
class Stop:
    """Stop the loop after its step in progress (pending requests are aborted)."""

    kind: ClassVar[Kind] = Kind.STOP


@dataclass
class GrammarBuilt:
    """Posted by the loop's grammar builder to the loop itself: ``add`` with its template, or why
    the template could not be built. Never crosses a process."""

    kind: ClassVar[Kind] = Kind.GRAMMAR_BUILT
    add: AddRequest
    error: BaseException | None = None


ToLoop = AddRequest | Abort | ArmFault | Stop | GrammarBuilt


# -- from the loop ----------------------------------------------------------------------------------
@dataclass
class Outputs:
    """What one step produced, every request's output in one message; also a new request's
    acceptance (an empty output naming the replica)."""

    kind: ClassVar[Kind] = Kind.OUTPUTS
    outputs: list[EngineOutput]


@dataclass
class Fail:
    """``request_id`` was refused at admission or failed in a step; the engine goes on."""

    kind: ClassVar[Kind] = Kind.FAIL
    request_id: str
    error: BaseException


@dataclass
class Dead:
    """The loop crashed: every stream ends with ``error``. Sent once, last."""

    kind: ClassVar[Kind] = Kind.DEAD
    error: BaseException


LoopEvent = Outputs | Fail | Dead


@dataclass
class LoopStatus:
    """The engine's gauges plus the loop's counters, as of the loop's latest step."""

    kind: ClassVar[Kind] = Kind.STATUS
    stats: EngineStats
    rejected_overloaded: int = 0
    abort_latency_counts: list[int] = field(default_factory=list)
    abort_latency_sum: float = 0.0
    #: Engine-side TTFTs (seconds) since the last status sent to a parent (the autoscaling signal).
    new_ttfts: list[float] = field(default_factory=list)
    #: Counters kept where the loop runs (``traced_requests``).
    counters: dict[str, Any] = field(default_factory=dict)
    #: What the prefix cache holds, for the routers; a child sends it only when it changed (the
    #: parent keeps the last one), so ``None`` from a child means "as before".
    prefix: PrefixSummary | None = None


# -- the child process's framing --------------------------------------------------------------------
@dataclass
class LoopSpec:
    """Everything needed to build an engine and run its step loop (the child's first message): the
    model and the engine's config section; the loop's own settings are read from that section."""

    kind: ClassVar[Kind] = Kind.SPEC
    model: str
    config: EngineSettings = field(default_factory=EngineSettings)
    replica: str = ""
    tracing: TracingSettings | None = None

    @property
    def max_waiting(self) -> int:
        return self.config.max_waiting_requests

    @property
    def thread_nice(self) -> int | None:
        return self.config.step_thread_nice

    @property
    def fault_injection(self) -> bool:
        return self.config.fault_injection


@dataclass
class Ready:
    """The child's engine is loaded; what the parent needs to know about it."""

    kind: ClassVar[Kind] = Kind.READY
    pid: int
    max_model_len: int
    num_blocks: int
    status: LoopStatus


@dataclass
class StartFailed:
    """The child could not build its engine (the text of what was raised)."""

    kind: ClassVar[Kind] = Kind.START_FAILED
    reason: str


@dataclass
class StepBatch:
    """One write from the child: the events of a step (or an inbox drain), then its status when
    the step published one."""

    kind: ClassVar[Kind] = Kind.STEP_BATCH
    events: list[LoopEvent]
    status: LoopStatus | None = None
