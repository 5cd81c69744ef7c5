"""The disconnect soak, 12-second version (``make soak`` runs 10 minutes): 32 clients churning
(about 30% dropped at random points, some cancelled by id, random ``n`` and stop strings), then
nothing left: 0 running, 0 waiting, KV usage 0, no open engine stream, no live-request entry in the
Directory, and every actor's RSS flat within 10% after warm-up. Runs on the fault tests' app
(restored to health first), which no other test shares."""

from __future__ import annotations

import json

from bench.soak import run_soak
from tests.app.test_faults import APP, _ready
from tests.conftest import ServeApp


def test_soak_12s_leaves_nothing_behind(fault_app: ServeApp) -> None:
    _ready(fault_app)
    report = run_soak(fault_app.url, APP, fault_app.call, 12.0, concurrency=32, warmup_s=6.0)
    print("\n" + json.dumps(report.to_dict(), indent=1))
    assert report.requests > 50, report.outcomes
    assert report.outcomes["ok"] > 0 and report.outcomes["cancelled"] > 0, report.outcomes
    assert not report.failures, report.failures[:5]
    assert not report.leaks, report.leaks
    assert report.rss, "no RSS samples"
