"""The Serve request routers of the Engine and Egress hops: thin adapters over the pure rules.

:class:`EngineRouter` runs inside every caller's handle to the Engine (an Egress replica's). For an
:class:`~stages.transport.messages.AdmissionBatch` it reads each candidate's routing stats (its
scheduler state, :mod:`stages.routing.load`, and its prefix-cache summary,
:mod:`stages.routing.prefix`), orders the replicas by the configured policy
(:mod:`stages.routing.policy`), and stamps each request with a
:class:`~stages.transport.messages.RouteNote`: the replica chosen, the tokens it expects cached
there, and the best alternative with its score. The engine puts the note on the request's span and
Egress on its summary, beside the engine's actual hit. Routing costs O(prompt blocks) per request
and calls no engine.

Some messages are routed by name:
- :class:`AbortRequest` goes to exactly the replica it names (abort by id must reach the owner),
  and so does :class:`ChannelAttach` (a consumer's channel to the replica running its requests).
- :class:`EngineRequest.avoid_replicas` lists replicas that already refused the request with a
  full queue; they are tried last, so a 429 is retried elsewhere first.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Hashable
from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from stages.config import RoutingSettings
from stages.routing.load import BUSY_WEIGHT, ReplicaLoad, SentSinceReport, start_cost
from stages.routing.policy import Candidate, Policy, rank
from stages.routing.prefix import PrefixViews
from stages.transport.messages import (
    AbortRequest,
    AdmissionBatch,
    ChannelAttach,
    DetachRequest,
    EngineRequest,
    ResumeRequest,
    RouteNote,
)

#: Seconds between two routing reports of a replica (Serve calls ``record_routing_stats``).
ROUTING_STATS_PERIOD_S = 1.0

#: The routers' picture of the engines' caches, one per process: the Egress replica's admission
#: queue reads it too, to batch together only requests whose cache is in the same place.
VIEWS = PrefixViews()


def engine_router_config(settings: RoutingSettings | None = None) -> RequestRouterConfig:
    """The Engine deployment's router, configured by the app's ``routing`` section."""
    s = settings if settings is not None else RoutingSettings()
    return RequestRouterConfig(
        request_router_class="stages.routing.router.EngineRouter",
        request_router_kwargs={"policy": s.policy, "prefill_tokens_per_request": s.prefill_tokens_per_request},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S, request_routing_stats_timeout_s=5.0)


def home_min_tokens(prefill_tokens_per_request: float) -> float:
    """How many more cached tokens than anywhere else make a replica a request's cache home: what
    one running request costs in the router's score (``BUSY_WEIGHT`` requests, each worth
    ``prefill_tokens_per_request`` tokens of prefill). A smaller lead, such as the chat template's
    system prompt cached on one replica only, never outweighs a single request of load, so the
    router would spread such requests by load; grouping them by that home would instead put a
    burst of new conversations into one submit call, to one replica."""
    return BUSY_WEIGHT * prefill_tokens_per_request


#: Set from the Engine router's config when it starts (it shares this process with the admission).
_home_lead = home_min_tokens(RoutingSettings().prefill_tokens_per_request)


def cache_home(request: EngineRequest, views: PrefixViews = VIEWS, min_lead: float | None = None) -> str | None:
    """The replica that holds at least ``min_lead`` (:func:`home_min_tokens`) more of
    ``request``'s prompt than any other, if one does."""
    hashes: dict[int, list[int]] = {}
    hits = {r: views.cached_tokens(r, request.prompt_token_ids, hashes) for r in views.replicas()}
    if len(hits) < 2:
        return None
    best = max(hits, key=hits.__getitem__)
    runner_up = max(v for r, v in hits.items() if r != best)
    return best if hits[best] - runner_up >= (_home_lead if min_lead is None else min_lead) else None


_spread = itertools.count()


def refresh_views() -> int:
    """Bring :data:`VIEWS` up to the engines' latest cache summaries, as Serve last received them,
    and return how many engine replicas the routers know (0 before any has routed). The routers
    update the views when they route, but a process that routed nothing for a while (another
    Egress replica took the last turn) would group requests by homes that are seconds old."""
    from stages.routing.live_routers import ROUTERS

    known = 0
    for router in ROUTERS:
        known = max(known, len(router.curr_replicas))
        for replica in router.curr_replicas.values():
            VIEWS.update(replica.replica_id.unique_id, (replica.routing_stats or {}).get("prefix"))
    return known


def placement_key(request: EngineRequest) -> Hashable:
    """Which requests may share one submit call (one call goes to one replica): those with the same
    cache home; the others are dealt round-robin into one group per engine replica, so a burst of
    new conversations is spread by load instead of landing on one replica in one call."""
    replicas = refresh_views()
    home = cache_home(request)
    if home is not None:
        return ("home", home)
    # As many groups as replicas, counted from Serve's replica set: a replica that has not
    # published a cache summary yet (just started) has no view but must get its share of a burst.
    # Before this process has routed anything it knows no replica count: assume more than one.
    return ("spread", next(_spread) % (replicas or 2))


