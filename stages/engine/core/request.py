"""A request's state inside the engine: tokens, block table, status and timestamped events."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from stages.transport.messages import SamplingParams, TokenLogprob


class RequestStatus(enum.IntEnum):
    """Ordered lifecycle states; everything after ``RUNNING`` means finished.

    ``PREEMPTED`` sits before ``RUNNING`` because a preempted request waits again.
    """

    WAITING = 0
    PREEMPTED = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        """True for every terminal state."""
        return self > RequestStatus.RUNNING


#: The one table mapping terminal states to OpenAI finish reasons.
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class EventType(enum.Enum):
    """Events stamped on a request, in the order a request normally meets them."""

    ARRIVED = "arrived"
    QUEUED = "queued"
    SCHEDULED = "scheduled"  # first time only; later admissions are RESUMED
    PREFILL_CHUNK = "prefill_chunk"
    FIRST_TOKEN = "first_token"
    DECODE_STEP = "decode_step"
    PREEMPTED = "preempted"
    RESUMED = "resumed"
    FINISHED = "finished"


@dataclass
class RequestEvent:
    """One state change, stamped with ``time.monotonic()`` in the engine process."""

    type: EventType
    timestamp: float
    #: Small event payload, e.g. ``{"tokens": 64}`` for a prefill chunk.
    data: dict[str, Any] | None = None


@dataclass(eq=False)
class Request:
    """A sequence being served: prompt, generated tokens, KV block table and history.

    ``num_computed_tokens`` counts the tokens whose K/V are in the cache. ``all_token_ids`` is
    prompt plus output; the next tokens to compute are ``all_token_ids[num_computed_tokens:]``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    #: Chained hashes of the full blocks of ``all_token_ids`` (filled by the block manager).
    block_hashes: list[int] = field(default_factory=list)
    #: Per leading full block already offered to the prefix cache: the block a lookup of this
    #: prefix finds there (the request's own, or the copy another request registered first).
    chain_blocks: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    #: Prompt tokens found in the prefix cache at first admission.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    #: Output tokens it came with, generated on a replica that was lost (its first token here is
    #: the one after them).
    num_carried: int = 0
    stop_token_id: int | None = None
    #: ``torch.Generator`` for seeded sampling; created lazily by the sampler (opaque here).
    generator: Any = None
    events: list[RequestEvent] = field(default_factory=list)
    #: Opaque per-request span handle owned by the engine's tracing hook.
    trace: Any = None
    #: Why the router sent the request here (a ``RouteNote``; opaque here, put on the span).
    route: Any = None
    #: Structured output: the request's :class:`~stages.engine.core.structured.GrammarState` (opaque here).
    grammar: Any = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.record(EventType.ARRIVED, self.arrival_time)

    # -- bookkeeping --------------------------------------------------------------------------
    def record(self, type_: EventType, timestamp: float | None = None, **data: Any) -> None:
        """Stamp an event with a monotonic timestamp."""
        self.events.append(RequestEvent(type_, time.monotonic() if timestamp is None else timestamp,
                                        data or None))

    def first_event(self, type_: EventType) -> float | None:
        """Timestamp of the first event of ``type_``, if it happened."""
        for ev in self.events:
            if ev.type is type_:
                return ev.timestamp
        return None

    def last_event(self, type_: EventType) -> float | None:
        """Timestamp of the last event of ``type_``, if it happened."""
        for ev in reversed(self.events):
            if ev.type is type_:
                return ev.timestamp
        return None

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefilling(self) -> bool:
        """True while prompt (or recomputed) tokens remain before the next sample."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output(self, token_id: int, logprob: TokenLogprob | None) -> None:
        """Add a sampled token."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Decide whether the last sampled token ends the request; returns the new status."""
        last = self.output_token_ids[-1]
        params = self.params
        if not params.ignore_eos and last in self.eos_token_ids:
            self.stop_token_id = last
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            self.stop_token_id = last
            return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.is_finished:
            return RequestStatus.FINISHED_STOPPED  # the output is complete: nothing more is allowed
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def timings(self) -> dict[str, float]:
        """Engine-side durations (seconds) derived from this request's own events.

        ``queue`` runs from arrival to first scheduling, ``prefill`` from first scheduling to the
        first token, ``decode`` from the first token to finish (or now).
        """
        arrived = self.arrival_time
        scheduled = self.first_event(EventType.SCHEDULED)
        first = self.first_event(EventType.FIRST_TOKEN)
        finished = self.last_event(EventType.FINISHED)
        out: dict[str, float] = {}
        if scheduled is not None:
            out["queue"] = scheduled - arrived
            if first is not None:
                out["prefill"] = first - scheduled
        if first is not None and finished is not None:
            out["decode"] = finished - first
        if finished is not None:
            out["engine_total"] = finished - arrived
            if scheduled is None:
                out["queue"] = finished - arrived
        out["num_preemptions"] = float(self.num_preemptions)
        out["decode_steps"] = float(sum(1 for e in self.events if e.type is EventType.DECODE_STEP))
        out["prefill_chunks"] = float(sum(1 for e in self.events if e.type is EventType.PREFILL_CHUNK))
        return out
