"""Cache-aware routing at 2 Engine replicas (the app with every stage at 2 replicas): a
conversation's later turns go where its earlier turns are cached, the hit shows in ``usage``, and
the request's log line says where the router sent it and what it expected there."""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
from typing import Any

import httpx
import pytest

from stages.routing.router import ROUTING_STATS_PERIOD_S
from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.serve

CONVERSATIONS, TURNS = 4, 3
#: Between turns, as a user reads the answer: long enough for the engines' next cache summaries to
#: reach both Egress replicas' routers (a turn may be routed by the other one).
THINK_S = 5.0
WORDS = "river stone amber cloud lantern meadow copper violet harbor ember willow falcon quartz".split()


#: Words in a conversation's first message and in each later one. The first is long so that its
#: cached history (about 400 tokens, 1.5 requests' worth at ``prefill_tokens_per_request: 256``)
#: outweighs the most load the other conversations can put on its engine (3 running requests, 0.75
#: in the router's score): with a shorter history the rule rightly sends a turn to the idler engine.
FIRST_WORDS, LATER_WORDS = 300, 90


def _user(conversation: int, turn: int) -> str:
    rng = random.Random(conversation * 100 + turn)
    words = FIRST_WORDS if turn == 0 else LATER_WORDS
    return f"Conversation {conversation}, question {turn}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def _turn(url: str, history: list[dict[str, str]], rid: str) -> dict[str, Any]:
    r = httpx.post(url + "/v1/chat/completions", headers={"X-Request-Id": rid}, timeout=120,
                   json={"model": MODEL_NAME, "messages": history, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _log_record(path: str, rid: str, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        with open(path) as f:
            found = [json.loads(line) for line in f if f'"x_request_id":"{rid}"' in line]
        if found:
            assert len(found) == 1, found
            return found[0]
        assert time.monotonic() < deadline, f"no log line for {rid}"
        time.sleep(0.2)


def test_a_conversations_later_turns_go_where_its_history_is_cached(serve_app_replicas: Any) -> None:
    app = serve_app_replicas
    # The test before may have left a request finishing on one engine. Start from idle engines,
    # and give every router the reports that say so (they arrive every ROUTING_STATS_PERIOD_S): a
    # router that still sees one engine busy rightly sends the whole first burst to the other.
    app.wait_engines_idle(2, 60)
    time.sleep(3 * ROUTING_STATS_PERIOD_S)
    tag = f"{time.time_ns():x}"
    histories: list[list[dict[str, str]]] = [[] for _ in range(CONVERSATIONS)]
    records: list[list[dict[str, Any]]] = [[] for _ in range(CONVERSATIONS)]

    def one(c: int, t: int) -> None:
        histories[c].append({"role": "user", "content": _user(c, t)})
        rid = f"route-{tag}-{c}-{t}"
        body = _turn(app.url, histories[c], rid)
        histories[c].append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        record = _log_record(app.request_log, rid)
        assert record["cached_tokens"] == body["usage"]["prompt_tokens_details"]["cached_tokens"]
        records[c].append(record)

    with concurrent.futures.ThreadPoolExecutor(CONVERSATIONS) as pool:
        for t in range(TURNS):
            list(pool.map(lambda c: one(c, t), range(CONVERSATIONS)))  # noqa: B023 - t is current
            if t < TURNS - 1:
                time.sleep(THINK_S)

    stale = []
    for c, turns in enumerate(records):
        for t in range(1, TURNS):
            prev, now = turns[t - 1], turns[t]
            route = now["route"]
            assert route["policy"] == "cache_aware" and route["alternative"], route
            if route["replica"] != prev["route"]["replica"]:
                # Only a router that had not yet seen the history anywhere may send a turn away
                # from it (its view is a summary at most a report old); one that knew must follow.
                assert route["expected_cached_tokens"] < 64 and route["alternative_cached_tokens"] < 64, (c, t, route)
                stale.append((c, t, route))
                continue
            # The same engine as the turn before, which had the conversation so far cached, as
            # the router expected and the engine found: the previous prompt at least, to within a
            # block (the last token of a prompt is always computed).
            assert route["expected_cached_tokens"] >= prev["prompt_tokens"] - 16, (c, t, route, prev)
            assert now["cached_tokens"] >= prev["prompt_tokens"] - 16, (c, t, now, prev)
            # The other replica held only what every conversation shares.
            assert route["alternative_cached_tokens"] < 64, route
    # Under a loaded CI machine a routing report can arrive late; once, not as a rule.
    assert len(stale) <= 1, stale
    # New conversations arriving together were spread over both engines by load.
    firsts = [turns[0]["route"] for turns in records]
    assert len({route["replica"] for route in firsts}) == 2, json.dumps(firsts)
