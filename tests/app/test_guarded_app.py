"""The real app with API keys, and hostile sizes (tests/conftest.py's guarded configuration).

Keys: no key and a wrong key get 401 in the OpenAI shape, the right key 200 (curl-style and through
the official ``openai`` client), a key from ``LIFECYCLE_API_KEYS`` works, ``/health`` is exempt and
``/metrics`` is not, cancel by id only reaches the creating key's requests, one key's fifth request
in flight gets 429, and no key appears in any log line (the request log and every Ray log).

Huge inputs: a 1 MB prompt to ``/tokenize`` answers 200 with every token (its reply is bigger than the
4 MiB message limit between deployments, so it crosses in parts), to the completions routes a clear
400; and small requests running beside it keep their server-side prep time within 50 ms of idle.
"""

from __future__ import annotations

import concurrent.futures
import functools
import glob
import json
import os
import random
import statistics
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import GUARDED_KEYS, MODEL_NAME, ServeApp

pytestmark = pytest.mark.serve
WRONG_KEY = "sk-wrong-" + "".join(random.choices("abcdefghijkmnopqrstuvwxyz0123456789", k=24))


def _auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {GUARDED_KEYS[name]}"}


def _small(app: ServeApp, key: str = "main", **kw: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 1, **kw}
    return httpx.post(app.url + "/v1/completions", json=body, headers=_auth(key), timeout=60)


def _assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return err


def _prep_ms(r: httpx.Response) -> float:
    """Server-side preparation time: ``prep`` of a completion, the whole server time of /tokenize."""
    parts = dict(p.strip().split(";dur=") for p in r.headers["server-timing"].split(","))
    return float(parts.get("prep", parts["total"]))


def _small_tokenize(app: ServeApp) -> httpx.Response:
    return httpx.post(app.url + "/tokenize", json={"prompt": "Hello there, how are you?"}, headers=_auth("main"),
                      timeout=60)


