"""Egress stage: incremental detokenisation, stop strings, OpenAI chunks and SSE frames.

Egress calls the engine (so a request's stream runs Engine → Egress → Ingress) and turns engine
items into response text. One engine item carries every choice that produced tokens in the steps
since the last one; each choice's part becomes one SSE event, so coalescing in the engine carries
through to the client.

What Ingress receives is typed (:mod:`stages.protocol`): a :class:`StreamStart` once the engine has
accepted the request (with the engine replica that runs it, for cancel by id), one
:class:`StreamFrame` per SSE event, and a :class:`StreamSummary` (holding the whole body when the
client did not stream). Both hops use the shared channels of :mod:`stages.channel` by default: the
engine's tokens arrive in one item per step for all of this replica's requests, and the frames go
to each Ingress replica in one item for all of its requests. Requests come and go in batches
(:mod:`stages.admission`): Ingress's streamed jobs arrive in ``submit`` calls, each job then runs
as a task of its own (``cancel`` ends one by id), and the engine requests of one loop turn leave
in one ``submit`` call to the engine, whose reply carries their acceptances.

Abort paths that start here: a stop string found in one choice's text (the engine cannot see
text) aborts that choice alone, by id, on the engine replica that runs it; the caller going away
(cancellation arrives as ``CancelledError``, or as a ``cancel`` by id for a batch-admitted job)
closes the engine stream, which aborts every choice.

A full engine queue (429) is retried on another engine replica before the client sees it: the
refusing replica goes into ``avoid_replicas`` and the router tries the others first.

:class:`Egress` is plain asyncio (tested and benchmarked without Ray); :class:`EgressDeployment` is
the Ray Serve wrapper.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from stages.admission import AdmissionQueue, AdmittedStreams, fire_and_forget
from stages.channel import ChannelClient, ChannelHub, engine_items
from stages.detokenizer import IncrementalDetokenizer
from stages.engine.errors import EngineOverloadedError
from stages.errors import EngineUnavailableError, unwrap_error
from stages.liveness import ConsumerWatch, own_actor_name, own_replica_id
from stages.openai_format import LogprobFormatter, full_response, sse_event, stream_chunk, usage
from stages.protocol import (
    AbortRequest,
    Admission,
    AdmissionBatch,
    ChannelAttach,
    ChannelBatch,
    EngineOutput,
    EngineRequest,
    GenerationJob,
    RoutedFrame,
    StreamFrame,
    StreamStart,
    StreamSummary,
)
from stages.telemetry import get_tracer, span_from_context
from stages.tool_calls import ToolCallStreamParser, parse_tool_calls

logger = logging.getLogger("lifecycle.egress")


class EngineStream:
    """One open engine stream: its items, and how to close it early (which aborts in the engine)."""

    def __init__(self, items: AsyncIterator[list[EngineOutput]], close: Callable[[], Awaitable[None]]) -> None:
        self.items = items
        self.close = close


#: Opens the engine stream of one request.
EngineOpen = Callable[[Any], EngineStream]
#: Sends an :class:`AbortRequest` to the engine replica it names.
EngineAbort = Callable[[AbortRequest], Awaitable[None]]


@dataclass
class _Choice:
    index: int
    engine_id: str
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
    #: Streaming with tools: splits the text into content and ``<tool_call>`` blocks.
    tool_parser: ToolCallStreamParser | None = None


class Egress:
    """Runs one generation job against the engine and renders OpenAI output."""

    def __init__(self, tokenizer: Any, engine_open: EngineOpen, engine_abort: EngineAbort | None = None,
                 max_engine_attempts: int = 4) -> None:
        self.tokenizer = tokenizer
        self.engine_open = engine_open
        self.engine_abort = engine_abort
        self.max_engine_attempts = max_engine_attempts
        self.logprob_fmt = LogprobFormatter(tokenizer)

    # -- per item -----------------------------------------------------------------------------------
    def _new_choice(self, job: GenerationJob, index: int) -> _Choice:
        req = job.engine_request
        p = req.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
                                       stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output)
        choice = _Choice(index, req.choice_ids()[index], detok)
        if job.tool_parsing is not None and job.stream:
            choice.tool_parser = ToolCallStreamParser()
        if job.echo and req.prompt_text:
            choice.text.append(req.prompt_text)
        return choice

    def _consume(self, job: GenerationJob, c: _Choice, out: EngineOutput) -> dict[str, Any] | None:
        """Fold one engine output into its choice; return the stream chunk to send, if any."""
        c.num_tokens += len(out.new_token_ids)
        if out.num_prompt_tokens:
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
        calls = None
        if c.tool_parser is not None:
            text, calls = c.tool_parser.feed(text)
            if finish is not None:
                text += c.tool_parser.finish()
            if c.tool_parser.num_calls and not text.strip():
                text = ""  # the newlines between and after calls are not content
            if finish == "stop" and c.tool_parser.num_calls and job.tool_parsing in ("auto", "required"):
                finish = c.finish_reason = "tool_calls"
        if not text and finish is None and lp_body is None and not c.first and not calls:
            return None
        chunk = stream_chunk(job.kind, job.response_id, job.created, job.model_name, c.index, text,
                             first=c.first, finish_reason=finish, logprobs=lp_body, tool_calls=calls)
        c.first = False
        return chunk

    def _summary(self, choices: list[_Choice], busy: float) -> StreamSummary:
        return StreamSummary(
            prompt_tokens=choices[0].num_prompt_tokens,
            completion_tokens=sum(c.num_tokens for c in choices),
            cached_tokens=choices[0].num_cached_tokens,
            finish_reasons=[c.finish_reason or "abort" for c in choices],
            engine_timings=choices[0].engine_timings,
            egress_busy=busy,
            aborted_by_stop_string=any(c.stopped_by_string for c in choices),
        )

    def _body(self, job: GenerationJob, choices: list[_Choice], summary: StreamSummary) -> dict[str, Any]:
        rendered = []
        for c in choices:
            lp = None
            if job.engine_request.sampling_params.logprobs is not None:
                prefix = len(c.text[0]) if job.echo and c.text else 0
                lp = (self.logprob_fmt.chat(c.logprobs) if job.kind == "chat"
                      else self.logprob_fmt.completion(c.logprobs, prefix))
            text, finish, calls = "".join(c.text), c.finish_reason or "abort", None
            if job.tool_parsing is not None:
                content, calls = parse_tool_calls(text)
                text = content  # None when the output was only calls, as OpenAI answers
                if calls and finish == "stop" and job.tool_parsing in ("auto", "required"):
                    finish = summary.finish_reasons[c.index] = "tool_calls"  # the log and metrics agree
            rendered.append({"index": c.index, "text": text, "finish_reason": finish, "logprobs": lp,
                             "tool_calls": calls})
        return full_response(job.kind, job.response_id, job.created, job.model_name, rendered,
                             usage(summary.prompt_tokens, summary.completion_tokens, summary.cached_tokens))

    # -- the engine stream ---------------------------------------------------------------------------
    async def _open_accepted(self, job: GenerationJob) -> tuple[EngineStream, EngineOutput]:
        """Open the engine stream and wait for its acceptance item. A full queue is retried on
        another replica; the 429 reaches the client only when every replica tried refused."""
        request = job.engine_request
        for attempt in range(self.max_engine_attempts):
            stream = self.engine_open(request)
            try:
                first = await stream.items.__anext__()
                return stream, first[0]
            except BaseException as exc:
                await stream.close()
                refused = unwrap_error(exc)
                if (not isinstance(refused, EngineOverloadedError) or not refused.replica
                        or refused.replica in request.avoid_replicas or attempt + 1 == self.max_engine_attempts):
                    raise
                request = dataclasses.replace(request, avoid_replicas=[*request.avoid_replicas, refused.replica])
        raise AssertionError("unreachable")

    async def stream(self, job: GenerationJob) -> AsyncIterator[StreamStart | StreamFrame | StreamSummary]:
        """:class:`StreamStart` once the engine accepted, a :class:`StreamFrame` per SSE event
        (streaming only), then the :class:`StreamSummary` (with the body when not streaming)."""
        choices = [self._new_choice(job, i) for i in range(job.n)]
        stream, accepted = await self._open_accepted(job)
        replica = accepted.replica or ""
        busy, event_id = 0.0, 0
        open_choices = set(range(job.n))
        try:
            yield StreamStart(engine_replica=replica, engine_request_ids=[c.engine_id for c in choices],
                              prompt_tokens=accepted.num_prompt_tokens)
            pending = [[accepted]]
            while open_choices:
                outs = pending.pop() if pending else await stream.items.__anext__()
                t0 = time.perf_counter()
                frames: list[StreamFrame] = []
                stopped: list[str] = []
                for out in outs:
                    c = choices[out.index]
                    if c.index not in open_choices:
                        continue  # e.g. the abort that follows a stop string Egress found
                    chunk = self._consume(job, c, out)
                    if c.finish_reason is not None:
                        open_choices.discard(c.index)
                        if c.stopped_by_string and out.finish_reason is None:
                            stopped.append(c.engine_id)
                    if chunk is not None:
                        frames.append(StreamFrame(sse_event(chunk, event_id), c.index, len(out.new_token_ids),
                                                  c.finish_reason))
                        event_id += 1
                busy += time.perf_counter() - t0
                if stopped and open_choices and self.engine_abort is not None:
                    # Other choices go on: abort just these, on the replica that runs them.
                    await self.engine_abort(AbortRequest(replica, stopped))
                for frame in frames:
                    yield frame
        except StopAsyncIteration:
            # The engine ends a stream only once every choice has finished, so an early end means
            # the call was lost with its replica (a killed replica's stream can end cleanly).
            if open_choices:
                raise EngineUnavailableError(
                    "The engine stream ended before the request finished: the engine replica was lost. "
                    "Retry.") from None
        finally:
            await stream.close()  # aborts in the engine whatever is still running there
        summary = self._summary(choices, busy)
        if not job.stream:
            t0 = time.perf_counter()
            summary.body = self._body(job, choices, summary)
            summary.egress_busy += time.perf_counter() - t0
        yield summary


@serve.deployment(name="Egress", max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.25},
                  request_router_config=RequestRouterConfig(request_router_class="stages.routing.EgressRouter",
                                                            request_routing_stats_period_s=1.0,
                                                            request_routing_stats_timeout_s=5.0))
class EgressDeployment:
    """CPU stage between the engine and Ingress; scale it with ``num_replicas``."""

    def __init__(self, engine: Any, model: str, tracing: dict[str, Any] | None = None,
                 stream_channel: bool = True, batch_admission: bool = True) -> None:
        from stages.model_info import load_cpu_tokenizer
        from stages.telemetry import configure_tracing

        configure_tracing(tracing, component="egress")
        self.engine = engine  # DeploymentHandle of the engine, created once and reused
        self._stream_handle = engine.options(stream=True)
        self.egress = Egress(load_cpu_tokenizer(model), self._open, self._abort)
        #: This replica's actor name: the engine aborts our streams if we die (stages.liveness).
        self.name = own_actor_name()
        #: How to end each open engine call by request id: a stream whose Ingress replica died is
        #: ended this way (an abort in the engine).
        self._engine_calls: dict[str, Callable[[], None]] = {}
        self.consumers = ConsumerWatch(self._consumer_gone)
        # The tokens of every request on one engine replica share one stream (stages.channel);
        # it needs our actor name, which the engine keys the mailbox by.
        self.channel = ChannelClient(self._attach, _channel_lost) if stream_channel and self.name else None
        # The engine requests this replica sends in one loop turn share one call (stages.admission).
        self.admission: AdmissionQueue[EngineRequest] | None = (
            AdmissionQueue(self._submit, key=_admission_key, on_orphan=self._abort_orphan)
            if batch_admission and self.channel is not None else None)
        #: Jobs Ingress admitted in batches (:meth:`submit`), each running as its own task.
        self.admitted = AdmittedStreams()
        self._routing_seq = 0
        #: Each Ingress replica's mailbox: the frames of its channel requests (stages.channel).
        self.replica = own_replica_id()
        self.frames = ChannelHub(self.replica)

    def _attach(self, replica: str) -> AsyncIterator[ChannelBatch]:
        return self._stream_handle.attach.remote(ChannelAttach(replica, self.name))

    def _open(self, req: Any) -> EngineStream:
        channel = self.channel
        if self.admission is not None and channel is not None:
            return self._open_admitted(req, self.admission, channel)
        gen = self._stream_handle.generate.remote(dataclasses.replace(req, consumer=self.name,
                                                                      channel=channel is not None))
        self._engine_calls[req.request_id] = gen.cancel
        inbox = channel.register(req.choice_ids()) if channel is not None else None

        async def close() -> None:
            gen.cancel()  # cancellation reaches the engine replica's generator → abort by request id
            if self._engine_calls.get(req.request_id) == gen.cancel:
                del self._engine_calls[req.request_id]
            if inbox is not None and channel is not None:
                channel.unregister(inbox)

        if inbox is None or channel is None:
            return EngineStream(gen, close)
        return EngineStream(engine_items(gen, inbox, channel), close)

    def _open_admitted(self, req: EngineRequest, admission: AdmissionQueue[EngineRequest],
                       channel: ChannelClient) -> EngineStream:
        """The engine stream of one request through batched admission: the acceptance comes in
        the batch call's reply, the outputs through the channel; closing it early aborts by id."""
        inbox = channel.register(req.choice_ids())
        accepted = admission.submit(dataclasses.replace(req, consumer=self.name, channel=True))

        def cancel() -> None:
            """End it in the engine: an abort by id once accepted; else when it is (``on_orphan``)."""
            if not accepted.done():
                accepted.cancel()
            elif not accepted.cancelled() and accepted.exception() is None and not inbox.done:
                self._abort_soon(AbortRequest(accepted.result()[0].replica or "", req.choice_ids()))

        self._engine_calls[req.request_id] = cancel

        async def items() -> AsyncIterator[list[EngineOutput]]:
            first = await accepted
            inbox.note(first)
            channel.bind(inbox, first[0].replica or "")
            yield first
            while not inbox.done:
                yield await inbox.get()

        async def close() -> None:
            cancel()
            if self._engine_calls.get(req.request_id) is cancel:
                del self._engine_calls[req.request_id]
            channel.unregister(inbox)

        return EngineStream(items(), close)

    async def _submit(self, requests: list[EngineRequest]) -> list[Admission]:
        return await self.engine.submit.remote(AdmissionBatch(requests))

    def _abort_orphan(self, req: EngineRequest, accepted: list[EngineOutput]) -> None:
        self._abort_soon(AbortRequest(accepted[0].replica or "", req.choice_ids()))

    def _abort_soon(self, req: AbortRequest) -> None:
        fire_and_forget(lambda: self.engine.abort.remote(req), "engine abort")

    def _consumer_gone(self, key: tuple[str, str]) -> None:
        """The Ingress replica reading this stream died: end its request here and in the engine."""
        consumer, request_id = key
        if not self.admitted.cancel(request_id):  # its job task's ``finally`` closes the engine stream
            cancel = self._engine_calls.pop(request_id, None)
            if cancel is not None:
                cancel()
        self.frames.drop(consumer)

    async def _abort(self, req: AbortRequest) -> None:
        await self.engine.abort.remote(req)

    async def stats(self) -> dict[str, Any]:
        """Batched admission on this replica (tests, benchmarks): jobs running here, and the calls
        and engine requests it sent to the engines."""
        sent = self.admission
        return {"replica": self.replica, "admitted_jobs": len(self.admitted),
                "engine_admission_calls": sent.calls_sent if sent else 0,
                "engine_admission_requests": sent.items_sent if sent else 0,
                "open_engine_calls": len(self._engine_calls)}

    async def ping(self) -> bool:
        """Liveness for the app's ``/health``."""
        return True

    def record_routing_stats(self) -> dict[str, Any]:
        """What :class:`stages.routing.EgressRouter` places batches of jobs by (Serve calls this)."""
        self._routing_seq += 1
        return {"admitted_jobs": len(self.admitted), "seq": self._routing_seq}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What :func:`stages.autoscaling.stage_policy` corrects Serve's count of ongoing requests
        by: the channel attaches open here (one per Ingress replica), which are not load, and the
        batch-admitted jobs running here, which are."""
        from stages.autoscaling import ADMITTED, ATTACHES

        return {ATTACHES: float(self.frames.attaches), ADMITTED: float(len(self.admitted))}

    async def attach(self, request: ChannelAttach) -> AsyncIterator[ChannelBatch]:
        """The channel of the Ingress replica ``request.consumer`` (routed here by name): the
        frames of all its channel requests, one item per wake-up; ends a moment after the last."""
        async for batch in self.frames.attach(request.consumer):
            yield batch

    async def submit(self, batch: AdmissionBatch) -> list[Admission]:
        """Batched admission (:mod:`stages.admission`) of channel jobs from one Ingress replica:
        start each job's :meth:`stream`; answer with its :class:`StreamStart` (or its refusal).
        The rest goes through the consumer's channel, as it does for a streamed job; ``cancel``
        ends one, as does its consumer dying."""
        return list(await asyncio.gather(*(self._admit(job) for job in batch.items)))

    def _admit(self, job: GenerationJob) -> Awaitable[Admission]:
        request_id, consumer = job.engine_request.request_id, job.consumer

        def rest(item: Any) -> None:  # a channel job's stream yields its start only
            logger.warning("unexpected item after the start of %s: %s", request_id, type(item).__name__)

        def failed(exc: BaseException) -> None:
            self.frames.push(consumer, [RoutedFrame(request_id, error=exc)])

        return self.admitted.admit(request_id, self.stream(job), rest, failed)

    async def cancel(self, request: AbortRequest) -> None:
        """End batch-admitted jobs by API request id (their Ingress gave up on them): each job's
        ``finally`` runs, which aborts it in the engine. Unknown or finished ids are ignored."""
        for request_id in request.request_ids:
            self.admitted.cancel(request_id)

    async def stream(self, job: GenerationJob) -> AsyncIterator[StreamStart | StreamFrame | StreamSummary]:
        """The request's :class:`StreamStart`, frames and summary. With ``job.channel`` only the
        start comes here: the rest, or an error met after the start, goes to the consumer's
        channel in order, and this stream stays open until the summary is sent."""
        summary: StreamSummary | None = None
        request_id = job.engine_request.request_id
        key = (job.consumer, request_id)
        self.consumers.add(job.consumer, key)
        channel = job.consumer if job.channel and job.consumer else None
        started = False
        if channel is not None:
            self.frames.open(channel)
        try:
            with span_from_context(get_tracer(), "egress.stream" if job.stream else "egress.complete",
                                   job.engine_request.trace_context,
                                   {"lifecycle.request_id": request_id}) as span:
                try:
                    async for item in self.egress.stream(job):
                        if isinstance(item, StreamSummary):
                            _annotate(span, item)
                            summary = item
                            break  # end the span before the last item: the caller may answer at once
                        if isinstance(item, StreamStart):
                            item.egress_replica = self.replica
                            started = True
                            yield item
                        elif channel is not None:
                            self.frames.push(channel, [RoutedFrame(request_id, item)])
                        else:
                            yield item
                except Exception as exc:
                    if channel is None or not started:
                        raise
                    # After the start the client hears of it in order, after the frames before it.
                    self.frames.push(channel, [RoutedFrame(request_id, error=exc)])
                    return
            if summary is not None:
                if channel is not None:
                    self.frames.push(channel, [RoutedFrame(request_id, summary)])
                else:
                    yield summary
        finally:
            if channel is not None:
                self.frames.close(channel)
            self.consumers.discard(job.consumer, key)


def _admission_key(req: EngineRequest) -> tuple[Any, ...]:
    """What may share an engine ``submit`` call: requests avoiding the same replicas (the router
    places a call as a whole); a structured-output request goes alone (its acceptance waits for its
    grammar's matcher, and would hold up the others')."""
    return (tuple(req.avoid_replicas), req.request_id if req.grammar is not None else "")


def _channel_lost(replica: str) -> BaseException:
    return EngineUnavailableError(f"The engine replica {replica} was lost before the request finished. Retry.")


def _annotate(span: Any, summary: StreamSummary) -> None:
    if not span.is_recording():
        return
    span.set_attribute("lifecycle.egress_busy_ms", summary.egress_busy * 1000)
    span.set_attribute("gen_ai.usage.output_tokens", summary.completion_tokens)
    if summary.aborted_by_stop_string:
        span.add_event("abort", {"reason": "stop_string"})
