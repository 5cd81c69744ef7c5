"""OpenAI response objects (chat and text completions, streamed and not) and SSE framing.

Pure code over plain data, shared by Egress (content chunks) and Ingress (final timing chunk,
errors). Chat and text completions differ only inside :class:`ChatRenderer` and
:class:`CompletionRenderer`; a request's :class:`~stages.api.kinds.ApiKind` picks one
(:func:`renderer`). Shapes follow the OpenAI API so the official client parses them unmodified.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from stages.api.kinds import ApiKind
from stages.transport.messages import TokenLogprob

#: Extension field carrying the server-side stage durations (milliseconds).
TIMING_FIELD = "server_timing"


# -- SSE --------------------------------------------------------------------------------------------
def sse_event(data: dict[str, Any] | str, event_id: int | None = None) -> str:
    """One Server-Sent Event: optional ``id:`` line, one ``data:`` line, blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    prefix = f"id: {event_id}\n" if event_id is not None else ""
    return f"{prefix}data: {payload}\n\n"


#: A heartbeat comment line with no blank line after it: a blank line would end an "event" made of
#: just the comment, and clients that keep the last ``id:`` (the official ``openai`` client does)
#: then dispatch an event with empty data and fail to parse it. A comment line on its own is
#: folded into the next event and ignored there, as the SSE spec says.
SSE_KEEPALIVE = ": keep-alive\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


# -- logprobs ---------------------------------------------------------------------------------------
class LogprobFormatter:
    """Token strings for logprobs, from the tokenizer (cached per id); the shapes are the renderers'."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


# -- responses --------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Renderer:
    """Everything that differs between the chat and the text completions API when answering:
    names (response id prefix, ``object`` values, route, operation), the shape of a streamed and
    a whole choice, and of logprobs. One instance per :class:`ApiKind` (:func:`renderer`); only the
    kind crosses a deployment, never the renderer."""

    kind: ClassVar[ApiKind]
    #: Prefix of the response ``id`` (``chatcmpl-`` + the minted request id).
    id_prefix: ClassVar[str]
    #: The route answering this API (the server span is named ``POST <path>``).
    path: ClassVar[str]
    #: OpenTelemetry ``gen_ai.operation.name``.
    operation: ClassVar[str]
    #: ``object`` of a whole response and of a streamed chunk.
    object_name: ClassVar[str]
    chunk_object_name: ClassVar[str]

    def response_id(self, request_id: str) -> str:
        """The OpenAI response ``id`` of a request."""
        return self.id_prefix + request_id

    def logprobs(self, tokens: LogprobFormatter, lps: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
        """``choices[].logprobs`` for ``lps``; ``text_offset`` is the characters of this choice's
        text before them (the legacy shape counts offsets)."""
        raise NotImplementedError

    def stream_choice(self, index: int, text: str, *, first: bool, finish_reason: str | None,
                      logprobs: dict[str, Any] | None, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
        raise NotImplementedError

    def whole_choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _envelope(self, response_id: str, created: int, model: str, streamed: bool) -> dict[str, Any]:
        obj = self.chunk_object_name if streamed else self.object_name
        return {"id": response_id, "object": obj, "created": created, "model": model}

    def stream_chunk(self, response_id: str, created: int, model: str, index: int, text: str, *,
                     first: bool = False, finish_reason: str | None = None,
                     logprobs: dict[str, Any] | None = None,
                     tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One streamed choice delta. ``tool_calls`` are whole calls (``index``, ``id``, ``type``,
        ``function.name`` and all of ``function.arguments``)."""
        body = self._envelope(response_id, created, model, streamed=True)
        body["choices"] = [self.stream_choice(index, text, first=first, finish_reason=finish_reason,
                                              logprobs=logprobs, tool_calls=tool_calls)]
        return body

    def final_stream_chunk(self, response_id: str, created: int, model: str, usage_body: dict[str, Any] | None,
                           timings_ms: dict[str, float] | None) -> dict[str, Any]:
        """The closing chunk: no choices, the usage when asked, and the server timings."""
        body = self._envelope(response_id, created, model, streamed=True)
        body["choices"] = []
        body["usage"] = usage_body
        if timings_ms is not None:
            body[TIMING_FIELD] = timings_ms
        return body

    def full_response(self, response_id: str, created: int, model: str, choices: list[dict[str, Any]],
                      usage_body: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed response. ``choices`` items: index, text, finish_reason, logprobs, and
        optionally tool_calls; they come out ordered by index."""
        body = self._envelope(response_id, created, model, streamed=False)
        body["choices"] = [self.whole_choice(c) for c in sorted(choices, key=lambda c: c["index"])]
        body["usage"] = usage_body
        return body


class ChatRenderer(Renderer):
    """``/v1/chat/completions``: assistant messages and deltas (the first delta carries the role),
    tool calls beside the content, logprobs with token bytes."""

    kind = ApiKind.CHAT
    id_prefix = "chatcmpl-"
    path = "/v1/chat/completions"
    operation = "chat"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def logprobs(self, tokens: LogprobFormatter, lps: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
        def entry(tid: int, lp: float) -> dict[str, Any]:
            tok = tokens.token(tid)
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}

    def stream_choice(self, index: int, text: str, *, first: bool, finish_reason: str | None,
                      logprobs: dict[str, Any] | None, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if tool_calls:
            delta["tool_calls"] = tool_calls
            if not text:
                delta["content"] = None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def whole_choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice["text"]}
        if choice.get("tool_calls"):
            message["tool_calls"] = choice["tool_calls"]
        return {"index": choice["index"], "message": message, "logprobs": choice.get("logprobs"),
                "finish_reason": choice["finish_reason"]}


class CompletionRenderer(Renderer):
    """``/v1/completions``: choices carry ``text`` (with the prompt in front when echoed), and
    logprobs have the legacy shape (tokens, token_logprobs, top_logprobs, text_offset)."""

    kind = ApiKind.COMPLETION
    id_prefix = "cmpl-"
    path = "/v1/completions"
    operation = "text_completion"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def logprobs(self, tokens: LogprobFormatter, lps: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
        strs, offsets, top = [], [], []
        for lp in lps:
            tok = tokens.token(lp.token_id)
            strs.append(tok)
            offsets.append(text_offset)
            text_offset += len(tok)
            # Without alternatives asked, the entry still names the sampled token (as vLLM does):
            # the client's Completion model types it as a dict, never null.
            top.append({tokens.token(t): v for t, v in lp.top} if lp.top else {tok: lp.logprob})
        return {"tokens": strs, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": top,
                "text_offset": offsets}

    def stream_choice(self, index: int, text: str, *, first: bool, finish_reason: str | None,
                      logprobs: dict[str, Any] | None, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def whole_choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {"index": choice["index"], "text": choice["text"], "logprobs": choice.get("logprobs"),
                "finish_reason": choice["finish_reason"]}


CHAT = ChatRenderer()
COMPLETION = CompletionRenderer()
_RENDERERS: dict[ApiKind, Renderer] = {CHAT.kind: CHAT, COMPLETION.kind: COMPLETION}


def renderer(kind: str) -> Renderer:
    """The renderer of ``kind`` (an :class:`ApiKind`, or its name: a ``str`` enum hashes as one)."""
    return _RENDERERS[kind]


def server_timing_header(timings_ms: dict[str, float]) -> str:
    """RFC ``Server-Timing`` header value: ``prep;dur=1.2, queue;dur=0.0, ...``."""
    return ", ".join(f"{name};dur={value:.2f}" for name, value in timings_ms.items())
