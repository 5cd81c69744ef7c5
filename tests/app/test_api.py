"""The OpenAI-compatible API through the official ``openai`` client, against the real app."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.app.test_cancellation import wait_idle
from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.serve

CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]
PROMPT = "The history of the Roman Empire"
TIMING_KEYS = {"prep", "queue", "prefill", "decode", "egress", "total"}
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM"


@pytest.fixture(scope="module")
def client(serve_app: Any) -> OpenAI:
    return OpenAI(base_url=serve_app.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client: OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL_NAME, messages=kw.pop("messages", CHAT), **kw)


def complete(client: OpenAI, **kw: Any) -> Any:
    return client.completions.create(model=MODEL_NAME, prompt=kw.pop("prompt", PROMPT), **kw)


def collect(stream: Any, kind: str) -> tuple[str, str | None, Any, list[Any]]:
    """Text, finish reason and usage of a single-choice stream, plus all chunks."""
    chunks = list(stream)
    text, finish, usage = [], None, None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            text.append((ch.delta.content or "") if kind == "chat" else ch.text)
            finish = ch.finish_reason or finish
    return "".join(text), finish, usage, chunks


def check_usage(u: Any) -> None:
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


# -- basics ----------------------------------------------------------------------------------------------------
def test_chat_completion(client: OpenAI) -> None:
    r = chat(client, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL_NAME
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    check_usage(r.usage)
    assert r.usage.completion_tokens <= 16


def test_text_completion(client: OpenAI) -> None:
    r = complete(client, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL_NAME
    assert r.choices[0].text and r.choices[0].finish_reason == "length"
    check_usage(r.usage)
    assert r.usage.completion_tokens == 8


SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 1234}}


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_text_equals_non_streamed(client: OpenAI, kind: str, sampling: str) -> None:
    call = chat if kind == "chat" else complete
    params = {"max_tokens": 24, **SAMPLING[sampling]}
    full = call(client, **params)
    text, finish, usage, chunks = collect(
        call(client, stream=True, stream_options={"include_usage": True}, **params), kind)
    expected = full.choices[0].message.content if kind == "chat" else full.choices[0].text
    assert text == expected
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert len(chunks) >= 3


def _pick_stops(text: str) -> tuple[str, str]:
    """Two words of ``text`` that occur first after some text, the second after the first."""
    words = [w.strip(".,:;!?\"'") for w in text.split()]
    words = [w for w in words if len(w) >= 3 and text.find(w) > 0]
    assert len(words) >= 3, text
    first = words[len(words) // 3]
    later = [w for w in words if text.find(w) >= text.find(first) + len(first)]
    assert later, text
    return first, later[0]


def test_stop_string_and_list(client: OpenAI) -> None:
    base = complete(client, max_tokens=32, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    first, second = _pick_stops(base)
    # One string: text ends right before it.
    r = complete(client, max_tokens=32, temperature=0, stop=second, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.find(second)]
    assert second not in r.choices[0].text
    # A list: the earliest match wins, whatever the order in the list.
    r = complete(client, max_tokens=32, temperature=0, stop=["#never#", second, first],
                 extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.find(first)]
    # Chat, with the stop kept in the output on request.
    cbase = chat(client, max_tokens=32, temperature=0).choices[0].message.content
    _, cstop = _pick_stops(cbase)
    r = chat(client, max_tokens=32, temperature=0, stop=[cstop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == cbase[: cbase.find(cstop)]
    r = chat(client, max_tokens=32, temperature=0, stop=[cstop], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content == cbase[: cbase.find(cstop) + len(cstop)]


def test_seed_is_reproducible(client: OpenAI) -> None:
    def run(seed: int) -> str:
        return chat(client, max_tokens=16, temperature=0.9, seed=seed).choices[0].message.content

    a, b = run(7), run(7)
    assert a == b
    others = {run(8), run(9)}
    assert others != {a}, "different seeds gave the same sample: the seed is probably ignored"


# -- logprobs ---------------------------------------------------------------------------------------------------
def test_chat_logprobs_shape(client: OpenAI) -> None:
    r = chat(client, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == 3
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
    r = chat(client, max_tokens=3, temperature=0, logprobs=True)
    assert all(t.top_logprobs == [] for t in r.choices[0].logprobs.content)
    assert chat(client, max_tokens=3, temperature=0).choices[0].logprobs is None


def test_completion_logprobs_shape(client: OpenAI) -> None:
    r = complete(client, max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert n == 6
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for tok, lpv, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert lpv <= 0 and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(lpv) and tok in top


def test_streamed_logprobs_match_non_streamed(client: OpenAI) -> None:
    full = chat(client, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    chunks = list(chat(client, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in full.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in full.choices[0].logprobs.content])


# -- n ------------------------------------------------------------------------------------------------------------
def test_n_choices(client: OpenAI) -> None:
    r = chat(client, max_tokens=10, temperature=0, n=3, logprobs=True)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    texts = {c.message.content for c in r.choices}
    assert len(texts) == 1 and texts != {""}  # greedy: all three are the same
    per_choice = [len(c.logprobs.content) for c in r.choices]
    assert r.usage.completion_tokens == sum(per_choice)
    single = chat(client, max_tokens=10, temperature=0)
    assert texts == {single.choices[0].message.content}
    assert r.usage.prompt_tokens == single.usage.prompt_tokens


def test_n_choices_streamed(client: OpenAI) -> None:
    chunks = list(complete(client, max_tokens=6, temperature=0, n=3, stream=True,
                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    finish: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert set(texts) == {0, 1, 2} and finish == {0: "length", 1: "length", 2: "length"}
    assert len(set(texts.values())) == 1
    assert chunks[-1].usage.completion_tokens == 18


# -- usage and limits -------------------------------------------------------------------------------------------
def test_stream_include_usage(client: OpenAI) -> None:
    chunks = list(chat(client, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    check_usage(last.usage)
    assert all(c.usage is None for c in chunks[:-1])
    n_tokens = chat(client, max_tokens=8, temperature=0).usage.completion_tokens
    assert last.usage.completion_tokens == n_tokens
    plain = list(chat(client, max_tokens=4, temperature=0, stream=True))
    assert all(c.usage is None for c in plain)


def test_max_completion_tokens(client: OpenAI) -> None:
    r = chat(client, max_completion_tokens=7, temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7 == len(r.choices[0].logprobs.content)
    # max_completion_tokens wins over the deprecated max_tokens.
    r = chat(client, max_tokens=20, max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_token_id_prompt(serve_app: Any, client: OpenAI) -> None:
    tok = httpx.post(serve_app.url + "/tokenize", json={"prompt": PROMPT}, timeout=60).json()
    ids = tok["tokens"]
    assert ids and tok["count"] == len(ids)
    by_ids = complete(client, prompt=ids, max_tokens=12, temperature=0)
    by_text = complete(client, max_tokens=12, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    assert by_ids.choices[0].text == by_text.choices[0].text


# -- other routes ---------------------------------------------------------------------------------------------------
def test_models(serve_app: Any, client: OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].object == "model"
    raw = httpx.get(serve_app.url + "/v1/models", timeout=30).json()
    assert raw["data"][0]["max_model_len"] > 0


def test_health_and_version(serve_app: Any) -> None:
    r = httpx.get(serve_app.url + "/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["replica"]
    r = httpx.get(serve_app.url + "/version", timeout=30)
    assert r.status_code == 200 and isinstance(r.json()["version"], str) and r.json()["version"]


def test_tokenize_messages_shows_the_template(serve_app: Any, client: OpenAI) -> None:
    user = "hi there how are you"
    plain = httpx.post(serve_app.url + "/tokenize", timeout=30,
                       json={"prompt": user, "add_special_tokens": False}).json()
    assert plain["count"] == len(plain["tokens"]) == 5
    messages = [{"role": "user", "content": user}]
    r = httpx.post(serve_app.url + "/tokenize", json={"model": MODEL_NAME, "messages": messages}, timeout=30)
    assert r.status_code == 200
    t = r.json()
    assert DEFAULT_SYSTEM_PROMPT in t["prompt"]
    assert user in t["prompt"] and t["prompt"].endswith("assistant\n")
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"])
    assert t["count"] > 5 + 15, "the template's role markers and system prompt add many tokens"
    # Exactly what generation sees.
    used = chat(client, messages=messages, max_tokens=1, temperature=0).usage.prompt_tokens
    assert used == t["count"]


def test_detokenize_round_trip(serve_app: Any) -> None:
    text = "Hello, world! Caf\u00e9 na\u00efve \u4f60\u597d \U0001f431 42"
    tok = httpx.post(serve_app.url + "/tokenize", timeout=30,
                     json={"prompt": text, "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) > 5
    r = httpx.post(serve_app.url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=30)
    assert r.status_code == 200 and r.json()["prompt"] == text
    # A prefix of the ids gives a prefix of the text (for ids ending on a character boundary).
    first = httpx.post(serve_app.url + "/detokenize", json={"tokens": tok["tokens"][:2]}, timeout=30).json()
    assert text.startswith(first["prompt"]) and first["prompt"]


def _parse_server_timing(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur)
    return out


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_server_timing(client: OpenAI, kind: str) -> None:
    call = client.chat.completions if kind == "chat" else client.completions
    kw: dict[str, Any] = {"messages": CHAT} if kind == "chat" else {"prompt": PROMPT}
    raw = call.with_raw_response.create(model=MODEL_NAME, max_tokens=8, temperature=0, **kw)
    body = raw.parse()
    timing = body.model_extra["server_timing"]
    assert set(timing) == TIMING_KEYS
    assert all(isinstance(v, float | int) and v >= 0 for v in timing.values())
    assert timing["total"] >= max(v for k, v in timing.items() if k != "total")
    assert timing["prefill"] > 0 and timing["decode"] > 0
    header = _parse_server_timing(raw.headers["server-timing"])
    assert set(header) == TIMING_KEYS
    for k, v in timing.items():
        assert header[k] == pytest.approx(v, abs=0.006)
    print(f"\n{kind} server timing (ms): {timing}")


def test_engine_idle_after_api_tests(serve_app: Any) -> None:
    stats = wait_idle(serve_app)
    assert stats["num_free_blocks"] == stats["num_kv_blocks"], stats
