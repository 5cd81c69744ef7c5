"""Plain, picklable messages that cross deployment boundaries.

Nothing here holds a live object (no Starlette request, no tensor, no lock): every message is a
dataclass of ints, floats, strings, lists and dicts so Ray can pickle it cheaply. Timing fields are
durations measured inside one process, never raw clocks from another process.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field
from typing import Any

from stages.api.kinds import ApiKind
from stages.api.max_tokens import MaxTokens

#: Maximum ``top_logprobs`` the sampler returns (the OpenAI API allows 20).
MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick tokens for one sequence, and when to stop.

    ``top_k <= 0`` disables top-k; ``top_p == 1`` and ``min_p == 0`` disable nucleus and min-p
    filtering; ``temperature == 0`` means greedy. ``logprobs`` is ``None`` when no log-probabilities
    are wanted, else the number of alternatives (0..20) returned beside the sampled token's own.
    ``stop`` strings are handled by Egress (they need text); the engine handles ``stop_token_ids``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: OpenAI ``logit_bias``: token id -> value added to its logit (-100..100) before sampling.
    logit_bias: dict[int, float] = field(default_factory=dict)
    #: vLLM ``allowed_token_ids``: when set, every other token is masked out.
    allowed_token_ids: list[int] | None = None
    #: vLLM ``bad_words`` as token sequences (Preprocess tokenises them): the last token of a
    #: sequence is banned whenever the output ends with the tokens before it.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any of the presence, frequency or repetition penalties is active."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def has_token_restrictions(self) -> bool:
        """True when ``logit_bias``, ``allowed_token_ids`` or ``bad_words`` change the logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)


@dataclass
class StructuredOutputSpec:
    """What the client asked the output to match, before compilation (Ingress → Preprocess).

    ``spec`` is text: a JSON schema (``json_schema``, ``tool_call``), a JSON list of strings
    (``choice``), a regular expression (``regex``), a Lark or GBNF grammar (``grammar``), or empty
    (``json_object``). ``param`` is the request field it came from, named in a 400 when it does
    not compile.
    """

    kind: str
    spec: str
    param: str = "response_format"


@dataclass
class GrammarSpec:
    """A compiled, validated grammar on its way to the engine (Preprocess → Egress → Engine).

    ``grammar`` is llguidance's serialised grammar, already checked against the tokenizer whose
    digest is ``tokenizer_hash``; the engine builds its matcher from it off the step loop and keeps
    it by ``key`` (a digest of the client's spec and the tokenizer), so a repeated schema costs
    nothing there either.
    """

    kind: str
    grammar: str
    key: str
    tokenizer_hash: str

    @property
    def nbytes(self) -> int:
        """Approximate bytes held by this entry (what the Preprocess cache counts)."""
        return len(self.grammar) + len(self.key) + len(self.tokenizer_hash) + 64


@dataclass
class TokenLogprob:
    """Log-probability of one sampled token and, if asked, its top alternatives."""

    token_id: int
    logprob: float
    #: (token_id, logprob) pairs, most likely first; empty when not asked.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class PrefixSummary:
    """What an engine replica holds in its prefix cache, for the routers (Engine → every caller).

    The chained hash (:func:`stages.engine.core.block_manager.chain_hash`) of every cached full
    block, cut to its low 32 bits and packed little-endian: 4 bytes a block, and only hashes leave
    the engine, never token ids. ``version`` changes whenever the set does. A router that finds a
    prompt's block hashes here expects those tokens cached; the engine still confirms every hit by
    its tokens, so a stale or colliding summary costs a wrong guess, never a wrong answer.
    """

    block_size: int
    version: int
    hashes: bytes = b""

    @staticmethod
    def short(block_hash: int) -> int:
        """The 32 bits of a chained hash that a summary keeps."""
        return block_hash & 0xFFFFFFFF

    @classmethod
    def of(cls, block_size: int, version: int, block_hashes: list[int]) -> PrefixSummary:
        packed = array("I", map(cls.short, block_hashes))
        if sys.byteorder != "little":
            packed.byteswap()
        return cls(block_size, version, packed.tobytes())

    def hash_set(self) -> frozenset[int]:
        """The short hashes, unpacked (a router does this once per version)."""
        packed = array("I")
        packed.frombytes(self.hashes)
        if sys.byteorder != "little":
            packed.byteswap()
        return frozenset(packed)

    def __len__(self) -> int:
        return len(self.hashes) // 4


