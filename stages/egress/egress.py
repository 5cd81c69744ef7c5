"""Egress stage: incremental detokenisation, stop strings, OpenAI chunks and SSE frames.

Egress calls the engine (so a request's stream runs Engine → Egress → Ingress) and turns engine
items into response text. One engine item carries every choice that produced tokens in the steps
since the last one; each choice's part becomes one SSE event, so coalescing in the engine carries
through to the client.

What Ingress receives is typed (:mod:`stages.transport.messages`): a :class:`StreamStart` once the engine has
accepted the request (with the engine replica that runs it, for cancel by id), one
:class:`StreamFrame` per SSE event, and a :class:`StreamSummary` (holding the whole body when the
client did not stream). How requests and items cross replicas is the transport's
(:mod:`stages.transport`, wired up in :mod:`stages.egress.deployment`); this module sees an engine
stream per request and yields that request's items.

Abort paths that start here: a stop string found in one choice's text (the engine cannot see
text) aborts that choice alone, by id, on the engine replica that runs it; the caller going away
(its job is ended by id, which cancels it here) closes the engine stream, which aborts every
choice.

A full engine queue (429) is retried on another engine replica before the client sees it: the
refusing replica goes into ``avoid_replicas`` and the router tries the others first.

:class:`Egress` is plain asyncio (tested and benchmarked without Ray);
:class:`stages.egress.deployment.EgressDeployment` is the Ray Serve wrapper.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from stages.api.render import LogprobFormatter, renderer, sse_event, usage
from stages.api.tool_calls import ToolCallStreamParser, parse_tool_calls
from stages.egress.detokenizer import IncrementalDetokenizer
from stages.egress.migration import engine_lost
from stages.engine.core.errors import EngineOverloadedError
from stages.errors import EngineUnavailableError, unwrap_error
from stages.telemetry import extract, get_tracer
from stages.transport.messages import (
    AbortRequest,
    EngineMoved,
    EngineOutput,
    EngineRequest,
    GenerationJob,
    PrefillNote,
    StreamFrame,
    StreamStart,
    StreamSummary,
)

logger = logging.getLogger("lifecycle.egress")


class EngineStream:
    """One open engine stream: its items, and how to close it early (which aborts in the engine)."""

    def __init__(self, items: AsyncIterator[list[EngineOutput]], close: Callable[[], Awaitable[None]],
                 request: EngineRequest | None = None, forget: Callable[[], None] | None = None) -> None:
        self.items = items
        self.close = close
        #: The request as sent, with the router's note on where it went (once accepted).
        self.request = request
        #: Stop reading without an abort (the replica is gone); ``None``: close instead.
        self.forget = forget


#: Opens the engine stream of one request.
EngineOpen = Callable[[Any], EngineStream]
#: Sends an :class:`AbortRequest` to the engine replica it names.
EngineAbort = Callable[[AbortRequest], Awaitable[None]]
#: The engine replicas that are healthy now (their names), for a move off a lost one.
HealthyEngines = Callable[[], Awaitable[list[str]]]


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
    #: The token ids generated so far (what a move to another engine replica carries over).
    token_ids: list[int] = field(default_factory=list)
    #: Moved to another engine replica: usage and TTFT parts stay those of the first one.
    moved: bool = False
    #: Its prefill's usage and timings have ridden on a frame (:class:`PrefillNote`).
    prefill_sent: bool = False
    #: Tokens consumed since this choice's last frame (the next frame carries them).
    unframed: list[int] = field(default_factory=list)


class Egress:
    """Runs one generation job against the engine and renders OpenAI output."""

    def __init__(self, tokenizer: Any, engine_open: EngineOpen, engine_abort: EngineAbort | None = None,
                 max_engine_attempts: int = 4, max_migrations: int = 0,
                 healthy_engines: HealthyEngines | None = None) -> None:
        self.tokenizer = tokenizer
        self.engine_open = engine_open
        self.engine_abort = engine_abort
        self.max_engine_attempts = max_engine_attempts
        self.logprob_fmt = LogprobFormatter(tokenizer)
        #: Moves of a request to another engine replica allowed (:mod:`stages.egress.migration`).
        self.max_migrations = max_migrations
        self.healthy_engines = healthy_engines
        #: Requests moved, and the tokens (prompt and carried over) the new replicas computed again.
        self.migrations = 0
        self.recomputed_tokens = 0

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
        c.token_ids.extend(out.new_token_ids)
        if not c.moved:
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
                lp_body = renderer(job.kind).logprobs(self.logprob_fmt, out.logprobs, c.text_len)
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
        chunk = renderer(job.kind).stream_chunk(job.response_id, job.created, job.model_name, c.index, text,
                                                first=c.first, finish_reason=finish, logprobs=lp_body,
                                                tool_calls=calls)
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
        api = renderer(job.kind)
        rendered = []
        for c in choices:
            lp = None
            if job.engine_request.sampling_params.logprobs is not None:
                prefix = len(c.text[0]) if job.echo and c.text else 0
                lp = api.logprobs(self.logprob_fmt, c.logprobs, prefix)
            text, finish, calls = "".join(c.text), c.finish_reason or "abort", None
            if job.tool_parsing is not None:
                content, calls = parse_tool_calls(text)
                text = content  # None when the output was only calls, as OpenAI answers
                if calls and finish == "stop" and job.tool_parsing in ("auto", "required"):
                    finish = summary.finish_reasons[c.index] = "tool_calls"  # the log and metrics agree
            rendered.append({"index": c.index, "text": text, "finish_reason": finish, "logprobs": lp,
                             "tool_calls": calls})
        return api.full_response(job.response_id, job.created, job.model_name, rendered,
                                 usage(summary.prompt_tokens, summary.completion_tokens, summary.cached_tokens))

    # -- the engine stream ---------------------------------------------------------------------------
    async def _open_accepted(self, request: EngineRequest) -> tuple[EngineStream, EngineOutput]:
        """Open the engine stream and wait for its acceptance item. A full queue is retried on
        another replica; the 429 reaches the client only when every replica tried refused."""
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

    async def stream(self, job: GenerationJob) -> AsyncIterator[StreamStart | StreamFrame | StreamSummary | EngineMoved]:
        """:class:`StreamStart` once the engine accepted, a :class:`StreamFrame` per SSE event
        (streaming only), then the :class:`StreamSummary` (with the body when not streaming). If
        the engine replica is lost, the request moves to another (:mod:`stages.egress.migration`)
        and an :class:`EngineMoved` says where."""
        choices = [self._new_choice(job, i) for i in range(job.n)]
        open_choices = set(range(job.n))
        request, event_id = job.engine_request, 0
        if job.carry is not None:
            request, event_id = self._rebuild(job, choices, open_choices), job.carry.next_event_id
        if not open_choices:  # every choice had ended; only the summary was lost with its replica
            assert job.carry is not None
            yield StreamStart(engine_replica="", engine_request_ids=[c.engine_id for c in choices],
                              prompt_tokens=job.carry.prompt_tokens)
            summary = self._summary(choices, 0.0)
            summary.prompt_tokens, summary.num_events = job.carry.prompt_tokens, event_id
            if not job.stream:
                summary.body = self._body(job, choices, summary)
            yield summary
            return
        stream, accepted = await self._open_accepted(request)
        replica = accepted.replica or ""
        busy = 0.0
        lost: list[str] = []  # engine replicas this request was lost on
        move: _Move | None = None
        try:
            yield StreamStart(engine_replica=replica, engine_request_ids=[c.engine_id for c in choices],
                              prompt_tokens=accepted.num_prompt_tokens)
            pending = [[accepted]]
            while open_choices:
                if pending:
                    outs = pending.pop()
                else:
                    try:
                        outs = await stream.items.__anext__()
                    except (Exception, StopAsyncIteration) as exc:  # noqa: BLE001 - sorted below
                        lost.append(replica)
                        if not engine_lost(exc) or not await self._may_move(job, lost):
                            if isinstance(exc, StopAsyncIteration):
                                # The engine ends a stream only once every choice has finished, so
                                # an early end means the call was lost with its replica.
                                raise EngineUnavailableError(
                                    "The engine stream ended before the request finished: the engine replica "
                                    "was lost. Retry.") from None
                            raise
                        if move is not None:
                            move.resumed()
                        move = _Move(job, replica, sum(len(choices[i].token_ids) for i in open_choices))
                        if stream.forget is not None:
                            stream.forget()  # the replica is gone: nothing to abort there
                        else:
                            await stream.close()
                        stream, accepted = await self._move(job, choices, open_choices, lost)
                        replica = accepted.replica or ""
                        move.accepted(replica)
                        yield EngineMoved(replica, [c.engine_id for c in choices])
                        pending = [[accepted]]
                        continue
                t0 = time.perf_counter()
                frames: list[StreamFrame] = []
                stopped: list[str] = []
                for out in outs:
                    c = choices[out.index]
                    if c.index not in open_choices:
                        continue  # e.g. the abort that follows a stop string Egress found
                    if move is not None and out.new_token_ids:
                        move.resumed()  # the first token from the new replica: the move is over
                        move = None
                    chunk = self._consume(job, c, out)
                    c.unframed.extend(out.new_token_ids)
                    if c.finish_reason is not None:
                        open_choices.discard(c.index)
                        if c.stopped_by_string and out.finish_reason is None:
                            stopped.append(c.engine_id)
                    if chunk is not None:
                        frames.append(StreamFrame(sse_event(chunk, event_id), c.index, len(out.new_token_ids),
                                                  c.finish_reason, event_id, c.unframed,
                                                  self._prefill_note(c, stream)))
                        c.unframed = []
                        event_id += 1
                busy += time.perf_counter() - t0
                if stopped and open_choices and self.engine_abort is not None:
                    # Other choices go on: abort just these, on the replica that runs them.
                    await self.engine_abort(AbortRequest(replica, stopped))
                for frame in frames:
                    yield frame
        finally:
            if move is not None:
                move.resumed()
            await stream.close()  # aborts in the engine whatever is still running there
        summary = self._summary(choices, busy)
        summary.num_events = event_id
        summary.route = stream.request.route if stream.request is not None else None
        if job.carry is not None and job.carry.prefill is not None:
            summary.route = job.carry.prefill.route
        if not job.stream:
            t0 = time.perf_counter()
            summary.body = self._body(job, choices, summary)
            summary.egress_busy += time.perf_counter() - t0
        yield summary

    @staticmethod
    def _prefill_note(c: _Choice, stream: EngineStream) -> PrefillNote | None:
        """The first choice's prefill, once, on its first frame that knows it."""
        if c.index or c.prefill_sent or not c.engine_timings:
            return None
        c.prefill_sent = True
        route = stream.request.route if stream.request is not None else None
        return PrefillNote(c.num_cached_tokens, dict(c.engine_timings), route)

    def _rebuild(self, job: GenerationJob, choices: list[_Choice], open_choices: set[int]) -> EngineRequest:
        """A job moved here from a lost Egress replica (:class:`StreamCarry`): bring each choice to
        where its client is (the chunks that produces were sent already) and return the engine
        request for the rest, carrying each choice's tokens."""
        carry = job.carry
        assert carry is not None
        for c in choices:
            if c.index in carry.started:
                self._consume(job, c, EngineOutput(c.engine_id, list(carry.token_ids[c.index])))
            if c.index in carry.finished:
                c.finish_reason = carry.finished[c.index]
                open_choices.discard(c.index)
        if carry.prefill is not None:  # the summary reports the prefill the client waited for
            first = choices[0]
            first.num_prompt_tokens, first.num_cached_tokens = carry.prompt_tokens, carry.prefill.cached_tokens
            first.engine_timings = dict(carry.prefill.engine_timings)
            first.moved = first.prefill_sent = True
        return dataclasses.replace(job.engine_request, output_token_ids=[list(t) for t in carry.token_ids],
                                   finished_choices=sorted(carry.finished), route=None)

    async def _may_move(self, job: GenerationJob, lost: list[str]) -> bool:
        """Whether a request lost on the replicas ``lost`` (the last just now) may move again."""
        if len(lost) > self.max_migrations:
            return False
        if self.healthy_engines is None:
            return True
        try:
            return any(r not in lost for r in await self.healthy_engines())
        except Exception:  # noqa: BLE001 - nobody to ask: the old error path
            return False

    async def _move(self, job: GenerationJob, choices: list[_Choice], open_choices: set[int],
                    lost: list[str]) -> tuple[EngineStream, EngineOutput]:
        """Send the request, with the tokens each choice has so far, to an engine replica it was
        not lost on; the choices already finished are not run again. A replica lost before it
        accepted counts as one more move."""
        while True:
            request = dataclasses.replace(
                job.engine_request, output_token_ids=[list(c.token_ids) for c in choices],
                finished_choices=[c.index for c in choices if c.index not in open_choices], route=None,
                avoid_replicas=[*job.engine_request.avoid_replicas, *lost])
            self.migrations += 1
            self.recomputed_tokens += len(request.prompt_token_ids) + sum(
                len(c.token_ids) for c in choices if c.index in open_choices)
            for c in choices:
                c.moved = True
            try:
                return await self._open_accepted(request)
            except Exception as exc:
                lost.append("")  # where it went is unknown: it never accepted
                if not engine_lost(exc) or not await self._may_move(job, lost):
                    raise


