"""Which engine replica gets a request: the one that can start it soonest.

Serve's default router (power of two choices) looks only at how many calls each replica has open.
For an engine that number says little: a replica with 40 open streams and an empty waiting queue
starts a new request at its next step, while one with 10 streams, a full batch and 6 waiting
makes it wait for 6 others to finish. So each engine replica reports its scheduler state through
Serve's ``record_routing_stats`` (every ``request_routing_stats_period_s``), and
:func:`start_cost` turns that into an estimate of how many requests stand between a new request
and its first step, with a penalty when its prompt would not fit in the free KV blocks.

Between two reports the router counts what it sent itself, so a burst does not all land on the
replica that looked emptiest at the last report. Requests sharing a prompt prefix prefer the
replica that saw it last (its blocks are likely still cached) unless that replica is busier by
more than ``affinity_slack`` requests.

Some messages are routed specially:
- :class:`AbortRequest` goes to exactly the replica it names (abort by id must reach the owner),
  and so does :class:`ChannelAttach` (a consumer's channel to the replica running its requests).
- :class:`EngineRequest.avoid_replicas` lists replicas that already refused the request with a
  full queue; they are tried last, so a 429 is retried elsewhere first.

The pure parts (:class:`ReplicaLoad`, :func:`start_cost`, :func:`rank`) are unit-tested without
Ray; :class:`EngineRouter` is the thin Serve adapter.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from stages.transport.messages import AbortRequest, AdmissionBatch, ChannelAttach, EngineRequest

#: Score of a replica whose waiting queue cannot take the request: it would answer 429.
FULL = 1e9
#: Prompt tokens hashed for prefix affinity (the chat template's system prompt and a bit more).
AFFINITY_TOKENS = 64


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


def start_cost(load: ReplicaLoad | None, *, prompt_tokens: int, n: int = 1, sent_since_report: int = 0,
               ongoing: int | None = None) -> float:
    """Roughly how many requests must finish before this one can start on the replica.

    0 means it joins the batch at the next step. Without a report yet, fall back to the number of
    calls open on the replica (Serve's own queue-length probe), which is what Serve would use.
    """
    if load is None:
        return float(ongoing or 0) + sent_since_report
    queued = load.num_waiting + sent_since_report
    if queued + n > load.max_waiting:
        return FULL
    free_slots = max(0, load.max_num_seqs - load.num_running)
    ahead = max(0, queued + n - free_slots)
    # A prompt that does not fit in the free blocks waits for running requests to finish (or
    # preempts one): count it as a whole batch ahead.
    blocks_needed = math.ceil((prompt_tokens + 1) / max(load.block_size, 1))
    kv_penalty = load.max_num_seqs if blocks_needed > load.num_free_blocks else 0
    # Ties (e.g. two idle replicas) go to the one with more free blocks.
    return ahead + kv_penalty - load.num_free_blocks * 1e-6


def rank(costs: dict[str, float], *, avoid: set[str] = frozenset(), preferred: str | None = None,  # type: ignore[assignment]
         affinity_slack: float = 1.0) -> list[str]:
    """Replica ids from best to worst. ``avoid`` go last; ``preferred`` (prefix affinity) goes
    first when its cost is within ``affinity_slack`` of the best."""
    order = sorted(costs, key=lambda r: (r in avoid, costs[r]))
    if preferred in costs and preferred not in avoid and order:
        best = costs[order[0]]
        if costs[preferred] < FULL and costs[preferred] <= best + affinity_slack:
            order.remove(preferred)
            order.insert(0, preferred)
    return order


def prefix_key(token_ids: list[int]) -> int | None:
    """Affinity key of a prompt: a hash of its first tokens (``None`` when too short to matter)."""
    if len(token_ids) < 16:
        return None
    return hash(tuple(token_ids[:AFFINITY_TOKENS]))


class EngineRouter(RequestRouter):
    """Serve ``RequestRouter`` for the Engine deployment (runs inside every caller's handle)."""

    def initialize_state(self, affinity_slack: float = 1.0, affinity_entries: int = 4096, **_: Any) -> None:
        self.affinity_slack = affinity_slack
        self.affinity_entries = affinity_entries
        self._affinity: OrderedDict[int, str] = OrderedDict()
        self._sent = SentSinceReport()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        msg = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if isinstance(msg, AbortRequest | ChannelAttach):
            target = [r for r in candidate_replicas if r.replica_id.unique_id == msg.replica]
            # The owner is gone (its requests went with it): any replica answers an abort's no-op,
            # and an attach that lands elsewhere says so in its first item (its replica's name).
            return [target or candidate_replicas[:1]]
        requests = _engine_requests(msg)
        if not requests:
            return [candidate_replicas]
        # A batch (stages.transport.admission) is placed as one request of its total size; its requests
        # share the replicas to avoid (the batching groups by them), and the first one's prefix
        # picks the affinity.
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        prompt_tokens, n = sum(len(r.prompt_token_ids) for r in requests), sum(r.n for r in requests)
        costs = {}
        for rid, r in by_id.items():
            load = ReplicaLoad.from_stats(r.routing_stats)
            costs[rid] = start_cost(load, prompt_tokens=prompt_tokens, n=n,
                                    sent_since_report=self._sent_since(rid, load),
                                    ongoing=self.replica_queue_len_cache.get(r.replica_id))
        key = prefix_key(requests[0].prompt_token_ids)
        preferred = self._affinity.get(key) if key is not None else None
        order = rank(costs, avoid=set(requests[0].avoid_replicas), preferred=preferred,
                     affinity_slack=self.affinity_slack)
        return [[by_id[rid]] for rid in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        requests = _engine_requests(pending_request.args[0] if pending_request.args else None)
        rid = replica_id.unique_id
        for msg in requests:
            self._sent.add(rid, msg.n)
            key = prefix_key(msg.prompt_token_ids)
            if key is not None:
                self._affinity[key] = rid
                self._affinity.move_to_end(key)
                while len(self._affinity) > self.affinity_entries:
                    self._affinity.popitem(last=False)

    def _sent_since(self, rid: str, load: ReplicaLoad | None) -> int:
        return self._sent.count(rid, load.seq if load is not None else None)


class SentSinceReport:
    """What this router sent each replica since that replica's last report. Reports are numbered:
    a report with a new number already counts what was sent before it, so the count restarts."""

    def __init__(self) -> None:
        #: replica id → (number of the report last seen, requests sent since)
        self._sent: dict[str, tuple[int, int]] = {}

    def count(self, replica: str, report_seq: int | None) -> int:
        """Requests sent since the report numbered ``report_seq`` (``None``: no report yet)."""
        seq, sent = self._sent.get(replica, (-1, 0))
        if report_seq is not None and report_seq != seq:
            self._sent[replica] = (report_seq, 0)
            return 0
        return sent

    def add(self, replica: str, n: int) -> None:
        seq, sent = self._sent.get(replica, (-1, 0))
        self._sent[replica] = (seq, sent + n)


def _engine_requests(msg: Any) -> list[EngineRequest]:
    """The engine requests a call carries: a batch's, or none (every other message)."""
    if isinstance(msg, AdmissionBatch):
        return [r for r in msg.items if isinstance(r, EngineRequest)]
    return []


class EgressRouter(RequestRouter):
    """Serve ``RequestRouter`` for Egress: an Ingress replica's :class:`ChannelAttach` and its
    :class:`AbortRequest` (ending jobs it gave up on) go to the Egress replica they name.

    An :class:`AdmissionBatch` of jobs goes to the replica running the fewest: once their
    ``submit`` call has returned, jobs are no longer Serve requests, so Serve's queue lengths (what
    its default router compares) count only attaches and calls in flight. Each replica reports its
    running jobs (``record_routing_stats``); between reports the router adds what it sent itself.
    Every other call goes to the least busy replica by Serve's queue lengths."""

    def initialize_state(self, **_: Any) -> None:
        self._sent = SentSinceReport()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        msg = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if isinstance(msg, ChannelAttach | AbortRequest):
            target = [r for r in candidate_replicas if r.replica_id.unique_id == msg.replica]
            return [target or candidate_replicas[:1]]  # elsewhere: its first item says so; a no-op
        if not isinstance(msg, AdmissionBatch) or len(candidate_replicas) < 2:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {}
        for rid, r in by_id.items():
            # Before its first report a replica counts what we sent it: a new one is likely empty.
            stats = r.routing_stats or {}
            seq = int(stats["seq"]) if "admitted_jobs" in stats else None
            loads[rid] = float(stats.get("admitted_jobs", 0)) + self._sent.count(rid, seq)
        return [[by_id[rid]] for rid in sorted(loads, key=loads.__getitem__)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        msg = pending_request.args[0] if pending_request.args else None
        if isinstance(msg, AdmissionBatch):
            self._sent.add(replica_id.unique_id, len(msg.items))
