"""The synchronous engine core: add requests, run one step at a time, abort, report stats.

``step()`` is schedule → run model → update requests. It has no Ray imports and no threads; the
caller decides who drives it (a driver in :mod:`stages.engine.driver` runs its step loop on a thread
of this process or in a child process; tests drive it directly).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from stages.config import EngineSettings
from stages.engine.core.block_manager import BlockManager
from stages.engine.core.errors import (
    DuplicateRequestIdError,
    PromptTooLongError,
    RequestRejectedError,
    SamplingError,
)
from stages.engine.core.request import EventType, Request, RequestStatus
from stages.engine.core.scheduler import Scheduler
from stages.transport.messages import EngineOutput, GrammarSpec, SamplingParams, TokenLogprob

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """A snapshot of the engine's gauges and counters."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    finished_total: dict[str, int]
    num_steps: int
    #: Structured outputs: steps that filled masks, rows masked, seconds spent filling.
    grammar_mask_steps: int = 0
    grammar_mask_rows: int = 0
    grammar_mask_seconds: float = 0.0
    grammar_templates_built: int = 0
    num_running_constrained: int = 0
    #: Requests ended by a :class:`SamplingError` (their batch went on).
    sampling_failures: int = 0
    #: ``[(le, cumulative count)]`` of per-step mask-fill seconds (empty without structured outputs).
    grammar_mask_buckets: list[tuple[str, int]] = field(default_factory=list)
    #: Steps run at each intra-op thread count (str keys: it becomes a metric label).
    steps_by_threads: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LLMEngine:
    """Owns the scheduler, the block manager and the model runner."""

    def __init__(self, config: EngineSettings, runner: Any, eos_token_ids: list[int], vocab_size: int,
                 model_max_len: int, grammars: Any = None) -> None:
        """``config`` is the app's ``engine`` section as validated. ``grammars`` (a
        :class:`~stages.engine.core.structured.GrammarBackend`) enables structured outputs; without
        it a request with a grammar is rejected."""
        self.config = config
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        num_blocks = runner.num_blocks
        # A request must always fit in the pool on its own, or it could never finish.
        capacity = num_blocks * config.block_size
        max_len = config.max_model_len or model_max_len
        self.max_model_len = min(max_len, model_max_len, capacity)
        if self.max_model_len < max_len:
            logger.warning("max_model_len capped to %d tokens by the KV pool", self.max_model_len)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.requests: dict[str, Request] = {}
        self._pending: list[EngineOutput] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.num_steps = 0
        #: Engine-side TTFT (arrival → first token, seconds) of recent requests, newest last; the
        #: autoscaling signal drains it (appends and pops are thread-safe on a deque).
        self.recent_ttfts: deque[float] = deque(maxlen=4096)
        #: Called with every request as it leaves the engine (finished or aborted), on the
        #: thread that drives ``step()``; used for tracing. Must be cheap.
        self.on_finish: Callable[[Request], None] | None = None
        self.grammars = grammars
        #: Requests ended because a sampled token broke their grammar (a bug if ever non-zero).
        self.grammar_violations = 0
        #: ``(request_id, error)`` of requests that failed in a step, until the driver takes them.
        self._failures: list[tuple[str, SamplingError]] = []
        self.sampling_failures = 0

    @classmethod
    def from_config(cls, model: str, config: EngineSettings | None = None) -> LLMEngine:
        """Load ``model`` (a local directory, a hub id or ``embedded:...``) and build an engine
        around it with ``config`` (the ``engine`` section; its defaults when omitted). The runner
        resolves ``device: auto`` here, in the process that holds the model."""
        from stages.engine.core.structured import GrammarBackend
        from stages.engine.runner.loader import load_state_dict
        from stages.engine.runner.model_runner import ModelRunner
        from stages.model_info import load_config, model_info

        config = config if config is not None else EngineSettings()
        info = model_info(model)
        runner = ModelRunner(config, load_config(model), load_state_dict(model), model=model)
        grammars = GrammarBackend.for_model(model, info.vocab_size, info.eos_token_ids)
        return cls(config, runner, info.eos_token_ids, info.vocab_size, info.max_model_len, grammars)

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, grammar: GrammarSpec | None = None,
                    grammar_template: Any = None, output_token_ids: list[int] | None = None) -> Request:
        """Validate and enqueue a tokenised request.

        ``output_token_ids``: tokens the request already generated elsewhere (it moved off a lost
        replica). They are computed with the prompt and then count as this request's own output,
        as after a preemption by recompute.

        ``grammar`` constrains the output; its matcher template must already be built
        (``grammars.prepare``, off this thread), or be passed as ``grammar_template``: this method
        runs on the step thread and never compiles.

        Raises :class:`DuplicateRequestIdError` for a live id, :class:`PromptTooLongError` when the
        prompt leaves no room to generate, :class:`RequestRejectedError` for anything else that can
        never run (a grammar that is not built here among them)."""
        if request_id in self.requests:
            raise DuplicateRequestIdError(f"request id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejectedError("the prompt is empty")
        if n >= self.max_model_len:
            raise PromptTooLongError(n, self.max_model_len)
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise RequestRejectedError(f"token ids must be in [0, {self.vocab_size})")
        if params.max_tokens < 1:
            raise RequestRejectedError("max_tokens must be >= 1")
        done = list(output_token_ids or ())
        if done:
            if len(done) >= params.max_tokens or n + len(done) >= self.max_model_len:
                raise RequestRejectedError("the request has no tokens left to generate")
            if min(done) < 0 or max(done) >= self.vocab_size:
                raise RequestRejectedError(f"token ids must be in [0, {self.vocab_size})")
        state = None
        if grammar is not None:
            if self.grammars is None:
                raise RequestRejectedError("structured outputs are not available on this engine")
            state = self.grammars.new_state(grammar, grammar_template)
            if done:
                state.sync(done)  # the grammar's state after what was generated
                if state.error is not None:
                    raise RequestRejectedError(f"the tokens carried over do not match the grammar: {state.error}")
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids,
                      **({"arrival_time": arrival_time} if arrival_time is not None else {}))
        if done:
            req.output_token_ids = done
            req.all_token_ids.extend(done)
            req.num_carried = len(done)
        req.grammar = state
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Finish a request as aborted from whatever state it is in; no-op for unknown or finished
        ids. Its blocks are free on return; its final output comes with the next ``step()``."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self._pending.append(self._final_output(req, []))
        self._retire(req)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # -- the step -----------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Schedule, run the model once, sample, and update every scheduled request.

        Returns one :class:`EngineOutput` per request that produced a token or finished this step
        (the same message the deployment streams, before coalescing)."""
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        self.num_steps += 1
        sampled = (self.runner.execute(sched.scheduled, self.grammars) if self.grammars is not None
                   else self.runner.execute(sched.scheduled))
        now = time.monotonic()
        for s in sched.scheduled:
            req = s.request
            # A chunk of prompt (or of recomputation after preemption), not a decode.
            prefill = req.num_output_tokens == 0 or req.num_computed_tokens < req.num_tokens - 1
            req.num_computed_tokens += s.num_new_tokens
            if prefill:
                req.record(EventType.PREFILL_CHUNK, now, tokens=s.num_new_tokens)
            self.block_manager.cache_full_blocks(req)
            if req.request_id not in sampled:
                continue
            result = sampled[req.request_id]
            if isinstance(result, SamplingError):
                # This request alone: it leaves (blocks freed now) with no final output; the driver
                # fails its stream with the error (take_failures).
                self.sampling_failures += 1
                logger.error("request %s ended: %s", req.request_id, result.message)
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                self._retire(req)
                self._failures.append((req.request_id, result))
                continue
            token_id, logprob = result
            first = req.num_output_tokens == req.num_carried
            req.append_output(token_id, logprob)
            req.record(EventType.FIRST_TOKEN if first else EventType.DECODE_STEP, now)
            self.generation_tokens_total += 1
            if first:
                self.prompt_tokens_total += req.num_prompt_tokens
                self.recent_ttfts.append(now - req.arrival_time)
            if req.grammar is not None and not req.grammar.accept(token_id):
                # Cannot happen while the mask is applied; end the request rather than emit output
                # that breaks the grammar the client asked for.
                self.grammar_violations += 1
                logger.error("request %s: token %d broke its grammar: %s", req.request_id, token_id,
                             req.grammar.error)
                status: RequestStatus | None = RequestStatus.FINISHED_ABORTED
                emitted, lps = [], None  # the offending token is not sent
            else:
                status = req.check_stop(self.max_model_len)
                emitted, lps = [token_id], ([logprob] if logprob is not None else None)
            if status is not None:
                self.scheduler.finish(req, status)
                outputs.append(self._final_output(req, emitted, lps))
                self._retire(req)
            else:
                outputs.append(EngineOutput(req.request_id, emitted, lps,
                                          num_prompt_tokens=req.num_prompt_tokens,
                                          num_cached_tokens=max(req.num_cached_tokens, 0),
                                          timings=req.timings() if first else {}))
        return outputs

    def take_failures(self) -> list[tuple[str, SamplingError]]:
        """The requests that failed since the last call, each with its error (they are already gone
        from the engine, their blocks free); the driver fails their streams with these."""
        failures, self._failures = self._failures, []
        return failures

    def _final_output(self, req: Request, tokens: list[int],
                      logprobs: list[TokenLogprob] | None = None) -> EngineOutput:
        return EngineOutput(req.request_id, tokens, logprobs, req.finish_reason, req.stop_token_id,
                          req.num_prompt_tokens, max(req.num_cached_tokens, 0), req.timings())

    def _retire(self, req: Request) -> None:
        self.finished_total[req.finish_reason or "abort"] += 1
        del self.requests[req.request_id]
        if self.on_finish is not None:
            try:
                self.on_finish(req)
            except Exception:  # observability must never take the engine down
                logger.exception("on_finish hook failed for %s", req.request_id)

    # -- introspection --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.stats.queries,
            prefix_cache_hits=bm.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            finished_total=dict(self.finished_total),
            num_steps=self.num_steps,
            sampling_failures=self.sampling_failures,
            steps_by_threads={str(k): v for k, v in getattr(self.runner, "steps_by_threads", {}).items()},
            **self._grammar_stats(),
        )

    def _grammar_stats(self) -> dict[str, Any]:
        g = self.grammars
        if g is None:
            return {}
        m = g.mask_stats
        return {"grammar_mask_steps": m.steps, "grammar_mask_rows": m.rows, "grammar_mask_seconds": m.seconds,
                "grammar_templates_built": g.templates_built, "grammar_mask_buckets": m.buckets(),
                "num_running_constrained": sum(1 for r in self.scheduler.running if r.grammar is not None)}
