"""The engine routing policy and the directory's bookkeeping, as pure logic (no Ray cluster)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from stages.directory.directory import LiveDirectory
from stages.routing.router import FULL, EgressRouter, ReplicaLoad, SentSinceReport, prefix_key, rank, start_cost
from stages.transport.messages import AbortRequest, AdmissionBatch, EngineReport, LiveEntry


def load(waiting: int = 0, running: int = 0, free: int = 100, max_seqs: int = 8, max_waiting: int = 16) -> ReplicaLoad:
    return ReplicaLoad(num_waiting=waiting, num_running=running, max_num_seqs=max_seqs, num_free_blocks=free,
                       block_size=16, max_waiting=max_waiting)


# -- start_cost / rank ------------------------------------------------------------------------------------------
def test_a_free_batch_slot_means_no_wait_whatever_the_open_streams():
    assert start_cost(load(running=7), prompt_tokens=100) < 0.5
    assert start_cost(load(running=8, waiting=3), prompt_tokens=100) > 3.9


def test_queue_depth_ranks_before_open_streams():
    busy_batch = start_cost(load(running=8, waiting=0), prompt_tokens=50)
    long_queue = start_cost(load(running=8, waiting=6), prompt_tokens=50)
    assert busy_batch < long_queue


def test_no_kv_headroom_costs_a_whole_batch():
    roomy = start_cost(load(running=2, free=100), prompt_tokens=500)
    tight = start_cost(load(running=2, free=10), prompt_tokens=500)  # needs 32 blocks
    assert tight - roomy >= 8


def test_full_waiting_queue_ranks_last_and_sends_since_report_count():
    assert start_cost(load(waiting=16), prompt_tokens=10) == FULL
    assert start_cost(load(waiting=10), prompt_tokens=10, n=4, sent_since_report=3) == FULL
    assert start_cost(load(running=8), prompt_tokens=10, sent_since_report=2) > start_cost(load(running=8),
                                                                                         prompt_tokens=10)


def test_no_report_yet_falls_back_to_open_calls():
    assert start_cost(None, prompt_tokens=10, ongoing=5) == 5


def test_rank_avoids_refusers_and_prefers_affinity_within_slack():
    costs = {"a": 0.0, "b": 0.5, "c": 3.0}
    assert rank(costs) == ["a", "b", "c"]
    assert rank(costs, avoid={"a"}) == ["b", "c", "a"]
    assert rank(costs, preferred="b") == ["b", "a", "c"]  # within 1 request of the best
    assert rank(costs, preferred="c") == ["a", "b", "c"]  # too busy: affinity yields
    assert rank({"a": 0.0, "b": FULL}, preferred="b") == ["a", "b"]


def test_prefix_key_needs_a_real_prefix():
    assert prefix_key([1, 2, 3]) is None
    assert prefix_key(list(range(100))) == prefix_key(list(range(64)) + [9] * 36)


# -- the directory ---------------------------------------------------------------------------------------------
def entry(rid: str, owner: str = "a", label: str | None = None, key: str | None = None) -> LiveEntry:
    return LiveEntry(rid, f"chatcmpl-{rid}", owner, label, key)


def test_cancel_by_response_id_is_exact_and_by_label_is_every_carrier():
    d = LiveDirectory()
    d.sync("a", [entry("r1", label="L"), entry("r2", label="L")], [])
    d.sync("b", [entry("r3", owner="b", label="L"), entry("r4", owner="b")], [])
    assert [e.request_id for e in d.cancel("chatcmpl-r4")] == ["r4"]
    assert sorted(e.request_id for e in d.cancel("L")) == ["r1", "r2", "r3"]
    assert d.take_cancels("a") == ["r1", "r2"] and sorted(d.take_cancels("b")) == ["r3", "r4"]
    assert d.take_cancels("a") == []  # delivered once


def test_removed_entries_and_labels_are_forgotten():
    d = LiveDirectory()
    d.sync("a", [entry("r1", label="L")], [])
    d.sync("a", [], ["r1"])
    assert d.cancel("L") == [] and d.cancel("chatcmpl-r1") == [] and d.entries == {}


def test_full_sync_replaces_and_dead_owners_are_pruned():
    d = LiveDirectory(owner_ttl_s=10)
    d.sync("a", [entry("r1"), entry("r2")], [])
    d.sync("a", [entry("r3")], [], full=True)
    assert set(d.entries) == {"r3"}
    d.sync("b", [entry("r4", owner="b")], [])
    d._owners["a"].last_seen -= 60
    assert d.prune() == ["a"] and set(d.entries) == {"r4"} and not d.knows("a")


def test_api_key_scopes_cancel():
    d = LiveDirectory()
    d.sync("a", [entry("r1", key="k1")], [])
    assert d.cancel("chatcmpl-r1", "k2") == [] and len(d.cancel("chatcmpl-r1", "k1")) == 1


def test_stale_engine_reports_drop_out():
    d = LiveDirectory(report_ttl_s=5)
    d.report(EngineReport("e1", "n", 100, True))
    d.report(EngineReport("e2", "n", 90, True))
    r, at = d._reports["e1"]
    d._reports["e1"] = (r, at - 10)
    assert [x.replica for x in d.engine_reports()] == ["e2"]


def test_aborts_forwarded_for_a_draining_replica_reach_it_once_and_expire_if_it_never_asks():
    d = LiveDirectory(abort_ttl_s=30.0)
    d.forward_abort(AbortRequest("engine-A", ["r1", "r2"]))
    d.forward_abort(AbortRequest("engine-A", ["r2", "r3"]))
    d.forward_abort(AbortRequest("", ["nobody"]))  # names no replica: nothing to hold it for
    d.forward_abort(AbortRequest("engine-gone", ["r9"]))
    report = EngineReport("engine-A", "n", 8192, True)
    assert d.report(report) == ["r1", "r2", "r3"], "an engine takes its aborts with its report"
    assert d.report(report) == [], "each id is handed out once"
    assert d.take_aborts("egress-B") == []
    assert d.num_forwarded() == 1
    d.prune(now=time.monotonic() + 31)
    assert d.num_forwarded() == 0, "a replica that never asks (it died, and its requests) lets them expire"


def test_egress_router_places_job_batches_by_reported_jobs_plus_what_it_sent_since():
    """Batch-admitted jobs are not Serve requests once admitted: the router ranks Egress replicas
    by the jobs they report, counts its own sends until the next report, and still sends a cancel
    to the replica it names."""
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
    b.routing_stats = {"admitted_jobs": 2, "seq": 2}  # a fresh report already counts them
    assert choose([a, b], jobs) == ["b", "a"]
    assert choose([a, b], AbortRequest("a", ["r1"])) == ["a"]
