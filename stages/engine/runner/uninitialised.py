"""Building a model without initialising its weights, which are loaded right after.

Not the meta device: there every op (an initialiser's ``normal_``, RoPE's ``arange``) runs through
``torch._refs``, whose first call imports ``torch._dynamo`` and sympy, a second of load time and
~70 MB of RSS the engine process never needs otherwise.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

#: Builds in two threads at once would save each other's no-ops and leave them in place.
_lock = threading.Lock()


@contextlib.contextmanager
def no_param_init() -> Iterator[None]:
    """Module constructors skip their random initialisation: ``torch.nn.init``'s functions are
    no-ops while it is open (one build at a time in a process)."""
    with _lock:
        saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, _keep)
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(torch.nn.init, name, fn)


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
                   "orthogonal_", "sparse_")


def _keep(tensor: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    return tensor
