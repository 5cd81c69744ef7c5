"""Hypothesis fuzzing of SSE framing, end to end in-process: random token ids (stray bytes of
multi-byte characters, special tokens, any split into engine items) go through Egress
(detokenise, chunk, frame) and Ingress's SSE response (heartbeats, closing chunk, ``[DONE]``); the
bytes are cut at random points (inside UTF-8 sequences too) and parsed back with the official
``openai`` client's own SSE decoder. Nothing raises, every event parses, ids count up, and each
choice's streamed text equals the one-shot decode of its ids."""

from __future__ import annotations

import asyncio
import functools
import json
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai._streaming import SSEDecoder

from stages.egress.egress import Egress, EngineStream
from stages.ingress.lifecycle import Lifecycle
from stages.ingress.sse import first_item, sse_response
from stages.model_info import EMBEDDED_MODEL, load_tokenizer
from stages.transport.messages import EngineOutput, EngineRequest, GenerationJob, SamplingParams

PROMPT = "Say something:"


@functools.cache
def tok() -> Any:
    return load_tokenizer(EMBEDDED_MODEL)


class Span:
    def add_event(self, *_: Any) -> None: ...
    def end(self) -> None: ...
    def set_attribute(self, *_: Any) -> None: ...
    def is_recording(self) -> bool:
        return False


class Gen:
    """An Egress stream as Ingress holds it (a Serve response generator: iterate, ``cancel()``)."""

    def __init__(self, items: Any) -> None:
        self.items = items
        self.cancelled = False

    def __aiter__(self) -> Gen:
        return self

    async def __anext__(self) -> Any:
        return await self.items.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


def _engine(choices: list[list[int]], rng: random.Random) -> Any:
    """Opens a stream that sends each choice's ids in random groups, interleaved, then finishes."""

    def open_(request: EngineRequest) -> EngineStream:
        ids = request.choice_ids()

        async def items() -> Any:
            yield [EngineOutput(ids[0], [], num_prompt_tokens=len(request.prompt_token_ids), replica="e1")]
            pos = [0] * len(choices)
            while any(p < len(c) for p, c in zip(pos, choices, strict=True)) or pos:
                outs = []
                for i, c in enumerate(choices):
                    if pos[i] < 0:
                        continue
                    k = rng.randint(0, 4)
                    new, pos[i] = c[pos[i]:pos[i] + k], pos[i] + k
                    done = pos[i] >= len(c)
                    outs.append(EngineOutput(ids[i], new, index=i, finish_reason="length" if done else None))
                    if done:
                        pos[i] = -1
                if all(p < 0 for p in pos):
                    pos = []
                if outs:
                    if rng.random() < 0.2:
                        await asyncio.sleep(0.003)  # a silence: the heartbeat goes out meanwhile
                    yield outs

        async def close() -> None: ...

        return EngineStream(items(), close)

    return open_


async def _render(choices: list[list[int]], kind: str, skip: bool, rng: random.Random) -> bytes:
    prompt_ids = tok().encode(PROMPT, add_special_tokens=False)
    n = len(choices)
    params = SamplingParams(max_tokens=100, skip_special_tokens=skip)
    job = GenerationJob(EngineRequest("r1", prompt_ids, params, n=n), kind, "m", "x-r1", 0, n=n, stream=True,
                        include_usage=True)
    gen = Gen(Egress(tok(), _engine(choices, rng)).stream(job))
    await first_item(gen)
    lifecycle = Lifecycle("ingress-test")
    live = lifecycle.open(kind, Span())
    response = sse_response(gen, job, live, lifecycle, lambda *_: {"total": 1.0}, keepalive_s=0.001)
    body: list[bytes] = []

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client never leaves
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    await response({"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/",
                    "headers": []}, receive, send)
    assert live.closed and live.outcome == "ok" and not gen.cancelled
    return b"".join(body)


def _cut(data: bytes, rng: random.Random) -> list[bytes]:
    """``data`` in random pieces, as TCP might deliver it (through multi-byte characters too)."""
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 12))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


# Ids biased towards the byte tokens (stray pieces of multi-byte UTF-8 characters) and specials.
_BYTE_PIECES = sorted({i for ch in "é你好😀👍🏽🇯🇵Ω" for i in tok().encode(ch, add_special_tokens=False)})
_ID = st.one_of(st.integers(0, 49151), st.sampled_from(_BYTE_PIECES), st.integers(0, 16))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(choices=st.lists(st.lists(_ID, max_size=30), min_size=1, max_size=3), kind=st.sampled_from(["chat", "completion"]),
       skip=st.booleans(), seed=st.integers(0, 2**32))
def test_streamed_text_equals_one_shot_decode(choices: list[list[int]], kind: str, skip: bool, seed: int) -> None:
    rng = random.Random(seed)
    data = asyncio.run(_render(choices, kind, skip, rng))
    events = list(SSEDecoder().iter_bytes(iter(_cut(data, rng))))
    assert events and events[-1].data == "[DONE]"
    assert [int(e.id) for e in events] == list(range(len(events)))  # numbered 0.. with no gaps
    texts = [""] * len(choices)
    finishes: list[tuple[int, str]] = []
    for event in events[:-2]:
        assert event.event is None
        chunk = json.loads(event.data)
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"]["content"] if kind == "chat" else choice["text"]
        if choice["finish_reason"]:
            finishes.append((choice["index"], choice["finish_reason"]))
    closing = json.loads(events[-2].data)
    assert closing["choices"] == [] and closing["usage"]["completion_tokens"] == sum(map(len, choices))
    prompt_ids = tok().encode(PROMPT, add_special_tokens=False)
    prefix = tok().decode(prompt_ids, skip_special_tokens=skip)
    for i, ids in enumerate(choices):
        whole = tok().decode(prompt_ids + ids, skip_special_tokens=skip)
        assert whole.startswith(prefix)
        assert texts[i] == whole[len(prefix):], (i, ids)
    assert sorted(finishes) == [(i, "length") for i in range(len(choices))]  # each choice ends once
    raw = data.decode("utf-8")  # the stream as a whole is valid UTF-8, whatever the ids were
    assert raw.endswith("data: [DONE]\n\n")
