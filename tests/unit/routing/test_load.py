"""How soon a replica could start a request (stages/routing/load.py)."""

from __future__ import annotations

import pytest

from stages.routing.load import BUSY_WEIGHT, FULL, ReplicaLoad, SentSinceReport, start_cost


def load(waiting: int = 0, running: int = 0, free: int = 100, max_seqs: int = 8, max_waiting: int = 16) -> ReplicaLoad:
    return ReplicaLoad(num_waiting=waiting, num_running=running, max_num_seqs=max_seqs, num_free_blocks=free,
                       block_size=16, max_waiting=max_waiting)


def test_a_free_batch_slot_costs_only_the_batch_it_joins():
    assert start_cost(load(running=7), prompt_tokens=100) == pytest.approx(7 * BUSY_WEIGHT, abs=1e-3)
    # A full batch with 3 waiting: those 3 stand ahead, besides the batch.
    assert start_cost(load(running=8, waiting=3), prompt_tokens=100) == pytest.approx(4 + 11 * BUSY_WEIGHT, abs=1e-3)


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


def test_a_replica_without_a_report_counts_as_empty_but_for_what_was_sent_it():
    """A new replica's first report comes up to a period after it starts: until then it must
    compete like a replica with as many running requests as it was sent."""
    assert start_cost(None, prompt_tokens=10) == 0
    assert start_cost(None, prompt_tokens=10, sent_since_report=4) == pytest.approx(4 * BUSY_WEIGHT)
    assert start_cost(None, prompt_tokens=10, sent_since_report=4) == pytest.approx(
        start_cost(load(running=4), prompt_tokens=10), abs=1e-3)


def test_sends_count_until_two_newer_reports():
    """The first report after a send may have been taken before the request arrived; the second
    was taken a report period later and counts it."""
    sent = SentSinceReport()
    assert sent.count("a", None) == 0
    sent.add("a", 3)
    assert sent.count("a", None) == 3
    assert sent.count("a", 0) == 3  # the first report: maybe taken before they arrived
    sent.add("a", 2)
    assert sent.count("a", 0) == 5
    assert sent.count("a", 1) == 2  # the second report counts the first 3, maybe not the 2
    assert sent.count("a", 2) == 0
    assert sent.count("b", 7) == 0


def test_among_replicas_that_start_it_at_once_the_smaller_batch_goes_first():
    idle, busy = start_cost(load(running=0), prompt_tokens=50), start_cost(load(running=5), prompt_tokens=50)
    assert idle < busy < 2  # both start it at the next step: less than two requests waiting
    assert start_cost(load(running=0), prompt_tokens=50, sent_since_report=2) > idle
