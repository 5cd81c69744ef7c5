"""The directory's bookkeeping, as pure logic (no Ray cluster)."""

from __future__ import annotations

import time

from stages.directory.directory import LiveDirectory
from stages.transport.messages import AbortRequest, EngineReport, LiveEntry


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