# -- keys ------------------------------------------------------------------------------------------------
def test_no_key_and_wrong_key_get_401_right_key_200(serve_app_guarded: ServeApp) -> None:
    url = serve_app_guarded.url
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": f"Bearer {WRONG_KEY}"}, {"Authorization": WRONG_KEY},
                    {"Authorization": f"Basic {GUARDED_KEYS['main']}"}):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
        _assert_openai_error(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer" and WRONG_KEY not in r.text
    for path in ("/v1/models", "/tokenize", "/v1/requests/x/cancel", "/no-such-route", "/openapi.json"):
        method = "GET" if path in ("/v1/models", "/no-such-route", "/openapi.json") else "POST"
        _assert_openai_error(httpx.request(method, url + path, json={"prompt": "x"}, timeout=30), 401)
    for name in ("main", "env"):  # "env" is only in the Ingress's LIFECYCLE_API_KEYS
        r = httpx.post(url + "/v1/completions", json=body, headers=_auth(name), timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_exemptions_health_open_metrics_closed(serve_app_guarded: ServeApp) -> None:
    url = serve_app_guarded.url
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    _assert_openai_error(httpx.get(url + "/metrics", timeout=30), 401)
    r = httpx.get(url + "/metrics", headers=_auth("main"), timeout=30)
    assert r.status_code == 200 and "lifecycle:" in r.text


def test_official_client_with_api_key(serve_app_guarded: ServeApp) -> None:
    good = OpenAI(base_url=serve_app_guarded.url + "/v1", api_key=GUARDED_KEYS["other"], max_retries=0, timeout=60)
    chat = good.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.choices[0].message.role == "assistant"
    text = "".join(c.choices[0].text for c in good.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=3, stream=True) if c.choices)
    assert isinstance(text, str)
    assert [m.id for m in good.models.list()] == [MODEL_NAME]
    bad = OpenAI(base_url=serve_app_guarded.url + "/v1", api_key=WRONG_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_cancel_by_id_only_reaches_the_creating_keys_requests(serve_app_guarded: ServeApp) -> None:
    url = serve_app_guarded.url
    label = f"guarded-{time.monotonic_ns()}"
    # A request that stays live for seconds: ~3,000 prompt tokens on this app's one-thread engine.
    body = {"model": MODEL_NAME, "prompt": _digits(3_000, seed=5), "max_tokens": 2}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, url + "/v1/completions", json=body,
                              headers={**_auth("main"), "X-Request-Id": label}, timeout=120)
        time.sleep(0.3)
        other = httpx.post(f"{url}/v1/requests/{label}/cancel", headers=_auth("other"), timeout=30)
        live = not pending.done()
        mine = httpx.post(f"{url}/v1/requests/{label}/cancel", headers=_auth("main"), timeout=30)
        still_live = not pending.done()
        pending.result()
    assert live and still_live, "the request ended before the cancels; the test proved nothing"
    _assert_openai_error(other, 404, "request_not_found")  # another key's request: not visible to this one
    assert mine.status_code == 200, mine.text
    assert [c["x_request_id"] for c in mine.json()["cancelled"]] == [label]


def test_fifth_request_of_one_key_in_flight_gets_429(serve_app_guarded: ServeApp) -> None:
    url = serve_app_guarded.url
    # Four requests whose ~1,200-token prompts (no prefix in common) prefill together for seconds
    # on this app's one-thread engine, all with one key.
    def held(seed: int) -> int:
        body = {"model": MODEL_NAME, "prompt": _digits(1_200, seed=10 + seed), "max_tokens": 1}
        return httpx.post(url + "/v1/completions", json=body, headers=_auth("limited"), timeout=180).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        four = [pool.submit(held, i) for i in range(4)]
        time.sleep(0.3)
        over = _small(serve_app_guarded, key="limited")
        beside = _small(serve_app_guarded, key="other")  # other keys are not affected
        statuses = [f.result() for f in four]
    assert statuses == [200] * 4 and beside.status_code == 200
    err = _assert_openai_error(over, 429, "rate_limit_exceeded")
    assert "limit is 4" in err["message"] and over.headers["retry-after"] == "1"
    assert _small(serve_app_guarded, key="limited").status_code == 200  # freed once they finished


def test_no_key_appears_in_any_log_line(serve_app_guarded: ServeApp) -> None:
    # Requests with every key and a wrong one, on several routes, first.
    for name in GUARDED_KEYS:
        assert _small(serve_app_guarded, key=name).status_code == 200
    httpx.post(serve_app_guarded.url + "/v1/completions", json={"prompt": "x"},
               headers={"Authorization": f"Bearer {WRONG_KEY}"}, timeout=30)
    httpx.post(serve_app_guarded.url + "/tokenize", json={"prompt": "x"}, headers=_auth("main"), timeout=30)
    time.sleep(1.0)  # let log buffers flush
    # Not the "env" key: the test hands it to the Ingress through a Ray runtime_env, and Ray's
    # runtime_env agent logs every runtime_env it sets up, env_vars included (docs/operations.md says to set
    # LIFECYCLE_API_KEYS in the Ray processes' own environment for that reason).
    secrets = [*(v for k, v in GUARDED_KEYS.items() if k != "env"), WRONG_KEY]
    with open(serve_app_guarded.request_log) as f:
        lines = f.read().splitlines()
    records = [json.loads(line) for line in lines]
    assert any(str(r.get("api_key_id", "")).startswith("key-") for r in records)  # ids are logged, keys never
    files = [serve_app_guarded.request_log,
             *glob.glob(os.path.join(serve_app_guarded.session_dir, "logs", "**", "*"), recursive=True)]
    checked = 0
    for path in files:
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        checked += 1
        for secret in secrets:
            assert secret.encode() not in data, f"an API key was written to {path}"
    assert checked > 5


# -- huge inputs --------------------------------------------------------------------------------------------
@functools.cache
def _digits(n: int, seed: int = 0) -> str:
    # About one token per character: a 1 MB prompt is ~970k tokens, a /tokenize reply of ~10 MB.
    return "".join(random.Random(seed).choices("0123456789 ,.", k=n))


def test_megabyte_prompt_to_tokenize_is_answered_whole(serve_app_guarded: ServeApp) -> None:
    prompt = _digits(1_000_000)
    r = httpx.post(serve_app_guarded.url + "/tokenize", json={"prompt": prompt}, headers=_auth("main"), timeout=180)
    assert r.status_code == 200, r.text[:500]
    body = r.json()
    assert body["prompt"] == prompt and body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 500_000
    assert len(r.content) > 4 * 1024 * 1024  # more than one inter-deployment message could carry
    head = httpx.post(serve_app_guarded.url + "/tokenize", json={"prompt": prompt[:2000]}, headers=_auth("main"),
                      timeout=60).json()
    assert body["tokens"][:100] == head["tokens"][:100]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_megabyte_prompt_to_completions_is_a_clear_400(serve_app_guarded: ServeApp, route: str) -> None:
    prompt = _digits(1_000_000, seed=2)
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 2}
    body.update({"prompt": prompt} if route == "/v1/completions" else {"messages": [{"role": "user", "content": prompt}]})
    r = httpx.post(serve_app_guarded.url + route, json=body, headers=_auth("main"), timeout=180)
    err = _assert_openai_error(r, 400, "context_length_exceeded")
    assert "maximum context length" in err["message"]
    assert "would be at least" in err["message"]  # refused by its byte floor, never encoded


