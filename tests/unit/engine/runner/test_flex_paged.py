"""FlexAttention over the paged cache (stages/engine/runner/flex_paged.py) and decode steps replayed over
static buffers (stages/engine/runner/decode_graphs.py).

On CPU FlexAttention compiles through inductor's C++ template, so these run here; on a GPU
``scripts/gpu_check.sh`` runs them with ``LIFECYCLE_TEST_DEVICE=cuda``, where the same code
compiles to Triton and ``decode_graphs="cuda"`` captures real CUDA graphs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from stages.config import EngineSettings
from stages.engine.core.engine import LLMEngine
from stages.engine.runner.decode_graphs import DecodeGraphs
from stages.engine.runner.flex_paged import FlexPagedAttention, row_sizes
from stages.engine.runner.model_runner import ModelRunner
from stages.model_info import EMBEDDED_MODEL, load_config
from stages.transport.messages import SamplingParams

DEVICE = torch.device(os.environ.get("LIFECYCLE_TEST_DEVICE", "cpu"))
#: What the static-buffer step runs as: real CUDA graphs on a GPU, the same buffers eagerly here.
GRAPH_MODE = "cuda" if DEVICE.type == "cuda" else "static"
#: Float32 FlexAttention against gathered SDPA. Triton's kernel uses exp2 and its own tiling, so on
#: a GPU the bound is looser than inductor's C++ template gets here (a GPU run is scarce: it must
#: not fail on rounding).
TOL = {"rtol": 1e-5, "atol": 2e-6} if DEVICE.type == "cpu" else {"rtol": 1e-4, "atol": 2e-5}


def reference(q, k_cache, v_cache, tables, ctx_lens, bs, scale):
    """Gather each row's context slots and run SDPA on them (what the sdpa path computes)."""
    outs = []
    kvh = k_cache.shape[1]
    for b, (table, n) in enumerate(zip(tables, ctx_lens, strict=True)):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)], device=q.device)
        k = k_cache[slots].to(q.dtype).transpose(0, 1)  # [kvh, n, d]
        v = v_cache[slots].to(q.dtype).transpose(0, 1)
        qq = q[b].view(kvh, -1, q.shape[-1])
        outs.append(F.scaled_dot_product_attention(qq, k, v, scale=scale).reshape(q.shape[1:]))
    return torch.stack(outs)


@pytest.fixture(scope="module")
def flex_case() -> tuple:
    g = torch.Generator().manual_seed(0)
    bs, num_blocks, kvh, d = 16, 40, 3, 64
    k_cache = torch.randn(num_blocks * bs, kvh, d, generator=g).to(DEVICE)
    v_cache = torch.randn(num_blocks * bs, kvh, d, generator=g).to(DEVICE)
    attn = FlexPagedAttention(num_blocks, bs, scratch_block=num_blocks - 1, max_rows=8, device=DEVICE)
    return attn, k_cache, v_cache, g


