"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, an LRU free list, prefix cache.

Pure Python on ints and lists (no torch): the model runner owns the tensors, this module only
decides which block ids a request's tokens live in.

Prefix caching: a *full* block is identified by a hash chained through its parent block's hash,
``hash((parent_hash, tuple(token_ids)))``, so equal hashes imply equal prefixes up to collisions,
and every hit is confirmed by its token ids and its parent block (the block registered for the
previous hash, whichever request computed it). A freed block keeps its hash and
contents and stays findable until it is reused; the free list is ordered so that the least recently
freed block is reused first (LRU reclaim), and a request frees its blocks tail first, so a prompt's
head, the part most likely to be shared, survives longest.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from stages.engine.core.request import Request

#: Hash of the (virtual) parent of a request's first block.
ROOT_HASH = 0
#: ``Block.parent_block_id`` of a registered first block.
NO_PARENT = -1


@dataclass
class Block:
    """One KV block: its id, reference count and, when full and cached, its chained hash."""

    block_id: int
    ref_count: int = 0
    #: Chained hash of this block's prefix; ``None`` while the block is not registered.
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    #: Block that held the previous block of the prefix when this one was registered
    #: (``NO_PARENT`` for a first block); a hit must follow the same chain of blocks.
    parent_block_id: int | None = None


def chain_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given its parent's hash (deterministic for ints across processes)."""
    return hash((parent_hash, token_ids))


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters in tokens, as vLLM reports them."""

    queries: int = 0
    hits: int = 0


@dataclass
class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens each."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.blocks: list[Block] = [Block(i) for i in range(self.num_blocks)]
        # Blocks with ref_count 0, least recently freed first. Cached ones stay findable here.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self._hash_to_block: dict[int, int] = {}
        #: Bumped whenever a hash enters or leaves the prefix cache (what a published summary of
        #: the cache is compared against).
        self.cache_version = 0

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or reclaimable from the prefix cache)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or reclaimable)."""
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests (0.0 to 1.0)."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_hashes(self) -> list[int]:
        """The chained hash of every block in the prefix cache (what the engine tells routers)."""
        return list(self._hash_to_block)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks required to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------
    def _update_hashes(self, request: Request) -> list[int]:
        """Extend ``request.block_hashes`` to cover every full block of its tokens."""
        hashes: list[int] = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), len(tokens) // bs):
            parent = chain_hash(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request's tokens.

        Never covers the last token: it must be computed to produce logits. Counting is left to
        :meth:`record_lookup`, called once the request is actually admitted.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self._update_hashes(request)
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hit: list[int] = []
        for i in range(min(max_blocks, len(hashes))):
            block_id = self._hash_to_block.get(hashes[i])
            if block_id is None:
                break
            # Confirm by token ids and by the parent block: a hash collision must never serve
            # another prompt's KV (equal tokens at another position or after another prefix).
            block = self.blocks[block_id]
            if block.token_ids != tuple(request.all_token_ids[i * bs:(i + 1) * bs]):
                break
            if block.parent_block_id != (hit[-1] if hit else NO_PARENT):
                break
            hit.append(block_id)
        return hit

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup (in tokens, as vLLM's counters do)."""
        if self.enable_prefix_caching:
            self.stats.queries += num_query_tokens
            self.stats.hits += num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self._update_hashes(request)
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(request.block_table))
        chain = request.chain_blocks
        for i in range(len(chain), num_full):
            block = self.blocks[request.block_table[i]]
            h = hashes[i]
            tokens = tuple(request.all_token_ids[i * bs:(i + 1) * bs])
            parent = chain[i - 1] if i else NO_PARENT
            if block.block_hash is None and h not in self._hash_to_block:
                block.block_hash = h
                block.token_ids = tokens
                block.parent_block_id = parent
                self._hash_to_block[h] = block.block_id
                self.cache_version += 1
            chain.append(self._found_at(h, tokens, parent, block.block_id))

    def _found_at(self, block_hash: int, tokens: tuple[int, ...], parent: int, own: int) -> int:
        """The block a lookup of this prefix finds at this level: the registered one when it holds
        these tokens after the same parent, else the request's own. Another request may have
        computed a shared block first (two prompts with one system prompt, both scheduled before
        either cached it); the blocks registered after it must name the copy a lookup finds as
        their parent, or everything after the shared prefix could never be found."""
        registered = self._hash_to_block.get(block_hash)
        if (registered is not None and self.blocks[registered].token_ids == tokens
                and self.blocks[registered].parent_block_id == parent):
            return registered
        return own

    # -- allocation -----------------------------------------------------------------------------
    def _take_free(self) -> Block:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # reclaiming a cached block: it leaves the cache
            del self._hash_to_block[block.block_hash]
            self.cache_version += 1
            block.block_hash = None
            block.token_ids = ()
            block.parent_block_id = None
        block.ref_count = 1
        return block

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[int] | None = None) -> bool:
        """Make the block table cover ``num_computed_tokens + num_new_tokens`` tokens.

        ``cached_blocks`` (from :meth:`find_cached_prefix`) are prepended to an empty block table
        and shared by reference count. Returns False, changing nothing, when blocks are short.
        """
        cached_blocks = cached_blocks or []
        existing = len(request.block_table) + len(cached_blocks)
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - existing
        # Cached blocks sitting in the free list are taken out of it by the touch below.
        reclaimable_hits = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if max(needed, 0) > len(self._free) - reclaimable_hits:
            return False
        for block_id in cached_blocks:
            self._touch(block_id)
        request.block_table.extend(cached_blocks)
        for _ in range(max(needed, 0)):
            request.block_table.append(self._take_free().block_id)
        return True

    def free(self, request: Request) -> None:
        """Drop the request's references, tail block first; blocks at ref 0 become reclaimable."""
        for block_id in reversed(request.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        request.block_table = []
        request.chain_blocks = []

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = ()
            block.parent_block_id = None
        self._hash_to_block.clear()
        self.cache_version += 1

    def check_invariants(self, live: list[Request]) -> None:
        """Assert the bookkeeping is consistent with the given live requests (used by tests)."""
        refs = [0] * self.num_blocks
        for req in live:
            for b in req.block_table:
                refs[b] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (block, refs[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in self._free), block
        for h, b in self._hash_to_block.items():
            assert self.blocks[b].block_hash == h
