"""Egress stage: incremental detokenisation, stop strings, OpenAI chunks and SSE frames.

Egress calls the engine (so a request's stream runs Engine → Egress → Ingress) and turns engine
items into response text. One engine item may carry several tokens; it becomes one SSE event, so
coalescing in the engine carries through to the client.

Abort paths that start here: a stop string found in the text (the engine cannot see text), and the
caller going away (cancellation arrives as ``CancelledError``). Both close the engine stream, which
aborts the request in the engine replica that owns it.

:class:`Egress` is plain asyncio (tested and benchmarked without Ray); :class:`EgressDeployment` is
the Ray Serve wrapper.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from stages.detokenizer import IncrementalDetokenizer
from stages.openai_format import LogprobFormatter, full_response, sse_event, stream_chunk, usage
from stages.protocol import EngineOutput, EngineRequest, GenerationJob
from stages.telemetry import get_tracer, span_from_context

#: Opens the engine stream for one request; the second callable closes it early (abort).
EngineOpen = Callable[[EngineRequest], tuple[AsyncIterator[EngineOutput], Callable[[], Awaitable[None]]]]


@dataclass
class _Choice:
    index: int
    request: EngineRequest
    detok: IncrementalDetokenizer
    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    num_tokens: int = 0
    text_len: int = 0
    finish_reason: str | None = None
    stopped_by_string: bool = False
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    engine_timings: dict[str, float] = field(default_factory=dict)
    first: bool = True


@dataclass
class Summary:
    """What Ingress needs after the last content frame: usage, finish reasons and timings."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reasons: list[str]
    #: Engine-measured durations (seconds) of the first choice: queue, prefill, decode, ...
    engine_timings: dict[str, float]
    #: Seconds Egress spent detokenising and framing.
    egress_busy: float
    aborted_by_stop_string: bool = False


class Egress:
    """Runs one generation job against the engine and renders OpenAI output."""

    def __init__(self, tokenizer: Any, engine_open: EngineOpen) -> None:
        self.tokenizer = tokenizer
        self.engine_open = engine_open
        self.logprob_fmt = LogprobFormatter(tokenizer)

    # -- per item -----------------------------------------------------------------------------------
    def _new_choice(self, job: GenerationJob, index: int) -> _Choice:
        req = job.engine_request
        if job.n > 1:
            params = req.sampling_params
            # Distinct choices from one seed: each choice gets seed + index.
            seed = None if params.seed is None else params.seed + index
            req = dataclasses.replace(req, request_id=f"{req.request_id}-{index}", choice_index=index,
                                      sampling_params=dataclasses.replace(params, seed=seed))
        p = req.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
                                       stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output)
        choice = _Choice(index, req, detok)
        if job.echo and req.prompt_text:
            choice.text.append(req.prompt_text)
        return choice

    def _consume(self, job: GenerationJob, c: _Choice, out: EngineOutput) -> dict[str, Any] | None:
        """Fold one engine item into the choice; return the stream chunk to send, if any."""
        c.num_tokens += len(out.new_token_ids)
        c.num_prompt_tokens, c.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
        c.engine_timings.update(out.timings)
        update = c.detok.add(out.new_token_ids)
        text = update.text
        finish = out.finish_reason
        if update.stopped:
            finish, c.stopped_by_string = "stop", True
        if finish is not None and not update.stopped:
            text += c.detok.finish()
        c.finish_reason = finish
        lp_body = None
        if out.logprobs and job.engine_request.sampling_params.logprobs is not None:
            if job.stream:
                lp_body = (self.logprob_fmt.chat(out.logprobs) if job.kind == "chat"
                           else self.logprob_fmt.completion(out.logprobs, c.text_len))
            else:
                c.logprobs.extend(out.logprobs)
        c.text_len += len(text)
        if not job.stream:
            c.text.append(text)
            return None
        if not text and finish is None and lp_body is None and not c.first:
            return None
        chunk = stream_chunk(job.kind, job.response_id, job.created, job.model_name, c.index, text,
                             first=c.first, finish_reason=finish, logprobs=lp_body)
        c.first = False
        return chunk

    def _summary(self, choices: list[_Choice], busy: float) -> Summary:
        return Summary(
            prompt_tokens=choices[0].num_prompt_tokens,
            completion_tokens=sum(c.num_tokens for c in choices),
            cached_tokens=choices[0].num_cached_tokens,
            finish_reasons=[c.finish_reason or "abort" for c in choices],
            engine_timings=choices[0].engine_timings,
            egress_busy=busy,
            aborted_by_stop_string=any(c.stopped_by_string for c in choices),
        )

    # -- driving the engine streams ------------------------------------------------------------------
    async def _items(self, job: GenerationJob, choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, EngineOutput]]:
        """Engine items of all choices, interleaved. Choice 0 runs first; the others start once
        its prompt is computed, so they share the prompt's KV blocks through the prefix cache."""
        if len(choices) == 1:
            c = choices[0]
            stream, close = self.engine_open(c.request)
            try:
                async for out in stream:
                    yield c, out
                    if c.finish_reason is not None:
                        return
            finally:
                await close()  # aborts in the engine unless it already finished the request
            return
        queue: asyncio.Queue[tuple[_Choice, EngineOutput | BaseException | None]] = asyncio.Queue()
        first_seen = asyncio.Event()

        async def pump(c: _Choice) -> None:
            if c.index > 0:
                await first_seen.wait()
            stream, close = self.engine_open(c.request)
            try:
                async for out in stream:
                    if out.new_token_ids or out.finish_reason is not None:
                        first_seen.set()  # the prompt is computed (and cached): siblings may go
                    await queue.put((c, out))
                    if out.finish_reason is not None:
                        break
            except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
                first_seen.set()
                await queue.put((c, exc))
                raise
            finally:
                await close()
            await queue.put((c, None))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        done: set[int] = set()
        try:
            while len(done) < len(choices):
                c, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None or c.index in done:
                    done.add(c.index)
                    continue
                yield c, item
                if c.finish_reason is not None:
                    done.add(c.index)
                    if c.stopped_by_string:
                        tasks[c.index].cancel()  # close its engine stream: abort that choice now
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def stream(self, job: GenerationJob) -> AsyncIterator[tuple[str, int] | Summary]:
        """``(SSE frame, tokens in it)`` per engine item, then a :class:`Summary`. The first frame
        (the role chunk) comes as soon as the engine has accepted the request."""
        choices = [self._new_choice(job, i) for i in range(job.n)]
        busy, event_id = 0.0, 0
        items = self._items(job, choices)
        try:
            async for c, out in items:
                t0 = time.perf_counter()
                chunk = self._consume(job, c, out)
                frame = None
                if chunk is not None:
                    frame = sse_event(chunk, event_id)
                    event_id += 1
                busy += time.perf_counter() - t0
                if frame is not None:
                    yield frame, len(out.new_token_ids)
        finally:
            await items.aclose()
        yield self._summary(choices, busy)

    async def complete(self, job: GenerationJob) -> tuple[dict[str, Any], Summary]:
        """The whole non-streamed response body and its :class:`Summary`."""
        choices = [self._new_choice(job, i) for i in range(job.n)]
        busy = 0.0
        items = self._items(job, choices)
        try:
            async for c, out in items:
                t0 = time.perf_counter()
                self._consume(job, c, out)
                busy += time.perf_counter() - t0
        finally:
            await items.aclose()
        t0 = time.perf_counter()
        rendered = []
        for c in choices:
            lp = None
            if job.engine_request.sampling_params.logprobs is not None:
                prefix = len(c.text[0]) if job.echo and c.text else 0
                lp = (self.logprob_fmt.chat(c.logprobs) if job.kind == "chat"
                      else self.logprob_fmt.completion(c.logprobs, prefix))
            rendered.append({"index": c.index, "text": "".join(c.text), "finish_reason": c.finish_reason or "abort",
                             "logprobs": lp})
        summary = self._summary(choices, busy)
        body = full_response(job.kind, job.response_id, job.created, job.model_name, rendered,
                             usage(summary.prompt_tokens, summary.completion_tokens, summary.cached_tokens))
        summary.egress_busy += time.perf_counter() - t0
        return body, summary