class _Move:
    """The span of one move (:mod:`stages.egress.migration`): from the loss to the first token
    from the new replica, with where from and to, the tokens carried over and the time lost."""

    def __init__(self, job: GenerationJob, lost: str, carried: int) -> None:
        self.lost = lost
        self.carried = carried
        self.t0 = time.perf_counter()
        self.span = get_tracer().start_span("migration", context=extract(job.engine_request.trace_context),
                                            attributes={"lifecycle.migration.from": lost,
                                                        "lifecycle.migration.tokens_carried": carried})

    def accepted(self, replica: str) -> None:
        self.to = replica
        self.accepted_ms = (time.perf_counter() - self.t0) * 1000
        self.span.set_attributes({"lifecycle.migration.to": replica, "lifecycle.migration.accepted_ms": self.accepted_ms})

    def resumed(self) -> None:
        lost_ms = (time.perf_counter() - self.t0) * 1000
        self.span.set_attribute("lifecycle.migration.time_lost_ms", lost_ms)
        self.span.end()
        logger.info("a request moved from engine replica %s to %s with %d tokens: accepted after %.0f ms, "
                    "next token after %.0f ms", self.lost, getattr(self, "to", "?"), self.carried,
                    getattr(self, "accepted_ms", float("nan")), lost_ms)
