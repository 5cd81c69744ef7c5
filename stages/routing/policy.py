"""The rule that orders engine replicas for a request, as pure functions.

Cache-aware (the default): a replica's score is how long the request would wait there, in requests,
plus the prompt tokens it would have to compute there, in requests' worth of prefill::

    score = start_cost + (prompt_tokens - expected_cached_tokens) / prefill_tokens_per_request

Lowest score first. ``start_cost`` (:mod:`stages.routing.load`) counts the requests that must
finish before this one starts on the replica, and is :data:`~stages.routing.load.FULL` when its
waiting queue cannot take the request: such a replica stays last whatever it has cached, since it
would answer 429. ``prefill_tokens_per_request`` (config ``routing.prefill_tokens_per_request``)
is the one knob: how many prompt tokens saved are worth one request waiting ahead. Smaller sends
more requests where their prefix is cached, at the cost of queueing behind others; larger spreads
the load and recomputes more. On two replicas with equal queues the cache decides; with equal
caches (a shared system prompt only) the load does.

The other policies are there to compare against and for loads with nothing to share:
``least_loaded`` (start cost only), ``power_of_two`` (Serve's default rule: the less busy of two
replicas picked at random) and ``round_robin``.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from stages.routing.load import FULL


class Policy(enum.StrEnum):
    """How the engine router orders replicas (config ``routing.policy``)."""

    CACHE_AWARE = "cache_aware"
    LEAST_LOADED = "least_loaded"
    POWER_OF_TWO = "power_of_two"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True)
class Candidate:
    """One replica as the rule sees it."""

    replica: str
    start_cost: float
    cached_tokens: int = 0
    avoid: bool = False


@dataclass(frozen=True)
class Ranked:
    """A replica in rank order, with the score that put it there (lower is better)."""

    replica: str
    score: float
    cached_tokens: int


def score(candidate: Candidate, prompt_tokens: int, prefill_tokens_per_request: float) -> float:
    """The cache-aware score of one replica (see the module docstring)."""
    if candidate.start_cost >= FULL:
        return FULL
    uncached = max(0, prompt_tokens - candidate.cached_tokens)
    return candidate.start_cost + uncached / max(prefill_tokens_per_request, 1.0)


def rank(candidates: list[Candidate], *, policy: Policy, prompt_tokens: int,
         prefill_tokens_per_request: float, turn: int = 0, rng: random.Random | None = None) -> list[Ranked]:
    """Replicas best first under ``policy``; replicas to avoid (they refused this request with a
    full queue) always go last. ``turn`` is the round-robin counter; ``rng`` picks the power-of-two
    pair and breaks exact ties."""
    if policy is Policy.CACHE_AWARE:
        scores = {c.replica: score(c, prompt_tokens, prefill_tokens_per_request) for c in candidates}
    elif policy is Policy.LEAST_LOADED:
        scores = {c.replica: c.start_cost for c in candidates}
    elif policy is Policy.ROUND_ROBIN:
        names = sorted(c.replica for c in candidates)
        scores = {r: float((i - turn) % len(names)) for i, r in enumerate(names)}
    else:  # POWER_OF_TWO: the less loaded of two at random, then the rest by load
        pair = set((rng or random).sample([c.replica for c in candidates], min(2, len(candidates))))
        scores = {c.replica: c.start_cost + (0.0 if c.replica in pair else FULL) for c in candidates}
    # Exact ties (idle replicas) are broken at random: routers in several processes that saw the
    # same reports must not all pick the same replica.
    tie = {c.replica: (rng or random).random() for c in candidates}
    order = sorted(candidates, key=lambda c: (c.avoid, scores[c.replica], tie[c.replica]))
    return [Ranked(c.replica, scores[c.replica], c.cached_tokens) for c in order]