@serve.deployment(name="Egress", max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.25})
class EgressDeployment:
    """CPU stage between the engine and Ingress; scale it with ``num_replicas``."""

    def __init__(self, engine: Any, model: str, tracing: dict[str, Any] | None = None) -> None:
        from stages.model_info import load_tokenizer
        from stages.telemetry import configure_tracing

        configure_tracing(tracing, component="egress")
        self.engine = engine  # DeploymentHandle of the engine, created once and reused
        self.egress = Egress(load_tokenizer(model), self._open)

    def _open(self, req: EngineRequest) -> tuple[AsyncIterator[EngineOutput], Callable[[], Awaitable[None]]]:
        gen = self.engine.options(stream=True).generate.remote(req)

        async def close() -> None:
            gen.cancel()  # cancellation reaches the engine replica's generator → abort by request id

        return gen, close

    async def stream(self, job: GenerationJob) -> AsyncIterator[tuple[str, int] | Summary]:
        with span_from_context(get_tracer(), "egress.stream", job.engine_request.trace_context,
                               {"lifecycle.request_id": job.engine_request.request_id}) as span:
            async for item in self.egress.stream(job):
                if isinstance(item, Summary):
                    _annotate(span, item)
                yield item

    async def complete(self, job: GenerationJob) -> tuple[dict[str, Any], Summary]:
        with span_from_context(get_tracer(), "egress.complete", job.engine_request.trace_context,
                               {"lifecycle.request_id": job.engine_request.request_id}) as span:
            body, summary = await self.egress.complete(job)
            _annotate(span, summary)
            return body, summary


def _annotate(span: Any, summary: Summary) -> None:
    if not span.is_recording():
        return
    span.set_attribute("lifecycle.egress_busy_ms", summary.egress_busy * 1000)
    span.set_attribute("gen_ai.usage.output_tokens", summary.completion_tokens)
    if summary.aborted_by_stop_string:
        span.add_event("abort", {"reason": "stop_string"})