def test_body_over_the_limit_is_413_and_the_largest_allowed_body_is_served(serve_app_guarded: ServeApp) -> None:
    limit = serve_app_guarded.args["http"]["max_body_bytes"]
    pad = (limit - len(json.dumps({"prompt": ""}))) // 6
    r = httpx.post(serve_app_guarded.url + "/detokenize", content=json.dumps({"tokens": [1] * ((limit + 10) // 2)}),
                   headers={**_auth("main"), "content-type": "application/json"}, timeout=60)
    _assert_openai_error(r, 413)
    # The largest body: its Preprocess request is close to the 4 MiB message limit, and still fits.
    r = httpx.post(serve_app_guarded.url + "/tokenize", content=json.dumps({"prompt": " hello" * pad}),
                   headers={**_auth("main"), "content-type": "application/json"}, timeout=180)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["count"] > 0


def test_small_requests_beside_a_huge_one_keep_their_prep_time(serve_app_guarded: ServeApp) -> None:
    """Server-side prep of small requests (completions: the ``prep`` of Server-Timing, arrival to
    Preprocess done; /tokenize: its whole server time) while Preprocess tokenises a 1 MB prompt
    stays within 50 ms of idle (the median; none waits for the huge one). With the preparation
    inline on the event loop, every small request waited for the huge one, 0.3 s to seconds."""
    calls = {"completion": _small, "tokenize": _small_tokenize}
    for call in calls.values():
        call(serve_app_guarded)  # warm
    idle = {kind: statistics.median(_prep_ms(call(serve_app_guarded)) for _ in range(5))
            for kind, call in calls.items()}
    prompt = _digits(1_000_000, seed=3)
    done = threading.Event()
    huge: list[httpx.Response] = []

    def big() -> None:
        huge.append(httpx.post(serve_app_guarded.url + "/tokenize", json={"prompt": prompt}, headers=_auth("other"),
                               timeout=180))
        done.set()

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.2)  # its body is sent; tokenising it takes a second or more
    during: dict[str, list[float]] = {kind: [] for kind in calls}
    while not done.is_set():  # small requests one after another, for as long as the huge one runs
        for kind, call in calls.items():
            r = call(serve_app_guarded)
            assert r.status_code == 200
            during[kind].append(_prep_ms(r))
    thread.join()
    assert huge[0].status_code == 200 and huge[0].json()["count"] > 500_000
    print(f"prep ms: idle medians {idle}, beside the 1 MB /tokenize {during}")
    for kind, times in during.items():
        # Typical: within 50 ms of idle. Worst: no small request waited for the huge one (which takes
        # seconds here); a single slow sample on this shared 2-core machine is scheduling, not queueing.
        assert statistics.median(times) <= idle[kind] + 50, (kind, idle[kind], times)
        assert max(times) <= idle[kind] + 300, (kind, idle[kind], times)
    assert sum(map(len, during.values())) >= 6, f"only {during} ran beside the huge one; the test proved little"


def test_max_tokens_limit(serve_app_guarded: ServeApp) -> None:
    err = _assert_openai_error(_small(serve_app_guarded, max_tokens=5), 400)
    assert err["param"] == "max_tokens" and "at most 4" in err["message"]
    r = _small(serve_app_guarded, max_tokens=None, ignore_eos=True)  # unset: stops at the limit, not the context
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
