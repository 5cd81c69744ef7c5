"""The Serve routers of the Engine and Egress hops, driven with fake replicas (no Ray cluster)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from stages.engine.core.block_manager import ROOT_HASH, chain_hash
from stages.routing import router as router_module
from stages.routing.load import SentSinceReport
from stages.routing.prefix import PrefixViews
from stages.routing.router import EgressRouter, EngineRouter
from stages.transport.messages import (
    AbortRequest,
    AdmissionBatch,
    EngineRequest,
    PrefixSummary,
    SamplingParams,
)

BS = 4


def test_egress_router_places_job_batches_by_reported_jobs_plus_what_it_sent_since():
    """Batch-admitted jobs are not Serve requests once admitted: the router ranks Egress replicas
    by the jobs they report, counts its own sends until two reports later, and still sends a
    cancel to the replica it names."""
    def replica(uid: str, jobs: int, seq: int) -> Any:
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid),
                               routing_stats={"admitted_jobs": jobs, "seq": seq})

    router = SimpleNamespace(_sent=SentSinceReport())
    jobs = AdmissionBatch(items=[object()] * 8)

    def choose(candidates: list[Any], msg: Any) -> list[str]:
        ranked = asyncio.run(EgressRouter.choose_replicas(router, candidates, SimpleNamespace(args=[msg])))
        return [group[0].replica_id.unique_id for group in ranked]

    a, b = replica("a", 5, 1), replica("b", 1, 1)
    assert choose([a, b], jobs) == ["b", "a"]
    EgressRouter.on_request_routed(router, SimpleNamespace(args=[jobs]), b.replica_id, None)
    assert choose([a, b], jobs) == ["a", "b"]  # 5 against 1 + 8 sent since b's report
    b.routing_stats = {"admitted_jobs": 2, "seq": 2}  # the next report may predate them
    assert choose([a, b], jobs) == ["a", "b"]
    b.routing_stats = {"admitted_jobs": 2, "seq": 3}  # the one after counts them
    assert choose([a, b], jobs) == ["b", "a"]
    assert choose([a, b], AbortRequest("a", ["r1"])) == ["a"]


# -- the engine router -------------------------------------------------------------------------------------------
def engine_replica(uid: str, *, waiting: int = 0, running: int = 0, cached: list[list[int]] = (),
                   version: int = 1) -> Any:
    hashes = [h for tokens in cached for h in chained(tokens)]
    stats = {"num_waiting": waiting, "num_running": running, "max_num_seqs": 8, "num_free_blocks": 500,
             "block_size": BS, "max_waiting": 16, "seq": version,
             "prefix": PrefixSummary.of(BS, version, hashes)}
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid), routing_stats=stats)


def chained(tokens: list[int]) -> list[int]:
    out, parent = [], ROOT_HASH
    for i in range(len(tokens) // BS):
        parent = chain_hash(parent, tuple(tokens[i * BS:(i + 1) * BS]))
        out.append(parent)
    return out


def engine_router(policy: str = "cache_aware") -> Any:
    router = SimpleNamespace(replica_queue_len_cache=SimpleNamespace(get=lambda replica_id: None))
    EngineRouter.initialize_state(router, policy=policy, prefill_tokens_per_request=256)
    router.views = PrefixViews()  # this test's own, not the process's
    router._sent_since = lambda rid, load: EngineRouter._sent_since(router, rid, load)
    return router


def route(router: Any, candidates: list[Any], msg: Any) -> list[str]:
    ranked = asyncio.run(EngineRouter.choose_replicas(router, candidates, SimpleNamespace(args=[msg])))
    return [group[0].replica_id.unique_id for group in ranked]


def request(rid: str, tokens: list[int]) -> EngineRequest:
    return EngineRequest(rid, tokens, SamplingParams(max_tokens=4))


SYSTEM = list(range(1, 33))  # what every conversation shares (8 blocks)
TURN1 = SYSTEM + list(range(1000, 1400))  # a conversation's history: 100 more blocks


def test_a_later_turn_goes_where_its_history_is_cached_and_says_so():
    router = engine_router()
    a = engine_replica("a", running=2, cached=[SYSTEM])
    b = engine_replica("b", running=4, cached=[SYSTEM, TURN1])
    turn2 = request("t2", TURN1 + list(range(5000, 5050)))
    assert route(router, [a, b], AdmissionBatch([turn2])) == ["b", "a"]
    note = turn2.route
    assert (note.replica, note.expected_cached_tokens, note.alternative) == ("b", len(TURN1), "a")
    assert note.alternative_cached_tokens == len(SYSTEM) and note.alternative_score > note.score
    assert note.attributes()["policy"] == "cache_aware"
    # Two replicas with the same system prompt only: the less loaded one.
    first = request("t1", SYSTEM + list(range(9000, 9100)))
    assert route(router, [a, b], AdmissionBatch([first])) == ["a", "b"]


def test_a_send_counts_before_the_next_report():
    router = engine_router()
    a, b = engine_replica("a", cached=[SYSTEM]), engine_replica("b", cached=[SYSTEM])
    doc = request("q1", SYSTEM + list(range(3000, 3600)))
    order = route(router, [a, b], AdmissionBatch([doc]))  # counted as sent to its first choice
    # The next question about the same document follows the first, though no report says so yet.
    again = request("q2", SYSTEM + list(range(3000, 3600)) + [7, 7, 7])
    assert route(router, [a, b], AdmissionBatch([again]))[0] == order[0]
    assert again.route.expected_cached_tokens >= 600
    assert router_module.cache_home(again, router.views) == order[0]
    assert router_module.cache_home(request("new", SYSTEM + [5] * 40), router.views) is None  # only the shared part


def test_a_system_prompt_cached_on_one_replica_only_is_no_cache_home():
    """After the first conversation, only its replica holds the shared system prompt. That must
    not make it the home of every new conversation: requests with one home share a submit call,
    so a burst of them would land on that replica in one call instead of being spread by load."""
    router = engine_router()
    a, b = engine_replica("a", cached=[SYSTEM]), engine_replica("b")
    route(router, [a, b], AdmissionBatch([request("c0", SYSTEM + [9] * 8)]))  # refresh the views
    new = [request(f"n{i}", SYSTEM + [200 + i] * 80) for i in range(4)]
    assert [router_module.cache_home(r, router.views) for r in new] == [None] * 4
    # A conversation whose history (most of its prompt) is on one replica has its home there.
    history = request("h", SYSTEM + list(range(700, 800)))
    route(router, [a, b], AdmissionBatch([history]))
    later = request("h2", history.prompt_token_ids + [5] * 8)
    assert router_module.cache_home(later, router.views) == history.route.replica


def test_calls_routed_together_spread_by_load():
    """Serve confirms a send a round trip later: a burst of calls must not all pick one replica."""
    router = engine_router()
    a, b = engine_replica("a", cached=[SYSTEM]), engine_replica("b", cached=[SYSTEM])
    firsts = [route(router, [a, b], AdmissionBatch([request(f"c{i}", SYSTEM + [100 + i] * 20)]))[0]
              for i in range(4)]
    assert sorted(firsts) == ["a", "a", "b", "b"]


def test_a_call_that_went_elsewhere_is_counted_there():
    router = engine_router()
    a, b = engine_replica("a", cached=[SYSTEM]), engine_replica("b", cached=[SYSTEM])
    doc = request("q", SYSTEM + list(range(3000, 3100)))
    first, other = route(router, [a, b], AdmissionBatch([doc]))
    assert router.views.cached_tokens(other, doc.prompt_token_ids) == len(SYSTEM)
    EngineRouter.on_request_routed(router, SimpleNamespace(args=[AdmissionBatch([doc])]),
                                   SimpleNamespace(unique_id=other), None)  # the first turned it away
    assert router.views.cached_tokens(other, doc.prompt_token_ids) >= 100


def test_named_messages_go_to_their_replica_and_refusers_go_last():
    router = engine_router()
    a, b = engine_replica("a", cached=[SYSTEM, TURN1]), engine_replica("b")
    assert route(router, [a, b], AbortRequest("b", ["r1"])) == ["b"]
    refused = request("r", TURN1 + [1, 2, 3])
    refused.avoid_replicas = ["a"]
    assert route(router, [a, b], AdmissionBatch([refused])) == ["b", "a"]


def test_other_policies_ignore_the_cache():
    router = engine_router(policy="least_loaded")
    a = engine_replica("a", running=8, waiting=1, cached=[SYSTEM, TURN1])
    b = engine_replica("b")
    turn2 = request("t2", TURN1 + [4] * 20)
    assert route(router, [a, b], AdmissionBatch([turn2])) == ["b", "a"]
    assert turn2.route.policy == "least_loaded" and turn2.route.alternative_cached_tokens == len(TURN1)


def unreported_replica(uid: str) -> Any:
    """A replica that has just started: Serve lists it, but it has sent no routing stats yet."""
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid), routing_stats={})


def test_a_replica_that_has_not_reported_yet_takes_its_share_of_a_burst():
    """A burst that comes before a new replica's first report must not all go to the replica
    that has reported: the new one counts as empty but for what it was sent."""
    router = engine_router()
    a, fresh = engine_replica("a", cached=[SYSTEM]), unreported_replica("fresh")
    firsts = [route(router, [a, fresh], AdmissionBatch([request(f"c{i}", SYSTEM + [100 + i] * 20)]))[0]
              for i in range(4)]
    assert sorted(firsts) == ["a", "a", "fresh", "fresh"]


def test_a_conversation_follows_its_history_to_a_replica_that_has_not_reported_yet():
    router = engine_router()
    a, fresh = engine_replica("a", running=3, cached=[SYSTEM]), unreported_replica("fresh")
    first = request("t1", SYSTEM + list(range(2000, 2400)))
    assert route(router, [a, fresh], AdmissionBatch([first]))[0] == "fresh"
    later = request("t2", first.prompt_token_ids + list(range(6000, 6040)))
    assert route(router, [a, fresh], AdmissionBatch([later]))[0] == "fresh"
    assert later.route.expected_cached_tokens >= 400


def test_a_burst_of_new_conversations_is_dealt_over_every_replica_serve_lists(monkeypatch):
    """The admission key deals requests without a cache home into one group per replica, counted
    from the routers' replica sets: a replica without a cache summary yet still gets a group."""
    from stages.routing import live_routers

    views = PrefixViews()
    views.update("a", PrefixSummary.of(BS, 1, chained(SYSTEM)))
    listed = SimpleNamespace(curr_replicas={"a": engine_replica("a", cached=[SYSTEM]),
                                            "fresh": unreported_replica("fresh")})
    monkeypatch.setattr(router_module, "VIEWS", views)
    monkeypatch.setattr(live_routers, "ROUTERS", [listed])
    keys = {router_module.placement_key(request(f"n{i}", SYSTEM + [300 + i] * 80)) for i in range(6)}
    assert len(keys) == 2


def test_a_report_taken_before_a_burst_arrived_does_not_erase_it():
    """Three first turns went to ``a``; ``a``'s next report, taken before they reached it, still
    says idle. The next new conversation must go to ``b``, not to the replica that looks idle."""
    router = engine_router()
    a, b = engine_replica("a", cached=[SYSTEM]), engine_replica("b", running=2, cached=[SYSTEM])
    burst = AdmissionBatch([request(f"c{i}", SYSTEM + [100 + i] * 40) for i in range(3)])
    assert route(router, [a, b], burst)[0] == "a"
    a.routing_stats = {**a.routing_stats, "seq": 2}  # taken before the burst reached it: idle
    assert route(router, [a, b], AdmissionBatch([request("next", SYSTEM + [300] * 40)]))[0] == "b"
