"""The KV pool: zeroed, one tensor per layer's K and V with no overlap, committed only where written."""

from __future__ import annotations

import torch

from stages.engine.runner import kv_pool
from stages.heap import rss_bytes


def test_every_layer_gets_its_own_zeroed_k_and_v():
    caches = kv_pool.allocate(3, (40, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert len(caches) == 3
    flat = [t for pair in caches for t in pair]
    assert all(t.shape == (40, 2, 8) and t.dtype == torch.bfloat16 and not t.any() for t in flat)
    for i, t in enumerate(flat):
        t.fill_(i + 1)
    # Each tensor still holds only its own value: no two share memory.
    assert [int(t.float().unique().item()) for t in flat] == list(range(1, 7))


def test_a_big_pool_costs_resident_memory_only_where_written():
    before = rss_bytes()
    caches = kv_pool.allocate(4, (1 << 20, 2, 32), torch.float32, torch.device("cpu"))  # 2 GiB in all
    assert rss_bytes() - before < 64 << 20
    caches[1][0][: 1 << 18].fill_(1.0)  # 64 MiB written
    grown = rss_bytes() - before
    assert 60 << 20 < grown < 128 << 20
    assert caches[1][0][(1 << 18) - 1].eq(1.0).all() and not caches[1][0][1 << 18].any()
