"""How soon an engine replica could start a request, from the state it last reported.

Serve's default router looks only at how many calls each replica has open. For an engine that
number says little: a replica with 40 open streams and an empty waiting queue starts a new request
at its next step, while one with 10 streams, a full batch and 6 waiting makes it wait for 6 others
to finish. So each engine replica reports its scheduler state through Serve's
``record_routing_stats``, and :func:`start_cost` turns that into the number of requests that stand
between a new request and its first step, with a penalty when its prompt would not fit in the free
KV blocks. A router also counts what it sent itself until the reports count it
(:class:`SentSinceReport`), so a burst does not all land on the replica that looked emptiest at the
last report.

Pure Python, no Ray: unit-tested directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: What one running request costs a new one, in requests waiting ahead: it shares every step with
#: it (a step's time grows with its batch). A quarter: a burst spreads over idle replicas, and a
#: prompt's shared system prompt alone (a block or two) does not outweigh a busier batch, while a
#: conversation's cached history (hundreds of tokens) does.
BUSY_WEIGHT = 0.25
#: Score of a replica whose waiting queue cannot take the request: it would answer 429.
FULL = 1e9


@dataclass(frozen=True)
class ReplicaLoad:
    """An engine replica's scheduler state, as last reported."""

    num_waiting: int
    num_running: int
    max_num_seqs: int
    num_free_blocks: int
    block_size: int
    max_waiting: int
    #: Reports are numbered so the router knows when its own count of sends is superseded.
    seq: int = 0

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> ReplicaLoad | None:
        if not stats or "num_waiting" not in stats:
            return None
        return cls(num_waiting=int(stats["num_waiting"]), num_running=int(stats["num_running"]),
                   max_num_seqs=int(stats["max_num_seqs"]), num_free_blocks=int(stats["num_free_blocks"]),
                   block_size=int(stats["block_size"]), max_waiting=int(stats["max_waiting"]),
                   seq=int(stats.get("seq", 0)))


def start_cost(load: ReplicaLoad | None, *, prompt_tokens: int, n: int = 1, sent_since_report: int = 0) -> float:
    """Roughly how many requests must finish before this one can start on the replica.

    0 means it joins the batch at the next step. A replica that has not reported yet (it has just
    started) counts as empty but for what this router sent it, each send weighing what a running
    request does. Not Serve's count of calls open on it: for an engine those are mostly the
    consumers' long-lived channels, so a new replica with one channel looked busier than a
    reporting one with a whole batch, and a burst that came before its first report skipped it.
    """
    if load is None:
        return sent_since_report * BUSY_WEIGHT
    queued = load.num_waiting + sent_since_report
    if queued + n > load.max_waiting:
        return FULL
    free_slots = max(0, load.max_num_seqs - load.num_running)
    ahead = max(0, queued + n - free_slots)
    # A prompt that does not fit in the free blocks waits for running requests to finish (or
    # preempts one): count it as a whole batch ahead.
    blocks_needed = math.ceil((prompt_tokens + 1) / max(load.block_size, 1))
    kv_penalty = load.max_num_seqs if blocks_needed > load.num_free_blocks else 0
    # Each request in the batch or sent and not yet reported counts BUSY_WEIGHT; ties go to the
    # replica with more free blocks.
    busy = (load.num_running + queued) * BUSY_WEIGHT
    return ahead + kv_penalty + busy - load.num_free_blocks * 1e-6


class SentSinceReport:
    """What this router sent each replica that its reports may not count yet.

    Reports are numbered. A send counts until the replica has published two reports after it: the
    first of them may have been taken while the request was still on its way (the router sees a
    new report and the send in either order), the second was taken a whole report period later.
    Counting only until the first newer report let a burst's sends vanish from the count before
    the replica had them, and the next requests of the burst went to it as if it were idle."""

    def __init__(self) -> None:
        #: replica id → the number of the report last seen (-1: none yet)
        self._seen: dict[str, int] = {}
        #: replica id → {number of the report last seen when sent: requests sent} (at most two keys
        #: once the replica reports; one while it has not)
        self._sent: dict[str, dict[int, int]] = {}

    def count(self, replica: str, report_seq: int | None) -> int:
        """Requests sent that the report numbered ``report_seq`` (``None``: no report yet) may not count."""
        sent = self._sent.get(replica, {})
        if report_seq is not None and report_seq != self._seen.get(replica, -1):
            self._seen[replica] = report_seq
            for seq in [seq for seq in sent if report_seq > seq + 1]:
                del sent[seq]
        return sum(sent.values())

    def add(self, replica: str, n: int) -> None:
        sent = self._sent.setdefault(replica, {})
        seq = self._seen.get(replica, -1)
        sent[seq] = sent.get(seq, 0) + n