@dataclass(frozen=True)
class RouteNote:
    """Why the router sent a request where it did (set by :mod:`stages.routing` on the caller's
    side, read by the engine for its span and by Egress for the request's summary).

    ``expected_cached_tokens`` is what the router believed the replica had cached of this prompt;
    the engine's actual hit is ``EngineOutput.num_cached_tokens``. ``alternative`` is the next best
    replica (``None`` with one candidate) with its score: lower scores are better.
    """

    replica: str
    policy: str
    score: float
    expected_cached_tokens: int
    alternative: str | None = None
    alternative_score: float | None = None
    alternative_cached_tokens: int = 0

    def attributes(self) -> dict[str, Any]:
        """As span attributes / log fields (``lifecycle.route.*`` without the prefix)."""
        out: dict[str, Any] = {"replica": self.replica, "policy": self.policy, "score": round(self.score, 3),
                               "expected_cached_tokens": self.expected_cached_tokens}
        if self.alternative is not None:
            out.update(alternative=self.alternative, alternative_score=round(self.alternative_score or 0.0, 3),
                       alternative_cached_tokens=self.alternative_cached_tokens)
        return out


@dataclass
class EngineRequest:
    """A tokenised API request handed from Preprocess (through Egress) to one Engine replica.

    ``request_id`` is minted by the server, unique across the cluster and never reused; the
    client's ``X-Request-Id`` never reaches the engine. All ``n`` choices run on the same engine
    replica, as engine requests named by :func:`choice_request_id`, so they share the prompt's KV
    blocks and a 429 moves them together.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    #: W3C trace context carrier (``traceparent`` / ``tracestate``), empty when tracing is off.
    trace_context: dict[str, str] = field(default_factory=dict)
    #: Rendered prompt text; kept only so Egress can echo it (``echo``) and for opt-in logging.
    prompt_text: str | None = None
    #: Number of choices (``n``).
    n: int = 1
    #: Durations measured upstream (seconds), e.g. ``{"template": .., "tokenize": ..}``.
    upstream_timings: dict[str, float] = field(default_factory=dict)
    #: Engine replicas that already refused this request with a full queue: the router skips them.
    avoid_replicas: list[str] = field(default_factory=list)
    #: Ray actor name of the replica reading the request's outputs (Egress): the engine keys its
    #: channel mailbox by it and ends the request if that replica dies (:mod:`stages.transport.liveness`).
    consumer: str = ""
    #: Structured output: every choice's tokens must match this grammar (``None``: unconstrained).
    grammar: GrammarSpec | None = None
    #: Set by the engine router when it places the request (:mod:`stages.routing`).
    route: RouteNote | None = None
    #: A request moved off a lost engine replica: per choice, the tokens it had generated (empty:
    #: never moved). This replica computes prompt and these, then goes on as if it had sampled
    #: them itself (they count toward ``max_tokens``, penalties, the grammar and the seeded
    #: position).
    output_token_ids: list[list[int]] = field(default_factory=list)
    #: Choices of a moved request that had already finished: they are not run again.
    finished_choices: list[int] = field(default_factory=list)

    def choice_ids(self) -> list[str]:
        """The engine request id of every choice, in choice order."""
        return [choice_request_id(self.request_id, i, self.n) for i in range(self.n)]

    def carried(self, index: int) -> list[int]:
        """The tokens choice ``index`` generated before a move ([] when it never moved)."""
        return self.output_token_ids[index] if self.output_token_ids else []


def choice_request_id(request_id: str, index: int, n: int) -> str:
    """Engine id of choice ``index``: the request id itself when ``n == 1``, else ``<id>-<index>``
    (unambiguous because minted ids never contain ``-``)."""
    return request_id if n == 1 else f"{request_id}-{index}"


@dataclass
class AbortRequest:
    """End these requests on the replica ``replica`` (the router sends it there): engine request
    ids on an engine replica, API request ids on an Egress replica (an Ingress ending the jobs it
    gave up on, :mod:`stages.transport.consumer`).

    Unknown or finished ids are ignored. Each aborted request ends its stream normally with
    ``finish_reason="abort"``, so the client still gets what was generated so far.
    """

    replica: str
    request_ids: list[str]


@dataclass
class AdmissionBatch:
    """The requests one caller replica sends a producer replica in one loop turn, in one call
    (:mod:`stages.transport.admission`): engine requests (Egress → engine) or generation jobs
    (Ingress → Egress). Each one's acceptance (its first item) or refusal comes back in the
    reply; the rest through the caller's channel (:mod:`stages.transport.producer`)."""

    items: list[Any]


