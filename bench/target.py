"""The server under test, as any OpenAI-compatible client sees it, and one timed streamed request.

``Target.probe`` finds the model and which of this server's extras the URL offers (``/tokenize``, ours or
llama.cpp's, ``/metrics``, ``server_timing`` in the final chunk, the ``Server-Timing`` header); each
subcommand falls back, or says what it skips, when one is missing. ``stream_chat`` times every SSE event on
arrival and takes the token count from the server's ``usage``, never from the events.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

#: Filler words that are one token each for SmolLM2's tokenizer (and most BPE vocabularies), so a
#: prompt grows by one token per word; ``/tokenize`` confirms the exact count anyway.
FILLER = (" the cat sat on a mat and the dog ran to the park with a red ball while it was sunny in the"
          " town by the sea").split(" ")[1:]


@dataclass
class Target:
    """An OpenAI-compatible base URL (without ``/v1``) and what it supports."""

    url: str
    model: str = ""
    max_model_len: int | None = None
    server_version: str | None = None
    has_tokenize: bool = False
    #: How ``/tokenize`` counts a chat prompt: "messages" (``{model, messages}`` → ``count``: this server,
    #: vLLM) or "llama.cpp" (``/apply-template`` renders the messages, ``/tokenize {content}`` → ``tokens``).
    tokenize_api: str | None = None
    has_metrics: bool = False
    has_server_timing: bool = False
    has_server_timing_header: bool = False
    notes: list[str] = field(default_factory=list)

    def client(self, concurrency: int = 64, timeout: float = 900) -> httpx.AsyncClient:
        n = max(8, concurrency + 8)
        return httpx.AsyncClient(base_url=self.url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    def skip(self, what: str) -> None:
        """Say plainly what a subcommand leaves out for this server, and record it."""
        self.notes.append(what)
        print(f"[bench] {self.url}: {what}", flush=True)


async def probe(url: str, model: str | None = None) -> Target:
    """Ask the server what it is: model, context length, version, extras."""
    t = Target(url=url.rstrip("/").removesuffix("/v1"))
    async with t.client(4, timeout=60) as c:
        r = await c.get("/v1/models")
        r.raise_for_status()
        models = r.json().get("data", [])
        entry = next((m for m in models if m.get("id") == model), models[0] if models else {})
        t.model = model or entry.get("id", "")
        mml = entry.get("max_model_len") or (entry.get("meta") or {}).get("n_ctx_train")
        t.max_model_len = int(mml) if mml else None
        for path in ("/version", "/props"):
            try:
                v = await c.get(path)
                if v.status_code == 200:
                    body = v.json()
                    t.server_version = str(body.get("version") or body.get("build_info") or body)[:200]
                    if path == "/props" and not t.max_model_len:
                        n_ctx = (body.get("default_generation_settings") or {}).get("n_ctx")
                        t.max_model_len = int(n_ctx) if n_ctx else None
                    break
            except (httpx.HTTPError, ValueError):
                pass
        t.tokenize_api = await _tokenize_api(c, t)
        t.has_tokenize = t.tokenize_api is not None
        try:
            r = await c.get("/metrics")
            t.has_metrics = r.status_code == 200 and "# TYPE" in r.text
        except httpx.HTTPError:
            pass
        r = await c.post("/v1/chat/completions", json={
            "model": t.model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2})
        r.raise_for_status()
        t.has_server_timing = isinstance(r.json().get("server_timing"), dict)
        t.has_server_timing_header = "server-timing" in r.headers
    return t


async def _tokenize_api(client: httpx.AsyncClient, t: Target) -> str | None:
    """The first ``/tokenize`` dialect that counts a one-message chat prompt as a positive number of
    tokens (llama.cpp answers our dialect with an empty ``tokens`` list, hence the check), or None."""
    for api in ("messages", "llama.cpp"):
        try:
            if await count_chat_tokens(client, Target(t.url, t.model, tokenize_api=api),
                                       [{"role": "user", "content": "hi"}]) > 0:
                return api
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass
    return None


async def count_chat_tokens(client: httpx.AsyncClient, t: Target, messages: list[dict[str, Any]]) -> int:
    """Tokens of ``messages`` rendered by the server's own chat template and tokenizer: the prompt length
    its ``usage.prompt_tokens`` will report. llama.cpp's count adds the special tokens its chat path adds."""
    if t.tokenize_api == "llama.cpp":
        r = await client.post("/apply-template", json={"messages": messages})
        r.raise_for_status()
        r = await client.post("/tokenize", json={"content": r.json()["prompt"], "add_special": True})
        r.raise_for_status()
        return len(r.json()["tokens"])
    r = await client.post("/tokenize", json={"model": t.model, "messages": messages})
    r.raise_for_status()
    count = r.json()["count"]
    if not isinstance(count, int):
        raise TypeError(f"/tokenize count is {count!r}")
    return count


