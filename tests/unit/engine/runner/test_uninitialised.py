"""Building a model without initialising it (stages/engine/runner/uninitialised.py)."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from stages.engine.runner.uninitialised import no_param_init


def test_constructors_skip_their_initialisers_and_get_them_back():
    before = torch.nn.init.normal_
    with no_param_init():
        emb = nn.Embedding(4, 3)
        emb.weight.data.fill_(7.0)  # what the loader does next
        lin = nn.Linear(3, 2)
    assert torch.nn.init.normal_ is before
    assert torch.equal(emb.weight, torch.full((4, 3), 7.0)) and lin.weight.shape == (2, 3)
    again = nn.Embedding(4, 3)
    assert again.weight.std() > 0  # initialised as usual again


def test_loading_an_engine_imports_neither_dynamo_nor_sympy():
    """Building on the meta device imported both (a second and ~70 MB of the engine process)."""
    from stages.model_info import cache_root
    from tests.tools_model import build_tools_model

    model = build_tools_model(cache_root() / "test-models" / "tiny-hermes-tools")
    code = ("import sys\n"
            "from stages.config import EngineSettings\n"
            "from stages.engine.core.engine import LLMEngine\n"
            f"LLMEngine.from_config({str(model)!r}, EngineSettings(weights='float32', kv_cache_memory_gb=0.02))\n"
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-2:] == ["False", "False"], out