@pytest.mark.parametrize("ctx_lens", [[1, 16, 17, 40], [33, 5], [64, 64, 64, 64, 64, 64, 64]])
def test_rows_read_their_own_blocks_in_place(flex_case, ctx_lens) -> None:
    attn, k_cache, v_cache, g = flex_case
    bs = attn.block_size
    # Each row's blocks in no order (never the scratch block); rows 0 and 1 share their first
    # block, as two requests with a cached prefix do.
    tables = [torch.randperm(attn.scratch_block, generator=g)[:-(-n // bs)].tolist() for n in ctx_lens]
    if len(tables[1]) > 1:
        tables[1] = [tables[0][0]] + [b for b in tables[1] if b != tables[0][0]][:len(tables[1]) - 1]
    q = torch.randn(len(ctx_lens), 9, 64, generator=g).to(DEVICE)
    got = attn(q, k_cache, v_cache, attn.fill(tables, ctx_lens), 0.125)
    want = reference(q, k_cache, v_cache, tables, ctx_lens, bs, 0.125)
    torch.testing.assert_close(got, want, **TOL)


def test_padded_rows_leave_the_real_ones_alone(flex_case) -> None:
    attn, k_cache, v_cache, g = flex_case
    tables, ctx = [[3, 7], [9]], [20, 9]
    q = torch.randn(2, 9, 64, generator=g).to(DEVICE)
    alone = attn(q, k_cache, v_cache, attn.fill(tables, ctx), 0.125)
    padded_q = torch.cat([q, torch.randn(6, 9, 64, generator=g).to(DEVICE)])
    padded = attn(padded_q, k_cache, v_cache, attn.fill(tables, ctx, rows=8), 0.125)
    torch.testing.assert_close(padded[:2], alone, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(padded).all()  # a padded row reads one real slot of the scratch block
    # Row counts round up to a few sizes (one compiled kernel each); q's missing rows are zeros.
    assert [attn.rows_for(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert attn(q, k_cache, v_cache, attn.fill(tables, ctx, rows=4), 0.125).shape == q.shape
    with pytest.raises(ValueError, match="at most 8"):
        attn.fill(tables, ctx, rows=9)
    with pytest.raises(ValueError, match="at most 8"):
        attn.rows_for(9)


def test_a_bfloat16_cache_is_read_as_the_query_dtype(flex_case) -> None:
    attn, k_cache, v_cache, g = flex_case
    tables, ctx = [[4, 5, 6]], [40]
    q = torch.randn(1, 9, 64, generator=g).to(DEVICE)
    kb, vb = k_cache.bfloat16(), v_cache.bfloat16()
    got = attn(q, kb, vb, attn.fill(tables, ctx), 0.125)
    assert got.dtype == torch.float32
    want = reference(q.bfloat16().float(), kb, vb, tables, ctx, attn.block_size, 0.125)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_the_mask_alone_is_exact_so_uncompiled_flex_attention_agrees(flex_case) -> None:
    """Uncompiled FlexAttention (what torch falls back to past dynamo's recompile limit) ignores
    the block lists and applies the mask to every slot of the cache: the mask itself must keep
    each row to its own blocks. Before it read a per-block table it let every row see every block
    (error ~1 against the reference)."""
    _, k_cache, v_cache, g = flex_case
    eager = FlexPagedAttention(40, 16, scratch_block=39, max_rows=8, device=DEVICE, compile=False)
    tables, ctx = [[3, 7], [9], [3, 12, 30]], [20, 9, 45]  # blocks 3 shared, tails 4 / 9 / 13
    q = torch.randn(3, 9, 64, generator=g).to(DEVICE)
    mask = eager.fill(tables, ctx, rows=4)  # one padded row too
    vis = eager.visible[:4, :40].cpu()
    assert vis[0].nonzero().flatten().tolist() == [3, 7] and vis[0, 3] == 16 and vis[0, 7] == 4
    assert vis[1].nonzero().flatten().tolist() == [9] and vis[1, 9] == 9
    assert vis[2, [3, 12, 30]].tolist() == [16, 16, 13] and int(vis[2].count_nonzero()) == 3
    assert vis[3].nonzero().flatten().tolist() == [39] and vis[3, 39] == 1  # padding: one scratch slot
    got = eager(q, k_cache, v_cache, mask, 0.125)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, ctx, 16, 0.125), **TOL)
    # A later, smaller step leaves nothing of the earlier one visible.
    eager.fill([[5]], [2], rows=1)
    assert eager.visible[0, :40].nonzero().flatten().tolist() == [5]


def test_every_size_gets_its_own_compiled_kernel() -> None:
    """``max_num_seqs`` 64 needs 11 sizes; dynamo's default limit (8 per function) would leave
    the rest uncompiled. The limit is only ever raised."""
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(recompile_limit=8):  # the default, whatever ran before
        attn = FlexPagedAttention(8, 16, scratch_block=7, max_rows=64, device=DEVICE, compile=False)
        assert len(attn.sizes) == 11 and dynamo_config.recompile_limit == 8  # uncompiled: untouched
        FlexPagedAttention(8, 16, scratch_block=7, max_rows=64, device=DEVICE)
        assert dynamo_config.recompile_limit >= 11 + 8
    with dynamo_config.patch(recompile_limit=100):
        FlexPagedAttention(8, 16, scratch_block=7, max_rows=64, device=DEVICE)
        assert dynamo_config.recompile_limit == 100


def test_row_sizes_cover_every_batch() -> None:
    assert row_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert row_sizes(3) == [1, 2, 3]
    assert row_sizes(12) == [1, 2, 4, 8, 12]


# -- the engine with flex attention and replayed decode steps ---------------------------------
PROMPTS = [
    list(range(100, 140)),                 # 40 tokens: a partial third block
    list(range(100, 132)) + [7, 8, 9],     # shares the first two blocks with the one above
    list(range(300, 316)),                 # exactly one block
    [5],                                   # one token
    list(range(500, 523)),
]


def _tokens(engine: LLMEngine, max_tokens: int = 24) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def _engine(**kw) -> LLMEngine:
    return LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(weights="float32", device=DEVICE.type, dtype="float32",
                                                               num_threads=2, max_num_seqs=8, **kw))


@pytest.fixture(scope="module")
def sdpa_tokens() -> dict[str, list[int]]:
    return _tokens(_engine(attention="sdpa", decode_graphs="off"))


@pytest.fixture(scope="module")
def graph_engine() -> Iterator[LLMEngine]:
    yield _engine(attention="flex", decode_graphs=GRAPH_MODE)


def test_flex_attention_gives_the_sdpa_paths_tokens(sdpa_tokens) -> None:
    engine = _engine(attention="flex", decode_graphs="off")
    assert engine.runner.attention == "flex" and engine.runner.graphs is None
    assert _tokens(engine) == sdpa_tokens


def test_replayed_decode_steps_give_the_same_tokens(sdpa_tokens, graph_engine) -> None:
    graphs = graph_engine.runner.graphs
    assert graphs is not None and graphs.mode == GRAPH_MODE and graphs.sizes == [1, 2, 4, 8]
    assert _tokens(graph_engine) == sdpa_tokens
    # Five decodes ran padded to 8, then fewer as requests finished (one prompt each step first).
    assert graphs.replays.get(8, 0) > 0
    # Padding wrote only the scratch block: the block manager never hands it out.
    assert graph_engine.block_manager.num_blocks == graph_engine.runner.num_blocks
    assert graph_engine.runner.flex is not None and graph_engine.runner.flex.scratch_block == graph_engine.runner.num_blocks


def test_a_step_with_prompt_tokens_runs_eagerly(graph_engine) -> None:
    graphs = graph_engine.runner.graphs
    before = dict(graphs.replays)
    graph_engine.add_request("p", list(range(200, 260)), SamplingParams(max_tokens=1, temperature=0.0))
    while graph_engine.has_unfinished():
        graph_engine.step()
    assert graphs.replays == before  # a prompt step and nothing else: never replayed


def test_settings_and_their_errors() -> None:
    assert EngineSettings(attention="flex", decode_graphs="static").decode_graphs == "static"
    with pytest.raises(ValueError):
        EngineSettings(decode_graphs="yes")
    args = load_config(EMBEDDED_MODEL)
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="needs a CUDA device"):
            ModelRunner(EngineSettings(device="cpu", attention="flex", decode_graphs="cuda", num_kv_blocks=8), args, {})
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
            DecodeGraphs(lambda *a: None, [], FlexPagedAttention(4, 16, 3, 2, DEVICE, compile=False), DEVICE, "cuda")
    # A choice that is not one is refused by the config, before any runner is built.
    with pytest.raises(ValueError, match="attention"):
        EngineSettings(attention="paged", num_kv_blocks=8)
