"""Greedy decoding's argmax kernel (``kernels/argmax.cpp``): the same indices as torch's argmax,
ties and NaNs included, in every build this CPU runs (native, AVX2, plain C); the sampler uses it."""

from __future__ import annotations

import ctypes

import pytest
import torch

from stages.engine.core.sampler import Sampler, SamplingContext
from stages.engine.runner import kernels
from stages.engine.runner.quant import cpu_flags
from stages.transport.messages import SamplingParams

native = kernels.row_argmax()
pytestmark = pytest.mark.skipif(native is None, reason="no vector build here: the engine keeps torch's argmax")


def _logits(n: int) -> torch.Tensor:
    x = torch.randn(9, n)
    x[0] = 1.0  # all tied: the first index
    if n > 3:
        x[1, 2] = float("nan")  # a NaN counts as the maximum
        x[2, n - 1] = float("inf")
        x[3, 1], x[3, n - 1] = float("nan"), float("nan")  # the first NaN
        x[4] = float("-inf")
        x[5, 1] = x[5, n - 2] = 1e9  # a tie at the maximum, far apart
    return x


@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 33, 49152, 49153])
def test_the_kernel_picks_what_torch_picks(n: int) -> None:
    x = _logits(n)
    assert torch.equal(native(x), x.argmax(dim=-1))
    assert torch.equal(native(x[:, : n - 1] if n > 1 else x), (x[:, : n - 1] if n > 1 else x).argmax(dim=-1)), \
        "rows further apart than they are long (a strided view)"


@pytest.mark.parametrize(("march", "vectorized"), [("haswell", True), ("", False)])
def test_the_avx2_and_plain_builds_pick_what_torch_picks(march: str, vectorized: bool) -> None:
    if march == "haswell" and "avx2" not in cpu_flags():
        pytest.skip("no AVX2 here")
    build = kernels.RowArgmax(ctypes.CDLL(str(kernels.build(march=march))))
    assert build.vectorized is vectorized, "a plain C build scans scalar: the engine would not use it"
    for n in (1, 5, 7, 8, 9, 17, 49152, 49153):
        x = _logits(n)
        assert torch.equal(build(x), x.argmax(dim=-1)), n


def test_greedy_sampling_through_the_kernel_gives_torchs_tokens() -> None:
    logits = torch.randn(32, 49152)
    rows = [SamplingContext(SamplingParams(temperature=0.0), [1, 2], []) for _ in range(32)]
    assert Sampler(argmax=native).sample(logits, rows) == Sampler().sample(logits, rows)
    assert torch.equal(native(logits.double()), logits.double().argmax(dim=-1)), "another dtype: torch's"
