"""Where a request is templated and tokenised: in the Ingress itself when it is small and plain,
in the Preprocess stage otherwise.

A round trip to the Preprocess stage costs several times the work of templating and tokenising a
short chat, and it sits on the first token's path (BENCHMARKS.md has the figures). A short plain
request is therefore prepared on the Ingress's own loop, with the same :class:`Preprocessor`
and the same checks, span and timings as in the stage. What stays in the stage is what it exists
for: inputs whose cost grows with their size (the stage runs big ones off its loop and scales on
them), grammar compilation with its cache, and tool templating. ``preprocess.inline_max_chars: 0``
sends everything to the stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stages.preprocess.preprocessor import (
    ContextLimit,
    Preprocessor,
    annotate_prepared,
    needs_stage,
    preprocess_span,
)
from stages.transport.messages import EngineRequest, PreprocessRequest


class Prep:
    """Prepares requests inline or through the Preprocess stage's handle (see the module doc)."""

    def __init__(self, stage: Any, model: str, max_model_len: int, directory: Any, inline_max_chars: int,
                 on_prepared: Callable[[str], None] | None = None) -> None:
        self.stage = stage
        self.inline_max_chars = inline_max_chars
        #: Called with ``"ingress"`` or ``"stage"`` once per prepared request (a metric).
        self.on_prepared = on_prepared
        self.pre: Preprocessor | None = None
        self.limit: ContextLimit | None = None
        if inline_max_chars > 0:
            self.pre = Preprocessor(model, max_model_len or None)
            self.limit = ContextLimit(self.pre, directory)

    def inline(self, req: PreprocessRequest) -> bool:
        """Whether ``req`` is prepared here."""
        return self.pre is not None and not needs_stage(req, self.inline_max_chars)

    async def process(self, req: PreprocessRequest) -> EngineRequest:
        """The engine request for ``req``; errors are the stage's own (400s for the client)."""
        if not self.inline(req):
            out: EngineRequest = await self.stage.process.remote(req)
            self._count("stage")
            return out
        assert self.pre is not None and self.limit is not None
        await self.limit.refresh()
        with preprocess_span(req, "ingress") as span:
            out = self.pre.process(req)
            annotate_prepared(span, out, time.time_ns())
        self._count("ingress")
        return out

    def _count(self, where: str) -> None:
        if self.on_prepared is not None:
            self.on_prepared(where)