@dataclass
class Admission:
    """One request's answer in an :class:`AdmissionBatch` reply, in the batch's order: the first
    item of its stream (accepted), or the error its stream would have raised (refused)."""

    item: Any = None
    error: BaseException | None = None


@dataclass
class RoutedError:
    """A channel item ending one request with an error, after the items before it (the request
    failed in the producer after it was accepted: the engine died, a step failed for it, Egress
    failed to frame it). ``request_id`` is the key the request's items are routed by."""

    request_id: str
    error: BaseException


@dataclass
class ChannelAttach:
    """Open the channel of ``consumer`` on the replica ``replica`` (an engine or Egress replica;
    the router sends it there): one stream carrying the items of all that consumer's requests."""

    replica: str
    consumer: str


@dataclass
class EngineOutput:
    """What the engine produced for one request since the last item it streamed.

    The engine coalesces: one ``EngineOutput`` may carry the tokens of several steps when the
    consumer was slower than the engine. ``finish_reason`` is set on the last item only.
    """

    request_id: str
    new_token_ids: list[int]
    #: One entry per new token when logprobs were asked, else ``None``.
    logprobs: list[TokenLogprob] | None = None
    #: ``"stop"``, ``"length"`` or ``"abort"`` on the final item; ``None`` before.
    finish_reason: str | None = None
    #: The token id that ended the request (EOS or a stop token), when there is one.
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    #: Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    #: Engine-side durations in seconds, on the first and final items: ``queue``, ``prefill``,
    #: ``decode``, ``engine_total``, plus counters such as ``num_preemptions`` and ``decode_steps``.
    timings: dict[str, float] = field(default_factory=dict)
    #: Choice index within the API request.
    index: int = 0
    #: On the acceptance item only (the first, empty one): the engine replica running the request,
    #: which an :class:`AbortRequest` must target.
    replica: str | None = None

    @property
    def finished(self) -> bool:
        """True on the request's final item."""
        return self.finish_reason is not None


@dataclass
class ChannelBatch:
    """One item of a consumer's channel (:mod:`stages.transport.channel`): what its requests on ``replica``
    produced since the last item. From an engine, one merged :class:`EngineOutput` per engine
    request; from Egress, :class:`RoutedFrame` items in order. The first item of an attach is
    empty: a hello that names the replica, so a channel routed to the wrong replica is noticed."""

    replica: str
    items: list[Any]


@dataclass
class PreprocessRequest:
    """A validated API request on its way from Ingress to Preprocess.

    Exactly one of ``messages`` (chat) or ``prompt`` (text or token ids) is set. Preprocess sets
    ``sampling_params.max_tokens`` from ``max_tokens`` once the prompt's length is known
    (:meth:`MaxTokens.resolve`).
    """

    request_id: str
    sampling_params: SamplingParams
    max_tokens: MaxTokens
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    add_generation_prompt: bool = True
    trace_context: dict[str, str] = field(default_factory=dict)
    n: int = 1
    #: Structured output to compile (``None``: unconstrained).
    structured: StructuredOutputSpec | None = None
    #: OpenAI ``tools`` (function definitions) rendered into the prompt by the chat template.
    tools: list[dict[str, Any]] | None = None
    #: ``"auto"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``.
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    #: vLLM ``bad_words``: Preprocess tokenises them into ``SamplingParams.bad_words_token_ids``.
    bad_words: list[str] = field(default_factory=list)


