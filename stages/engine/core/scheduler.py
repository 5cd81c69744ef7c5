"""Continuous-batching scheduler: FIFO waiting queue, running set, token budget, chunked prefill.

Pure Python (no torch). Each step it decides how many new tokens every request computes, so one
step can mix decodes (1 token) with chunks of prefill. Its only view of memory is the block manager.

Policy, in order:
1. Running requests first, in admission order: decodes and the next chunk of a partial prefill,
   within ``max_num_batched_tokens``. When a request cannot get a block for its tokens, the newest
   running request is preempted by recompute (blocks freed, back to the front of the waiting queue)
   until it can, or it preempts itself.
2. Then waiting requests in FIFO order while budget, ``max_num_seqs`` and blocks allow. A request
   is admitted only when blocks for its next chunk exist; prefix-cache hits are shared first. No
   admission happens in a step that preempted (the pool is evidently short).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from stages.config import EngineSettings
from stages.engine.core.block_manager import BlockManager
from stages.engine.core.request import EventType, Request, RequestStatus


@dataclass
class ScheduledRequest:
    """A request and how many of its pending tokens it computes this step."""

    request: Request
    num_new_tokens: int

    @property
    def start(self) -> int:
        """Position of the first token computed this step."""
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What one engine step computes."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, step by step, which requests compute which tokens."""

    def __init__(self, config: EngineSettings, block_manager: BlockManager) -> None:
        """``config``: the ``engine`` section; the step's limits are its ``max_num_batched_tokens``,
        ``max_num_seqs`` and ``long_prefill_token_threshold``."""
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management -----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Enqueue a new request at the back of the waiting queue."""
        request.status = RequestStatus.WAITING
        request.record(EventType.QUEUED)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Move a request to a terminal state, wherever it is, and free its blocks."""
        assert status.is_finished
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.is_finished:
            self.waiting.remove(request)
        else:
            return  # already finished: nothing to free twice
        request.status = status
        self.block_manager.free(request)
        request.record(EventType.FINISHED, reason=status.name)

    # -- scheduling -----------------------------------------------------------------------------
    def _chunk(self, request: Request, budget: int) -> int:
        num = min(request.num_tokens - request.num_computed_tokens, budget)
        limit = self.config.long_prefill_token_threshold
        if limit > 0 and num > 1:
            num = min(num, limit)
        return num

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.record(EventType.PREEMPTED)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Blocks for every scheduled token are allocated on return."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        # 1. Running requests: decodes and continuing prefills.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request, budget)
            while not bm.allocate_slots(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                i += 1
                continue
            # ``request`` preempted itself: the list shrank, so ``i`` already points past it.

        # 2. Waiting requests, FIFO, unless this step already had to preempt.
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            cached = bm.find_cached_prefix(request)
            request.num_computed_tokens = len(cached) * bm.block_size
            num_new = self._chunk(request, budget)
            if not bm.allocate_slots(request, num_new, cached):
                request.num_computed_tokens = 0
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            bm.record_lookup(request.num_tokens, request.num_computed_tokens)
            resumed = request.status is RequestStatus.PREEMPTED
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            request.record(EventType.RESUMED if resumed else EventType.SCHEDULED,
                           cached_tokens=request.num_computed_tokens)
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out
