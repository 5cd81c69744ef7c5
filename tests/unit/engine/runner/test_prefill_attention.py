"""Prompt chunks' attention: the mask, the result against a plain softmax, the measured dtype."""

from __future__ import annotations

import time

import pytest
import torch

from stages.engine.runner import prefill_attention
from stages.engine.runner.prefill_attention import chunk_attention, chunk_mask, fastest_dtype

HEADS, KV_HEADS, D = 6, 2, 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Float64 attention of rows at positions ``start..`` over ``k``/``v``, query head h reading KV
    head h // group, each row seeing the positions up to its own."""
    rows, ctx = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    kk = k.double().repeat_interleave(group, dim=1)  # [ctx, heads, d]
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * D ** -0.5
    hidden = torch.arange(ctx)[None, :] > torch.arange(start, start + rows)[:, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


def test_a_chunk_from_position_zero_needs_no_mask():
    assert chunk_mask(0, 8, torch.float32, torch.device("cpu")) is None


def test_the_mask_shows_each_row_its_context_and_hides_later_rows():
    mask = chunk_mask(5, 3, torch.float32, torch.device("cpu"))
    assert mask.shape == (3, 8)
    visible = mask == 0
    # Row i sits at position 5 + i: it sees positions 0 .. 5 + i and nothing after.
    assert visible.sum(1).tolist() == [6, 7, 8]
    assert torch.isinf(mask[0, 6:]).all() and torch.isinf(mask[1, 7:]).all()
    assert mask.dtype == torch.float32


@pytest.mark.parametrize("start,rows", [(0, 7), (9, 5), (33, 17)])
def test_a_chunk_attends_like_a_plain_softmax(start, rows):
    gen = torch.Generator().manual_seed(start + rows)
    q = torch.randn(rows, HEADS, D, generator=gen)
    k = torch.randn(start + rows, KV_HEADS, D, generator=gen)
    v = torch.randn(start + rows, KV_HEADS, D, generator=gen)
    out = chunk_attention(q, k, v, chunk_mask(start, rows, torch.float32, q.device), D ** -0.5)
    assert out.shape == (rows, HEADS, D)
    torch.testing.assert_close(out.double(), reference(q, k, v, start), atol=1e-5, rtol=1e-5)


def test_bfloat16_stays_close_to_the_float_result():
    gen = torch.Generator().manual_seed(1)
    start, rows = 40, 24
    q = torch.randn(rows, HEADS, D, generator=gen)
    k = torch.randn(start + rows, KV_HEADS, D, generator=gen)
    v = torch.randn(start + rows, KV_HEADS, D, generator=gen)
    bf = torch.bfloat16
    out = chunk_attention(q.to(bf), k.to(bf), v.to(bf), chunk_mask(start, rows, bf, q.device), D ** -0.5)
    assert out.dtype == bf
    torch.testing.assert_close(out.double(), reference(q, k, v, start), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("model,cache", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_no_choice_without_a_bfloat16_cache_under_a_float_model(model, cache):
    assert fastest_dtype(model, cache, HEADS, KV_HEADS, D, threads=1) == model


@pytest.mark.parametrize("slow", [torch.bfloat16, torch.float32])
def test_the_faster_dtype_is_chosen(monkeypatch, slow):
    real = prefill_attention.chunk_attention

    def timed(q, *a):  # the slow dtype takes 5 ms longer
        if q.dtype == slow:
            time.sleep(0.005)
        return real(q, *a)

    monkeypatch.setattr(prefill_attention, "chunk_attention", timed)
    chosen = fastest_dtype(torch.float32, torch.bfloat16, HEADS, KV_HEADS, D, threads=1, repeats=2)
    assert chosen == (torch.float32 if slow == torch.bfloat16 else torch.bfloat16)