@dataclass
class GenerationJob:
    """What Egress needs to run one API request: the engine request and the response shape."""

    engine_request: EngineRequest
    #: Which API answers (its renderer, :func:`stages.api.render.renderer`, shapes the output).
    kind: ApiKind
    model_name: str
    response_id: str
    created: int
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    #: Ray actor name of the Ingress replica reading the frames: Egress keys its channel mailbox by
    #: it and ends the job if that replica dies (:mod:`stages.transport.liveness`).
    consumer: str = ""
    #: Parse Hermes-style ``<tool_call>`` blocks out of the output into ``tool_calls``:
    #: ``"auto"``/``"required"`` (finish reason ``tool_calls`` when there are any), ``"named"``
    #: (finish reason ``stop``, as OpenAI does for a forced function), ``None`` (no tools).
    tool_parsing: str | None = None
    #: Set for a resumable stream (``X-Resumable``): Egress keeps its events for a reconnect.
    resume: ResumeTerms | None = None
    #: Set when the job moves here from an Egress replica that was lost mid-stream: what its client
    #: has already received (:mod:`stages.ingress.egress_moves`).
    carry: StreamCarry | None = None


@dataclass
class PrefillNote:
    """What a stream's summary says of its first prefill (the first choice's): the engine's cached
    tokens and timings (queue, prefill) and where the router sent it. It rides on the stream's
    first frame that knows it, so a stream moved off a lost Egress replica still reports the
    prefill its client waited for, not the new engine's recompute (:class:`StreamCarry`)."""

    cached_tokens: int
    engine_timings: dict[str, float]
    route: RouteNote | None = None


@dataclass
class StreamCarry:
    """A stream's state as its client has received it, per choice: Egress rebuilds its
    detokeniser, stop-string and tool-call state from the tokens, sends nothing they produced
    again, numbers the next event ``next_event_id``, and asks the engine only for the rest."""

    #: Per choice, the tokens behind every event received (and any text held back after them).
    token_ids: list[list[int]]
    #: Choices with at least one event received (their first chunk, with the role, is sent).
    started: list[int]
    #: Choices whose last event was received, with their finish reasons.
    finished: dict[int, str]
    next_event_id: int
    prompt_tokens: int
    #: The first prefill's usage and timings, when a frame brought them (:class:`PrefillNote`).
    prefill: PrefillNote | None = None


@dataclass
class ResumeTerms:
    """How a resumable stream's events are kept (:mod:`stages.egress.resume`), and the names a
    reconnecting client may find it by (the directory indexes them while nobody is attached)."""

    #: Seconds the events stay after the client leaves (or after the request finishes, if later).
    grace_s: float
    #: Past this many bytes of kept events the stream is no longer resumable.
    max_bytes: int
    client_request_id: str | None = None
    api_key_id: str | None = None


# -- Egress → Ingress -------------------------------------------------------------------------------
@dataclass
class StreamStart:
    """First item of every Egress stream: the engine accepted the request (so Ingress can commit to
    a 200), and where it runs (so a cancel by id can reach it)."""

    engine_replica: str
    engine_request_ids: list[str]
    prompt_tokens: int
    #: The Egress replica running the request (its frames come through that replica's channel).
    egress_replica: str = ""


@dataclass
class EngineMoved:
    """A request moved to another engine replica (its first one was lost,
    :mod:`stages.egress.migration`): where it runs now, for a cancel by id and the liveness check."""

    engine_replica: str
    engine_request_ids: list[str]


@dataclass
class StreamFrame:
    """One SSE event of a streamed response: its text and what it carries."""

    data: str
    #: Choice the event belongs to.
    index: int
    #: Tokens generated for that choice since the previous frame.
    num_tokens: int
    #: Set when this event ends the choice.
    finish_reason: str | None = None
    #: The event's SSE ``id:`` (Egress numbers a stream's events from 0; a reconnecting client
    #: names the last one it received).
    event_id: int = -1
    #: The tokens of that choice behind this event since its previous one (so a stream whose
    #: Egress replica is lost can be rebuilt on another: :class:`StreamCarry`).
    token_ids: list[int] = field(default_factory=list)
    #: On the first frame after the first choice's prefill, that prefill (:class:`PrefillNote`).
    prefill: PrefillNote | None = None