@dataclass
class StreamRecord:
    """One streamed request as the client saw it. Times in seconds from sending the request."""

    ttft: float = float("nan")
    e2e: float = float("nan")
    #: Arrival time of every SSE event that carried content (one event may carry several tokens).
    event_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    server_timing: dict[str, float] | None = None
    #: Where ``server_timing`` came from: "server_timing" (this server) or "llama.cpp timings" (prefill
    #: = prompt_ms, decode = predicted_ms; no queue term).
    timing_source: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    #: perf_counter() at which the request was sent (to line up requests of one run).
    t_sent: float = 0.0
    #: The reply's content text (reasoning excluded): what a multi-turn client sends back as history.
    text: str = ""
    #: ``usage.prompt_tokens_details.cached_tokens`` when the server reports it.
    cached_tokens: int | None = None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.event_times, self.event_times[1:], strict=False)]

    @property
    def tpot(self) -> float:
        """(end-to-end − TTFT) / (tokens − 1), tokens from ``usage``."""
        n = self.completion_tokens or 0
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else float("nan")

    @property
    def tokens_per_event(self) -> float:
        return (self.completion_tokens or 0) / len(self.event_times) if self.event_times else float("nan")

    def summary(self) -> dict[str, Any]:
        """The per-request numbers a result file keeps (not the raw event times)."""
        return {"ttft_s": self.ttft, "e2e_s": self.e2e, "tpot_s": self.tpot, "events": len(self.event_times),
                "tokens_per_event": self.tokens_per_event, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "server_timing": self.server_timing,
                "timing_source": self.timing_source,
                "finish_reason": self.finish_reason, "error": self.error}


def chat_body(model: str, content: str, max_tokens: int, ignore_eos: bool = True) -> dict[str, Any]:
    """Greedy chat request, streamed, with usage in the final chunk."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any], path: str = "/v1/chat/completions",
                      base: str | None = None, rec: StreamRecord | None = None) -> StreamRecord:
    """POST a streamed request and time each event's arrival. Errors are recorded, not raised;
    cancellation (a dropped client) propagates and closes the connection. Pass ``rec`` to watch
    the record fill while the stream runs."""
    rec = rec if rec is not None else StreamRecord()
    t0 = rec.t_sent = time.perf_counter()
    url = (base or "") + path
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                rec.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                chunk = json.loads(data)
                _absorb(rec, chunk, now)
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.e2e = time.perf_counter() - t0
    if not rec.event_times and rec.error is None:
        rec.error = "no content events"
    return rec


def _absorb(rec: StreamRecord, chunk: dict[str, Any], now: float) -> None:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        content = delta.get("content") or choice.get("text")
        if content:
            rec.text += content
        text = content or delta.get("reasoning_content")
        if text:
            if not rec.event_times:
                rec.ttft = now
            rec.event_times.append(now)
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.completion_tokens = usage.get("completion_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        rec.cached_tokens = int(cached) if cached is not None else rec.cached_tokens
    if isinstance(chunk.get("server_timing"), dict):
        rec.server_timing = {k: float(v) for k, v in chunk["server_timing"].items()}
        rec.timing_source = "server_timing"
    elif isinstance(chunk.get("timings"), dict) and rec.timing_source != "server_timing":
        t = chunk["timings"]
        rec.server_timing = {"prefill": float(t.get("prompt_ms", float("nan"))),
                             "decode": float(t.get("predicted_ms", float("nan")))}
        rec.timing_source = "llama.cpp timings"


def nonce() -> str:
    """A short unique prefix so no two prompts share cached KV beyond the chat template."""
    return uuid.uuid4().hex[:8]


def filler(n_words: int, tag: str) -> str:
    words = [FILLER[i % len(FILLER)] for i in range(max(0, n_words))]
    return f"{tag}: " + " ".join(words)


async def exact_prompt(client: httpx.AsyncClient, t: Target, tokens: int, tag: str | None = None) -> tuple[str, int | None]:
    """A chat message whose rendered prompt is ``tokens`` long, counted by ``/tokenize``.

    Without ``/tokenize`` the prompt is sized by the filler's one-token-per-word assumption and the
    count returned is None (the request's ``usage`` gives the truth afterwards)."""
    tag = tag or nonce()
    if not t.has_tokenize:
        return filler(max(1, tokens - 40), tag), None

    async def count(n_words: int) -> int:
        return await count_chat_tokens(client, t, [{"role": "user", "content": filler(n_words, tag)}])

    base = await count(0)
    words = max(0, tokens - base)
    for _ in range(6):
        got = await count(words)
        if got == tokens:
            return filler(words, tag), got
        words = max(0, words + (tokens - got))
    got = await count(words)
    return filler(words, tag), got


async def gather_limited(coros: list[Any], limit: int, progress: Any = None) -> list[Any]:
    """Run coroutines with at most ``limit`` in flight, in order of the list."""
    sem = asyncio.Semaphore(limit)

    async def run(c: Any) -> Any:
        async with sem:
            out = await c
        if progress is not None:
            progress.update(1)
        return out

    return await asyncio.gather(*[run(c) for c in coros])