class EngineRouter(RequestRouter):
    """Serve ``RequestRouter`` for the Engine deployment (runs inside every caller's handle)."""

    def initialize_state(self, policy: str = Policy.CACHE_AWARE.value, prefill_tokens_per_request: int = 256,
                         **_: Any) -> None:
        global _home_lead
        self.policy = Policy(policy)
        _home_lead = home_min_tokens(prefill_tokens_per_request)
        #: The process's picture of the engines' caches (shared with the admission batching).
        self.views = VIEWS
        self.prefill_tokens_per_request = prefill_tokens_per_request
        self._sent = SentSinceReport()
        self._turn = itertools.count()
        self._rng = random.Random()
        # Imported here, not at the top: Serve may pickle this class by value, and a global it
        # refers to (a list of live routers, with their futures) must not come along.
        from stages.routing.live_routers import ROUTERS

        ROUTERS.append(self)

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
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for rid, r in by_id.items():
            self.views.update(rid, (r.routing_stats or {}).get("prefix"))
        self.views.retain(by_id)
        # A batch is placed as one request of its total size; its requests share the replicas to
        # avoid and, under the cache-aware policy, their cache home (the admission key groups them).
        prompt_tokens, n = sum(len(r.prompt_token_ids) for r in requests), sum(r.n for r in requests)
        avoid = set(requests[0].avoid_replicas)
        hashes = [dict[int, list[int]]() for _ in requests]
        cached: dict[str, list[int]] = {}
        candidates = []
        for rid, r in by_id.items():
            load = ReplicaLoad.from_stats(r.routing_stats)
            cost = start_cost(load, prompt_tokens=prompt_tokens, n=n, sent_since_report=self._sent_since(rid, load))
            # Engines of one deployment share a block size: a replica that has not reported yet
            # gets the others'.
            self.views.expect(rid, load.block_size if load is not None else self.views.block_size())
            cached[rid] = [self.views.cached_tokens(rid, req.prompt_token_ids, h) for req, h in zip(requests, hashes, strict=True)]
            candidates.append(Candidate(rid, cost, sum(cached[rid]), rid in avoid))
        order = rank(candidates, policy=self.policy, prompt_tokens=prompt_tokens,
                     prefill_tokens_per_request=self.prefill_tokens_per_request, turn=next(self._turn), rng=self._rng)
        best, alt = order[0], (order[1] if len(order) > 1 else None)
        for i, req in enumerate(requests):
            req.route = RouteNote(best.replica, self.policy.value, best.score, cached[best.replica][i],
                                  alt.replica if alt else None, alt.score if alt else None,
                                  cached[alt.replica][i] if alt else 0)
            # Counted now, not when Serve confirms the send (a round trip later): calls routed
            # meanwhile must see this one, or a burst of calls all pick the same replica.
            self._sent.add(best.replica, req.n)
            self.views.sent(best.replica, req.prompt_token_ids)
        return [[by_id[c.replica]] for c in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """The call went to another replica than the first choice (it was busy): count it there."""
        rid = replica_id.unique_id
        for msg in _engine_requests(pending_request.args[0] if pending_request.args else None):
            if msg.route is not None and msg.route.replica != rid:
                self._sent.add(rid, msg.n)
                self.views.sent(rid, msg.prompt_token_ids)

    def _sent_since(self, rid: str, load: ReplicaLoad | None) -> int:
        return self._sent.count(rid, load.seq if load is not None else None)


def _engine_requests(msg: Any) -> list[EngineRequest]:
    """The engine requests a call carries: a batch's, or none (every other message)."""
    if isinstance(msg, AdmissionBatch):
        return [r for r in msg.items if isinstance(r, EngineRequest)]
    return []


class EgressRouter(RequestRouter):
    """Serve ``RequestRouter`` for Egress: an Ingress replica's :class:`ChannelAttach`, its
    :class:`AbortRequest` (ending jobs it gave up on), :class:`DetachRequest` and
    :class:`ResumeRequest` (a resumable stream's client left, or came back) go to the Egress
    replica they name.

    An :class:`AdmissionBatch` of jobs goes to the replica running the fewest: once their
    ``submit`` call has returned, jobs are no longer Serve requests, so Serve's queue lengths (what
    its default router compares) count only attaches and calls in flight. Each replica reports its
    running jobs (``record_routing_stats``); between reports the router adds what it sent itself.
    Every other call goes to the least busy replica by Serve's queue lengths."""

    def initialize_state(self, **_: Any) -> None:
        self._sent = SentSinceReport()
        # Imported here: Serve may pickle this class by value (see EngineRouter.initialize_state).
        from stages.transport.membership import register_router

        register_router(self)  # an Ingress moves a stream only when another replica is there

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        msg = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if isinstance(msg, ChannelAttach | AbortRequest | DetachRequest | ResumeRequest):
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