@dataclass
class StreamSummary:
    """Last item of a stream: usage, finish reasons and timings (plus the whole body when the
    client did not ask to stream)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reasons: list[str]
    #: Engine-measured durations (seconds) of the first choice: queue, prefill, decode, ...
    engine_timings: dict[str, float]
    #: Seconds Egress spent detokenising and framing.
    egress_busy: float
    aborted_by_stop_string: bool = False
    #: The non-streamed response body; ``None`` when streaming.
    body: dict[str, Any] | None = None
    #: Where the engine router sent the request and what it expected cached there.
    route: RouteNote | None = None
    #: SSE events Egress sent before this summary (the closing events' ids follow on).
    num_events: int = 0


@dataclass
class RoutedFrame:
    """An Egress item in a channel batch, named by its request: a frame, a part of a whole body,
    or the summary (always last)."""

    request_id: str
    item: StreamFrame | BodyPart | StreamSummary | EngineMoved

    @property
    def nbytes(self) -> int:
        """An upper bound of its pickled size (what a channel batch is bounded by)."""
        item = self.item
        if isinstance(item, BodyPart):
            return len(item.data) + 64
        if isinstance(item, StreamFrame):
            return 4 * len(item.data) + (640 if item.prefill is not None else 128)
        return 512


# -- the live-request directory ---------------------------------------------------------------------
@dataclass
class LiveEntry:
    """One live API request as the directory knows it: who owns its stream and how to name it."""

    #: Server-minted id (the response ``id`` is ``<prefix>-<request_id>``).
    request_id: str
    response_id: str
    #: Ingress replica that holds the client's connection.
    owner: str
    #: The client's ``X-Request-Id`` label, if it sent one.
    client_request_id: str | None = None
    #: Digest of the API key that created the request (``None`` when keys are off).
    api_key_id: str | None = None
    #: A detached resumable stream: ``owner`` is the Egress replica keeping its events, and a
    #: cancel ends it there (nobody holds its connection).
    kept: bool = False


@dataclass
class DetachRequest:
    """Ingress → the Egress replica ``replica``: the client of the resumable stream
    ``request_id`` left; keep its events for the grace period instead of ending it. With
    ``delivered``, the client instead received the whole stream: its events may go."""

    replica: str
    request_id: str
    delivered: bool = False


@dataclass
class ResumeRequest:
    """Ingress → the Egress replica ``replica`` that keeps ``request_id``'s events: send the
    events after ``after`` (-1: all) and the rest as they come through ``consumer``'s channel."""

    replica: str
    request_id: str
    after: int
    consumer: str


@dataclass
class ResumeStart:
    """Egress's answer to a :class:`ResumeRequest`: where the request runs, what its closing
    events need (the Ingress that resumes it did not start it), and what was replayed."""

    start: StreamStart
    kind: ApiKind
    model_name: str
    response_id: str
    created: int
    include_usage: bool
    #: The request's trace, so the reconnect joins it.
    trace_context: dict[str, str]
    #: Reconnects so far, this one included.
    reconnects: int
    #: Kept events sent again (those after ``after``).
    replayed: int
    #: The kept events were dropped (past the byte cap): an error event and ``[DONE]`` follow.
    dropped: bool = False


@dataclass
class ResumeLookup:
    """The directory's answer to a reconnect: the kept streams ``key`` names (nobody attached),
    and how many live requests it names that still have a connection."""

    kept: list[LiveEntry] = field(default_factory=list)
    attached: int = 0


@dataclass
class WatchReply:
    """Answer to an owner's long poll: requests to cancel, or "send me your whole list again"."""

    cancel_ids: list[str] = field(default_factory=list)
    resync: bool = False


@dataclass
class EngineReport:
    """What each engine replica publishes every few seconds for app-wide health and metrics."""

    replica: str
    node_id: str
    max_model_len: int
    #: The step loop is alive and has finished a step recently whenever it had work.
    healthy: bool
    #: :meth:`stages.engine.driver.async_engine.AsyncEngine.snapshot`: gauges and monotonic counters.
    stats: dict[str, Any] = field(default_factory=dict)
    #: Seconds between this replica's reports: the directory counts one that missed a few as gone
    #: (0: the directory's own ``report_ttl_s`` applies).
    report_interval_s: float = 0.0


@dataclass
class ReplyPart:
    """One piece of a reply streamed in parts because it may outgrow one inter-deployment message
    (see :mod:`stages.transport.chunking`): each value is a whole scalar, or a slice of a string or list."""

    fields: dict[str, Any]


@dataclass
class BodyPart:
    """A slice of a whole (non-streamed) response body, pickled: a body with many choices or
    logprobs can outgrow one inter-deployment message, so it travels in slices of bounded size
    before its :class:`StreamSummary` (:func:`stages.transport.producer.frames`)."""

    data: bytes
