"""The directory's bookkeeping, as pure logic (no Ray cluster)."""

from __future__ import annotations

import time

from stages.directory.directory import ASKER_TTL_S, KEPT_MARGIN_S, LiveDirectory
from stages.transport.messages import AbortRequest, EngineReport, LiveEntry, ResumeLookup


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


def test_aborts_forwarded_to_a_replica_that_stopped_asking_go_with_it():
    """An Egress replica asks every second; one that stopped asking died (an Ingress's cancel of a
    stream that moved off it is forwarded to it): its ids go once it has missed its asks, while a
    replica that keeps asking keeps getting them."""
    d = LiveDirectory(abort_ttl_s=300.0)
    assert d.take_aborts("egress-dead") == [] and d.take_aborts("egress-live") == []
    d.forward_abort(AbortRequest("egress-dead", ["r1"]))
    d.forward_abort(AbortRequest("egress-live", ["r2"]))
    at, ttl = d._asked["egress-live"]
    d._asked["egress-live"] = (at + ASKER_TTL_S, ttl)  # it asked again since
    d.prune(now=time.monotonic() + ASKER_TTL_S + 1)
    assert d.forwarded() == {"egress-live": ["r2"]}
    assert d.take_aborts("egress-live") == ["r2"]


# -- kept (resumable) streams ------------------------------------------------------------------------------
def test_keep_replaces_the_live_entry_so_a_cancel_names_the_egress_replica():
    """keep: the Ingress's entry goes (nobody holds its connection); a cancel finds the kept stream
    under its Egress replica (the caller ends it there) and posts nothing to the old owner."""
    d = LiveDirectory()
    d.sync("ingress-a", [entry("r1", owner="ingress-a", label="L"), entry("r2", owner="ingress-a")], [])
    kept = entry("r1", owner="egress-A", label="L")
    d.keep(kept, 30.0)
    assert "r1" not in d.entries and set(d.entries) == {"r2"}
    assert d.cancel("chatcmpl-r1") == [kept] and d.cancel("L") == [kept]
    assert d.take_cancels("ingress-a") == []
    assert d.num_kept() == 1


def test_resume_lookup_finds_a_kept_stream_by_response_id_server_id_and_label():
    """A kept stream is named by its response id, its server id, or its client label."""
    d = LiveDirectory()
    kept = entry("r1", owner="egress-A", label="L")
    d.keep(kept, 30.0)
    for key in ("chatcmpl-r1", "r1", "L"):
        assert d.resume_lookup(key) == ResumeLookup(kept=[kept], attached=0), key
    assert d.resume_lookup("chatcmpl-r9") == ResumeLookup(kept=[], attached=0)
    assert d.resume_lookup("M") == ResumeLookup(kept=[], attached=0)


def test_resume_lookup_only_shows_a_stream_to_the_key_that_created_it():
    """With API keys on, a kept stream is found only with its creating key."""
    d = LiveDirectory()
    d.keep(entry("r1", owner="egress-A", key="k1"), 30.0)
    d.sync("ingress-a", [entry("r2", owner="ingress-a", key="k1")], [])
    assert d.resume_lookup("chatcmpl-r1", "k2").kept == [] and d.resume_lookup("chatcmpl-r1").kept == []
    assert [e.request_id for e in d.resume_lookup("chatcmpl-r1", "k1").kept] == ["r1"]
    assert d.resume_lookup("r2", "k2").attached == 0 and d.resume_lookup("r2", "k1").attached == 1


def test_resume_lookup_counts_the_live_requests_the_key_names_as_attached():
    """Live entries (a connection is attached) are counted, not returned as kept."""
    d = LiveDirectory()
    d.sync("ingress-a", [entry("r2", owner="ingress-a", label="L"), entry("r3", owner="ingress-a", label="L")], [])
    d.keep(entry("r1", owner="egress-A", label="L"), 30.0)
    found = d.resume_lookup("L")
    assert [e.request_id for e in found.kept] == ["r1"] and found.attached == 2
    assert d.resume_lookup("chatcmpl-r2") == ResumeLookup(kept=[], attached=1)


def test_unkeep_forgets_a_kept_stream_and_its_names():
    """unkeep (taken again, or expired in its Egress): no lookup finds it; unknown ids are ignored."""
    d = LiveDirectory()
    d.keep(entry("r1", owner="egress-A", label="L"), 30.0)
    d.unkeep("r1")
    d.unkeep("r1")
    assert d.num_kept() == 0
    for key in ("chatcmpl-r1", "r1", "L"):
        assert d.resume_lookup(key) == ResumeLookup(), key


def test_a_kept_entry_expires_a_margin_after_its_grace_period():
    """prune drops a kept entry once seconds + KEPT_MARGIN_S have passed (its Egress may have died)."""
    d = LiveDirectory()
    now = time.monotonic()
    d.keep(entry("r1", owner="egress-A", label="L"), 10.0, now=now)
    d.prune(now=now + 10.0 + KEPT_MARGIN_S - 0.5)
    assert d.num_kept() == 1
    d.prune(now=now + 10.0 + KEPT_MARGIN_S + 0.5)
    assert d.num_kept() == 0 and d.resume_lookup("L") == ResumeLookup()


def test_keeping_a_stream_again_pushes_its_expiry_back():
    """A second keep (detached again after a reconnect) restarts the entry's deadline."""
    d = LiveDirectory()
    now = time.monotonic()
    d.keep(entry("r1", owner="egress-A"), 10.0, now=now)
    d.keep(entry("r1", owner="egress-A"), 10.0, now=now + 8.0)
    d.prune(now=now + 10.0 + KEPT_MARGIN_S + 1.0)
    assert d.num_kept() == 1
    d.prune(now=now + 18.0 + KEPT_MARGIN_S + 1.0)
    assert d.num_kept() == 0
