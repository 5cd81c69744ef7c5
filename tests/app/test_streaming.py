"""SSE on the wire, read with raw httpx against the real app: framing and headers, event ids,
heartbeats while a request waits in the engine queue, ``X-Request-Id`` handling, and the two
detokenisation hazards of streaming: a stop string split across tokens and a character whose UTF-8
bytes are split across tokens."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from stages.model_info import load_tokenizer
from tests.app.test_cancellation import LongStreams, poll_stats, wait_idle
from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.serve

TIMING_KEYS = {"prep", "queue", "prefill", "decode", "egress", "total"}
#: A stream's closing chunk also splits its TTFT (``ttft``) into measured hops and first flush.
STREAM_TIMING_KEYS = TIMING_KEYS | {"hops", "first_flush", "ttft"}
CHAT = [{"role": "user", "content": "Say hello in one short sentence."}]


@dataclass
class SSE:
    """One parsed SSE stream: events in arrival order (comments included) and their timestamps."""

    status: int
    headers: httpx.Headers
    #: ("comment", text) or ("event", {"id": str | None, "data": str}), in order.
    items: list[tuple[str, Any]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    body: bytes = b""

    @property
    def events(self) -> list[dict[str, Any]]:
        return [v for k, v in self.items if k == "event"]

    @property
    def chunks(self) -> list[dict[str, Any]]:
        """JSON payloads of the data events (``[DONE]`` excluded)."""
        return [json.loads(e["data"]) for e in self.events if e["data"] != "[DONE]"]

    def content_chunks(self) -> list[dict[str, Any]]:
        return [c for c in self.chunks if c.get("choices")]


def parse_sse_lines(lines: Any, sse: SSE, on_item: Any = None) -> SSE:
    """Minimal SSE parser (one ``data:`` line per event, as the server writes)."""
    t0 = time.perf_counter()
    current: dict[str, Any] = {}
    for line in lines:
        now = time.perf_counter() - t0
        if line.startswith(":"):
            sse.items.append(("comment", line[1:].strip()))
            sse.times.append(now)
        elif line.startswith("id:"):
            current["id"] = line[3:].strip()
        elif line.startswith("data:"):
            current["data"] = line[5:].strip()
        elif line == "":
            if current:
                current.setdefault("id", None)
                sse.items.append(("event", current))
                sse.times.append(now)
                current = {}
        else:
            raise AssertionError(f"unexpected SSE line {line!r}")
        if on_item is not None and sse.items:
            on_item(sse)
    assert not current, f"stream ended inside an event: {current}"
    return sse


def stream_sse(url: str, path: str, body: dict[str, Any], headers: dict[str, Any] | None = None,
               on_item: Any = None, timeout: float = 120.0) -> SSE:
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=timeout) as resp:
        sse = SSE(resp.status_code, resp.headers)
        if resp.status_code != 200:
            sse.body = resp.read()
            return sse
        return parse_sse_lines(resp.iter_lines(), sse, on_item)


def streamed_text(sse: SSE, kind: str) -> str:
    out = []
    for c in sse.content_chunks():
        for ch in c["choices"]:
            out.append((ch["delta"].get("content") or "") if kind == "chat" else ch["text"])
    return "".join(out)


# -- framing ------------------------------------------------------------------------------------------------
def check_framing(sse: SSE, kind: str, include_usage: bool) -> None:
    assert sse.status == 200, sse.body
    assert sse.headers["content-type"].startswith("text/event-stream")
    assert sse.headers["cache-control"] == "no-cache"
    assert sse.headers["x-accel-buffering"] == "no"
    events = sse.events
    assert events[-1]["data"] == "[DONE]"
    assert sum(e["data"] == "[DONE]" for e in events) == 1
    content = [e for e in events if e["data"] != "[DONE]" and json.loads(e["data"]).get("choices")]
    # Every event (content, closing chunk and [DONE]) carries an id; ids count up from 0 without gaps.
    ids = [e["id"] for e in events]
    assert all(i is not None for i in ids), ids
    assert [int(i) for i in ids] == list(range(len(ids)))
    chunks = [json.loads(e["data"]) for e in content]
    assert len(chunks) >= 2
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    assert {c["object"] for c in chunks} == {obj}
    assert len({c["id"] for c in chunks}) == 1 and {c["model"] for c in chunks} == {MODEL_NAME}
    if kind == "chat":
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1]), finishes
    # The closing chunk: after the last content chunk, no choices, timings, usage when asked.
    final = json.loads(events[-2]["data"])
    assert final["choices"] == [] and final["id"] == chunks[0]["id"]
    assert set(final["server_timing"]) == STREAM_TIMING_KEYS
    assert all(v >= 0 for v in final["server_timing"].values())
    if include_usage:
        u = final["usage"]
        assert u["prompt_tokens"] > 0 and u["completion_tokens"] > 0
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    else:
        assert final.get("usage") is None
    assert all(c.get("usage") is None for c in chunks)


def test_sse_framing_chat_with_usage(serve_app: Any) -> None:
    sse = stream_sse(serve_app.url, "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": CHAT, "max_tokens": 12, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    check_framing(sse, "chat", include_usage=True)
    final = sse.chunks[-1]
    body = httpx.post(serve_app.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL_NAME, "messages": CHAT, "max_tokens": 12, "temperature": 0}).json()
    assert streamed_text(sse, "chat") == body["choices"][0]["message"]["content"]
    assert final["usage"]["completion_tokens"] == body["usage"]["completion_tokens"]
    assert final["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"]


def test_sse_framing_completion_without_usage(serve_app: Any) -> None:
    sse = stream_sse(serve_app.url, "/v1/completions", {
        "model": MODEL_NAME, "prompt": "Three facts about the moon:", "max_tokens": 10, "temperature": 0,
        "ignore_eos": True, "stream": True})
    check_framing(sse, "completion", include_usage=False)
    assert sse.content_chunks()[-1]["choices"][0]["finish_reason"] == "length"


# -- heartbeats -------------------------------------------------------------------------------------------
def test_keepalive_comments_while_waiting_in_the_queue(serve_app: Any) -> None:
    """All 8 running slots busy: the 9th stream waits, and its connection gets ``: keep-alive``
    comments (every keepalive_interval_s = 0.5 s) before its first token."""
    wait_idle(serve_app)
    interval = serve_app.args["http"]["keepalive_interval_s"]
    slots = serve_app.args["engine"]["max_num_seqs"]
    with LongStreams(serve_app.url, slots, max_tokens=150) as load:
        load.start()
        load.wait("first_token")
        poll_stats(serve_app, lambda s: s["num_running"] == slots, timeout=30)
        released = threading.Event()

        def on_item(sse: SSE) -> None:
            # After two heartbeats, free the slots so the queued request can run.
            if not released.is_set() and sum(k == "comment" for k, _ in sse.items) >= 2:
                released.set()
                threading.Thread(target=load.cancel, args=(range(slots),), daemon=True).start()

        t0 = time.perf_counter()
        sse = stream_sse(serve_app.url, "/v1/completions", {
            "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True}, on_item=on_item)
        print(f"\nqueued stream done in {time.perf_counter() - t0:.2f} s")
    assert sse.status == 200, sse.body
    first_text = next(i for i, (k, v) in enumerate(sse.items)
                      if k == "event" and v["data"] != "[DONE]" and any(
                          c["text"] for c in json.loads(v["data"])["choices"]))
    comments = [i for i, (k, v) in enumerate(sse.items) if k == "comment"]
    assert comments and comments[0] < first_text, sse.items[:6]
    assert all(sse.items[i][1] == "keep-alive" for i in comments)
    gaps = [b - a for a, b in zip(sse.times[:first_text], sse.times[1:first_text + 1], strict=False)]
    print(f"heartbeats before the first token: {len(comments)}; gaps {[round(g, 2) for g in gaps]} "
          f"(interval {interval} s)")
    check_framing(sse, "completion", include_usage=False)
    assert_idle_no_leaks(serve_app)


def assert_idle_no_leaks(serve_app: Any) -> None:
    stats = wait_idle(serve_app)
    assert stats["num_free_blocks"] == stats["num_kv_blocks"], stats


# -- X-Request-Id -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_client_request_id_is_echoed(serve_app: Any, stream: bool) -> None:
    rid = f"client-id-{'s' if stream else 'u'}-{time.time_ns()}"
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 3, "stream": stream}
    with httpx.stream("POST", serve_app.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"X-Request-Id": rid}) as resp:
        assert resp.status_code == 200
        assert resp.headers.get_list("x-request-id") == [rid]
        server_id = resp.headers["x-server-request-id"]
        text = resp.read().decode()
    # The response id is the server-minted id; the client's id is only a label.
    assert f'"id":"chatcmpl-{server_id}"' in text.replace(" ", "") and rid not in text


def test_request_id_is_minted_when_absent(serve_app: Any) -> None:
    ids = []
    for _ in range(2):
        resp = httpx.post(serve_app.url + "/v1/completions", timeout=120,
                          json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
        assert resp.status_code == 200
        assert resp.headers.get("x-request-id")  # Serve's proxy mints one for the client's logs
        rid = resp.headers["x-server-request-id"]
        assert len(rid) == 32, rid
        assert resp.json()["id"] == "cmpl-" + rid
        ids.append(rid)
    assert ids[0] != ids[1]


BAD_IDS = {
    "129 chars": "r" * 129,
    "200 chars": "r" * 200,
    "non-ascii": "caf\u00e9-id".encode(),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("bad", list(BAD_IDS), ids=list(BAD_IDS))
def test_invalid_request_id_is_rejected(serve_app: Any, bad: str, stream: bool) -> None:
    resp = httpx.post(serve_app.url + "/v1/chat/completions", timeout=60, headers={"X-Request-Id": BAD_IDS[bad]},
                      json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2, "stream": stream})
    assert resp.status_code == 400, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == "X-Request-Id"
    assert "X-Request-Id" in err["message"]


def test_control_char_request_id_never_reaches_generation(serve_app: Any) -> None:
    """httpx sends a raw control byte when given bytes; the HTTP layer (or we) must refuse it."""
    resp = httpx.post(serve_app.url + "/v1/completions", timeout=60, headers={"X-Request-Id": b"ab\x01cd"},
                      json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    assert resp.status_code == 400
    assert '"text_completion"' not in resp.text


def test_duplicate_live_client_id_gets_distinct_server_ids(serve_app: Any) -> None:
    """Two overlapping streams sent with the same client id: both complete, each under its own
    server-minted id, and X-Request-Id keeps exactly the value the client sent."""
    rid = f"dup-{time.time_ns()}"
    body = {"model": MODEL_NAME, "prompt": "Count slowly:", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True}

    def response_ids(lines: Any) -> list[str]:
        return [json.loads(line[6:])["id"] for line in lines
                if line.startswith("data: {") and json.loads(line[6:])["choices"]]

    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=120))
        r1 = stack.enter_context(client.stream("POST", serve_app.url + "/v1/completions", json=body,
                                               headers={"X-Request-Id": rid}))
        lines1 = r1.iter_lines()
        first = next(line for line in lines1 if line.startswith("data: {"))  # now live in the server
        r2 = stack.enter_context(client.stream("POST", serve_app.url + "/v1/completions", json=body,
                                               headers={"X-Request-Id": rid}))
        ids = response_ids([first, *lines1]) + response_ids(r2.iter_lines())
        headers = [r1.headers, r2.headers]
    assert [h.get_list("x-request-id") for h in headers] == [[rid], [rid]]
    server_ids = [h["x-server-request-id"] for h in headers]
    assert sorted(set(ids)) == sorted(f"cmpl-{sid}" for sid in server_ids) and len(set(server_ids)) == 2


# -- detokenisation hazards -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("embedded:smollm2-135m-instruct")


def _completion(url: str, **body: Any) -> dict[str, Any]:
    resp = httpx.post(url + "/v1/completions", timeout=120, json={"model": MODEL_NAME, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


STOP_PROMPTS = ["The history of the Roman Empire", "A list of famous scientists:",
                "The largest cities in Europe are", "My favourite programming languages are"]


def _split_word(tokens: list[str], text: str, tokenizer: Any) -> str | None:
    """A word the model wrote as >= 2 tokens (a piece with a leading space, then a glued piece),
    whose first occurrence in ``text`` is that one, not at the very start."""
    offset = 0
    for i in range(len(tokens) - 1):
        a, b = tokens[i], tokens[i + 1]
        start = offset
        offset += len(a)
        if not (a.startswith(" ") and a[1:].isalpha() and b.isalpha()):
            continue
        word = a[1:] + b
        pos = start + 1
        if pos > 1 and text.find(word) == pos and len(tokenizer.encode(word, add_special_tokens=False)) >= 2:
            return word
    return None


def test_stop_string_split_across_tokens_is_never_leaked(serve_app: Any, tokenizer: Any) -> None:
    for prompt in STOP_PROMPTS:
        base = _completion(serve_app.url, prompt=prompt, max_tokens=32, logprobs=0)["choices"][0]
        tokens = base["logprobs"]["tokens"]
        assert "".join(tokens) == base["text"]
        stop = _split_word(tokens, base["text"], tokenizer)
        if stop is not None:
            break
    else:
        pytest.fail("no prompt made the model write a word across two tokens")
    expected = base["text"][: base["text"].find(stop)]
    print(f"\nprompt {prompt!r}: stop {stop!r} = {tokenizer.tokenize(stop)}; expected {expected!r}")
    sse = stream_sse(serve_app.url, "/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0, "stop": stop, "stream": True})
    check_framing(sse, "completion", include_usage=False)
    deltas = [c["choices"][0]["text"] for c in sse.content_chunks()]
    assert "".join(deltas) == expected
    assert sse.content_chunks()[-1]["choices"][0]["finish_reason"] == "stop"
    # Nothing of the stop string went out, not even its first token's piece: a streamed prefix would
    # make the text longer than ``expected``; check each delta too, for a clearer failure.
    emitted = ""
    for d in deltas:
        emitted += d
        assert expected.startswith(emitted), (d, deltas)
    # Also as a list with a stop string that never occurs.
    sse = stream_sse(serve_app.url, "/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0,
        "stop": ["@@never@@", stop], "stream": True})
    assert streamed_text(sse, "completion") == expected


#: Tried in order until one qualifies (at least two are always checked: the CJK one ends mid-character
#: at max_tokens, which exercises the lossy final flush).
MULTIBYTE_PROMPTS = ["Emoji: \U0001f431\U0001f436\U0001f42d\U0001f439\U0001f430",
                     "\u4e2d\u6587\uff1a\u4f60\u597d\u4e16\u754c\uff0c\u4eca\u5929",
                     "Smileys: \U0001f600\U0001f603\U0001f604\U0001f601",
                     "\u65e5\u672c\u8a9e\uff1a\u3053\u3093\u306b\u3061\u306f"]


def test_multibyte_characters_split_across_tokens(serve_app: Any, tokenizer: Any) -> None:
    qualified = []
    for n, prompt in enumerate(MULTIBYTE_PROMPTS):
        if qualified and n >= 2:
            break
        body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True}
        full = _completion(serve_app.url, logprobs=0, **body)["choices"][0]
        text = full["text"]
        sse = stream_sse(serve_app.url, "/v1/completions", {"model": MODEL_NAME, "temperature": 0, "stream": True,
                                                             **body})
        check_framing(sse, "completion", include_usage=False)
        deltas = [c["choices"][0]["text"] for c in sse.content_chunks()]
        assert "".join(deltas) == text, prompt
        if "\ufffd" not in text:
            assert not any("\ufffd" in d for d in deltas), (prompt, deltas)
        else:
            # Only the final flush may carry a lossy tail (generation cut mid-character).
            assert not any("\ufffd" in d for d in deltas[:-1]), (prompt, deltas)
        # The model's own tokens: a piece that is not valid UTF-8 alone decodes to U+FFFD.
        partial_tokens = sum("\ufffd" in t for t in full["logprobs"]["tokens"])
        split_chars = [ch for ch in set(text) if len(ch.encode()) > 1 and ch != "\ufffd"
                       and len(tokenizer.encode(ch, add_special_tokens=False)) > 1]
        print(f"\n{prompt!r} -> {text!r}: {partial_tokens} partial tokens, split chars {split_chars}")
        if partial_tokens and split_chars and "\ufffd" not in text:
            qualified.append(prompt)
    assert qualified, "no prompt produced a complete character spread over several tokens"
    assert_idle_no_leaks(serve_app)


# -- n > 1 with stop strings --------------------------------------------------------------------------------
def _choice_texts(serve_app: Any, n: int, **extra: Any) -> tuple[int, dict[int, str], dict[int, str], list[str]]:
    """Run a seeded n-choice completion; returns status, text and finish reason per choice, and the
    raw SSE data lines when streamed."""
    body = {"model": MODEL_NAME, "prompt": "Write a list of animals and colours:", "max_tokens": 24, "n": n,
            "temperature": 1.0, "seed": 7, "ignore_eos": True, **extra}
    r = httpx.post(serve_app.url + "/v1/completions", json=body, timeout=180)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    lines: list[str] = []
    if body.get("stream"):
        lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        for data in lines[:-1]:
            for c in json.loads(data)["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["finish_reason"]:
                    assert c["index"] not in finishes, f"choice {c['index']} finished twice"
                    finishes[c["index"]] = c["finish_reason"]
    elif r.status_code == 200:
        for c in r.json()["choices"]:
            texts[c["index"]], finishes[c["index"]] = c["text"], c["finish_reason"]
    return r.status_code, texts, finishes, lines


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("stream", [True, False])
def test_stop_string_in_one_choice_ends_only_that_choice(serve_app: Any, n: int, stream: bool) -> None:
    status, free, _, _ = _choice_texts(serve_app, n)
    assert status == 200 and len(free) == n
    # A word that choice 0 writes (not at its very start) and no other choice writes at all.
    words = [w for w in re.findall(r"[A-Za-z]{3,}", free[0]) if free[0].find(w) > 0
             and not any(w in free[i] for i in range(1, n))]
    if not words:
        pytest.skip(f"the seeded choices share every word: {free}")
    stop = words[0]
    status, texts, finishes, lines = _choice_texts(serve_app, n, stop=[stop], stream=stream)
    assert status == 200
    assert finishes[0] == "stop" and texts[0] == free[0][: free[0].find(stop)]
    for i in range(1, n):  # the others run to their length, unaffected
        assert finishes[i] == "length" and texts[i] == free[i]
    if stream:
        assert lines[-1] == "[DONE]" and set(finishes) == set(range(n))
    wait_idle(serve_app)


# -- the shared channels between the stages (stages/transport/channel.py) ----------------------------------------
def test_concurrent_streams_share_one_engine_channel_and_each_gets_its_own_tokens(serve_app: Any) -> None:
    """Six streams at once: each gets exactly the text it gets alone (no token reaches another
    request), while the engine sent them through one channel, several requests per item; once idle
    the engine keeps no mailbox and nothing pending."""
    prompts = [f"Count from {i} to {i + 20}, separated by commas:" for i in range(6)]
    body = {"model": MODEL_NAME, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    before = wait_idle(serve_app)
    results: dict[int, SSE] = {}

    def one(i: int) -> None:
        results[i] = stream_sse(serve_app.url, "/v1/completions", {**body, "prompt": prompts[i], "stream": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    # Egress's autoscaling subtracts its open channel attaches (Serve counts them as requests):
    # while the streams run, the one Ingress replica's attach is open on it, and only that one.
    attached = set()
    while any(t.is_alive() for t in threads):
        attached.add(serve_app.call("Egress", "record_autoscaling_stats")["channel_attaches"])
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=120)
    assert 1.0 in attached and max(attached) == 1.0, attached
    during = serve_app.engine_stats()
    batches = during["channel_batches"] - before["channel_batches"]
    items = during["channel_items"] - before["channel_items"]
    for i, prompt in enumerate(prompts):
        sse = results[i]
        check_framing(sse, "completion", include_usage=False)
        alone = httpx.post(serve_app.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=120).json()
        assert streamed_text(sse, "completion") == alone["choices"][0]["text"], f"stream {i} got other tokens"
    # Each stream's 24 tokens came through the channel (its first item may ride on its own stream).
    assert items >= len(prompts) * 20, (items, batches)
    assert items / batches > 1.5, f"the channel carried {items} outputs in {batches} items: not shared"
    deadline = time.monotonic() + 10
    while (stats := serve_app.engine_stats())["channel_mailboxes"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats["channel_mailboxes"] == 0 and stats["channel_pending"] == 0, stats
    while serve_app.call("Egress", "record_autoscaling_stats")["channel_attaches"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert serve_app.call("Egress", "record_autoscaling_stats")["channel_attaches"] == 0.0, "an attach outlived its linger"
