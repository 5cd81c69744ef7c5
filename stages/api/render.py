"""OpenAI response objects (chat and text completions, streamed and not) and SSE framing.

Pure functions over plain data, shared by Egress (content chunks) and Ingress (final timing
chunk, errors). Shapes follow the OpenAI API so the official client parses them unmodified.
"""

from __future__ import annotations

import json
from typing import Any

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
    """Renders token logprobs; token strings come from the tokenizer (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text

    def chat(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        """``choices[].logprobs`` of a chat completion."""
        def entry(tid: int, lp: float) -> dict[str, Any]:
            tok = self.token(tid)
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}

    def completion(self, lps: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
        """``choices[].logprobs`` of a text completion (legacy shape)."""
        tokens, offsets, top = [], [], []
        for lp in lps:
            tok = self.token(lp.token_id)
            tokens.append(tok)
            offsets.append(text_offset)
            text_offset += len(tok)
            # Without alternatives asked, the entry still names the sampled token (as vLLM does):
            # the client's Completion model types it as a dict, never null.
            top.append({self.token(t): v for t, v in lp.top} if lp.top else {tok: lp.logprob})
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": top,
                "text_offset": offsets}


# -- responses --------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _envelope(kind: str, response_id: str, created: int, model: str, streamed: bool) -> dict[str, Any]:
    if kind == "chat":
        obj = "chat.completion.chunk" if streamed else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": model}


def stream_chunk(kind: str, response_id: str, created: int, model: str, index: int, text: str, *,
                 first: bool = False, finish_reason: str | None = None,
                 logprobs: dict[str, Any] | None = None,
                 tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One streamed choice delta. The first chat delta carries the role; ``tool_calls`` are whole
    calls (``index``, ``id``, ``type``, ``function.name`` and all of ``function.arguments``)."""
    body = _envelope(kind, response_id, created, model, streamed=True)
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if tool_calls:
            delta["tool_calls"] = tool_calls
            if not text:
                delta["content"] = None
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    body["choices"] = [choice]
    return body


def final_stream_chunk(kind: str, response_id: str, created: int, model: str,
                       usage_body: dict[str, Any] | None, timings_ms: dict[str, float] | None) -> dict[str, Any]:
    """The closing chunk: no choices, the usage when asked, and the server timings."""
    body = _envelope(kind, response_id, created, model, streamed=True)
    body["choices"] = []
    body["usage"] = usage_body
    if timings_ms is not None:
        body[TIMING_FIELD] = timings_ms
    return body


def full_response(kind: str, response_id: str, created: int, model: str,
                  choices: list[dict[str, Any]], usage_body: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed response. ``choices`` items: index, text, finish_reason, logprobs."""
    body = _envelope(kind, response_id, created, model, streamed=False)
    out = []
    for c in sorted(choices, key=lambda c: c["index"]):
        if kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": c["text"]}
            if c.get("tool_calls"):
                message["tool_calls"] = c["tool_calls"]
            out.append({"index": c["index"], "message": message,
                        "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]})
        else:
            out.append({"index": c["index"], "text": c["text"], "logprobs": c.get("logprobs"),
                        "finish_reason": c["finish_reason"]})
    body["choices"] = out
    body["usage"] = usage_body
    return body


def server_timing_header(timings_ms: dict[str, float]) -> str:
    """RFC ``Server-Timing`` header value: ``prep;dur=1.2, queue;dur=0.0, ...``."""
    return ", ".join(f"{name};dur={value:.2f}" for name, value in timings_ms.items())
