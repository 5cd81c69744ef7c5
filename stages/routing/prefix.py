"""What each engine replica has cached, as one process's routers see it.

Every engine replica publishes a :class:`~stages.transport.messages.PrefixSummary` with its routing
stats: the chained hashes of the full blocks in its prefix cache. The router hashes a prompt the
same way (:func:`prompt_block_hashes`, the block manager's own :func:`chain_hash`), on the caller's
side where the token ids already are, so the tokens a replica has cached of a prompt are its
longest run of leading blocks found there (:meth:`PrefixViews.cached_tokens`).

A summary is up to a report period old. Two things keep the guess close:

- the router adds the blocks of each prompt it sends a replica to that replica's view at once
  (their KV will be there once prefilled), so a conversation's next turn follows its last one even
  before the replica reports again; these additions are dropped once the replica has published
  two newer summaries, by when the summary itself says whether they are still cached;
- a hit is counted only up to the prompt's last token, which the engine always recomputes.

What stays wrong (blocks evicted since the last summary, another router's sends) is measured, not
hidden: each request's expected hit travels with it (:class:`~stages.transport.messages.RouteNote`)
beside the engine's actual one.

Memory per replica: one set of at most ``num_kv_blocks`` ints, plus at most ``max_recent`` added
hashes. Pure Python, no Ray: unit-tested directly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from stages.engine.core.block_manager import ROOT_HASH, chain_hash
from stages.transport.messages import PrefixSummary

#: Hashes added from sends, per replica, at most (about 4 KB of prompts' blocks each).
DEFAULT_MAX_RECENT = 4096


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The short (32-bit) chained hash of each full block of ``token_ids`` that could be a cache
    hit: blocks ending before the last token, which is always computed."""
    out = []
    parent = ROOT_HASH
    for i in range((len(token_ids) - 1) // block_size):
        parent = chain_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(PrefixSummary.short(parent))
    return out


@dataclass
class ReplicaView:
    """One replica's cache as last published, plus what was sent it since."""

    version: int = -1
    block_size: int = 0
    published: frozenset[int] = frozenset()
    #: short hash → the number of summaries seen when it was added (oldest first).
    recent: OrderedDict[int, int] = field(default_factory=OrderedDict)
    #: Summaries seen (a new version counts one).
    summaries: int = 0

    def __contains__(self, short_hash: int) -> bool:
        return short_hash in self.published or short_hash in self.recent


class PrefixViews:
    """The routers' picture of every engine replica's prefix cache (see the module docstring)."""

    def __init__(self, max_recent: int = DEFAULT_MAX_RECENT) -> None:
        self.max_recent = max_recent
        self._views: dict[str, ReplicaView] = {}

    def update(self, replica: str, summary: PrefixSummary | None) -> None:
        """Take ``replica``'s latest summary (a repeat of the same version changes nothing)."""
        if summary is None:
            return
        view = self._views.setdefault(replica, ReplicaView())
        if summary.version == view.version and summary.block_size == view.block_size:
            return
        view.version, view.block_size = summary.version, summary.block_size
        view.published = summary.hash_set()
        view.summaries += 1
        while view.recent and next(iter(view.recent.values())) <= view.summaries - 2:
            view.recent.popitem(last=False)

    def expect(self, replica: str, block_size: int) -> None:
        """Keep a view of ``replica`` before its first summary, so that what is sent it counts
        (:meth:`sent`): a conversation started on a replica that has just come up must find its
        way back there."""
        if block_size <= 0:
            return
        view = self._views.setdefault(replica, ReplicaView())
        if view.block_size <= 0:
            view.block_size = block_size

    def block_size(self) -> int:
        """The block size of the replicas seen (0 before any)."""
        return next((v.block_size for v in self._views.values() if v.block_size > 0), 0)

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget replicas that are gone."""
        keep = set(replicas)
        for replica in [r for r in self._views if r not in keep]:
            del self._views[replica]

    def replicas(self) -> list[str]:
        return list(self._views)

    def cached_tokens(self, replica: str, token_ids: list[int],
                      hashes: dict[int, list[int]] | None = None) -> int:
        """Prompt tokens expected cached on ``replica``. ``hashes`` memoises the prompt's block
        hashes per block size across replicas."""
        view = self._views.get(replica)
        if view is None or view.block_size <= 0:
            return 0
        if hashes is None:
            hashes = {}
        blocks = hashes.get(view.block_size)
        if blocks is None:
            blocks = hashes[view.block_size] = prompt_block_hashes(token_ids, view.block_size)
        hit = 0
        for h in blocks:
            if h not in view:
                break
            hit += 1
        return hit * view.block_size

    def sent(self, replica: str, token_ids: list[int]) -> None:
        """``token_ids`` went to ``replica``: expect their blocks there from now on."""
        view = self._views.get(replica)
        if view is None or view.block_size <= 0:
            return
        for h in prompt_block_hashes(token_ids, view.block_size):
            if h in view.published:
                continue
            view.recent[h] = view.summaries
            view.recent.move_to_end(h)
        while len(view.recent) > self.max_recent:
            view.recent.popitem(last=False)

    def num_hashes(self) -> int:
        """Hashes held for every replica together (the memory this costs, in ints)."""
        return sum(len(v.published) + len(v.recent) for v in self._views.values())
