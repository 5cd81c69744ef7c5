"""The Preprocess stage's Ray Serve adapter: :class:`PreprocessDeployment` runs the plain
:class:`~stages.preprocess.preprocessor.Preprocessor` in a CPU replica scaled apart from the engine.

No head-of-line blocking: templating and tokenising a big input (a 1 MB prompt takes seconds) runs
in a thread pool sized to the replica's CPUs, off the replica's event loop, so small requests keep
being served beside it (the Rust tokenizer releases the GIL while it encodes a long text). Small
inputs, the common case, run inline: a thread hop would cost more than their work. ``/tokenize`` and
``/detokenize`` answer in bounded parts (:mod:`stages.transport.chunking`), since their replies grow
with the input and can outgrow the 4 MiB message limit between deployments.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ray import serve

from stages.config import StructuredOutputSettings, TracingSettings
from stages.directory.client import directory_client
from stages.heap import start_trimmer
from stages.preprocess.grammar import GrammarCompiler
from stages.preprocess.preprocessor import (
    ContextLimit,
    Preprocessor,
    annotate_prepared,
    compile_grammar,
    input_size,
    preprocess_span,
)
from stages.transport.chunking import split_reply
from stages.transport.messages import EngineRequest, PreprocessRequest, ReplyPart

#: The GIL switch interval of a Preprocess replica (CPython's default is 5 ms).
PREPROCESS_SWITCH_INTERVAL_S = 0.0005
#: Inputs up to this many characters (or token ids) are prepared inline on the event loop: about a
#: millisecond of work, less than handing them to a thread.
INLINE_MAX_INPUT = 4096

_T = TypeVar("_T")


def replica_cpus() -> int:
    """Whole CPUs this replica may use (its Ray CPU share rounded up, at least 1, at most the host's)."""
    import ray

    share = 1.0
    if ray.is_initialized():  # (asking the runtime context otherwise starts or joins a cluster)
        try:
            share = float(ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0))
        except AssertionError:  # a driver, not an actor (tests that build the class in-process)
            pass
    return max(1, min(math.ceil(share), os.cpu_count() or 1))



@serve.deployment(name="Preprocess", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.25})
class PreprocessDeployment:
    """CPU stage; scale it with ``num_replicas`` independently of the engine.

    The context length it enforces is the engines' own (after each engine capped it to its KV
    pool; the smallest when several disagree), read from the Directory, so a prompt Preprocess
    accepts is one every engine can run, and a too-long one gets ``context_length_exceeded`` here.
    """

    def __init__(self, model: str, max_model_len: int, tracing: TracingSettings | None = None,
                 directory: Any = None, structured_outputs: StructuredOutputSettings | None = None) -> None:
        """``tracing`` and ``structured_outputs``: the app config's sections (defaults when omitted)."""
        from stages.telemetry import configure_tracing

        configure_tracing(tracing, component="preprocess")
        directory = directory_client(directory)
        start_trimmer()
        self.pre = Preprocessor(model, max_model_len or None)
        self.grammars = GrammarCompiler(self.pre.tokenizer, self.pre.model_vocab_size, self.pre.eos_token_ids,
                                        structured_outputs)
        self.grammars.warm_up()
        self.limit = ContextLimit(self.pre, directory)
        self._pool = ThreadPoolExecutor(max_workers=replica_cpus(), thread_name_prefix="preprocess")
        # A pool thread doing Python-level work on a big input holds the GIL for up to the switch
        # interval (5 ms) each time this replica's event loop or gRPC's poller wants it back, and a
        # small request needs it back dozens of times; at 0.5 ms those waits stop adding up.
        sys.setswitchinterval(PREPROCESS_SWITCH_INTERVAL_S)

    async def _run(self, size: int, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)``: inline when the input is small, else in the pool (off the loop)."""
        if size <= INLINE_MAX_INPUT:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def process(self, req: PreprocessRequest) -> EngineRequest:
        await self.limit.refresh()
        with preprocess_span(req, "stage") as span:
            out = await self._run(input_size(req.messages, req.prompt), self.pre.process, req)
            tokenized_ns = time.time_ns()
            await compile_grammar(self.grammars, req, out)
            annotate_prepared(span, out, tokenized_ns)
            return out

    async def ping(self) -> bool:
        """Liveness for the app's ``/health``."""
        return True

    async def tokenize(self, body: dict[str, Any]) -> AsyncIterator[ReplyPart]:
        """``/tokenize``, as a stream of bounded parts (a big prompt's reply is bigger than one message)."""
        await self.limit.refresh()
        parts = await self._run(input_size(body.get("messages"), body.get("prompt")),
                                lambda: list(split_reply(self.pre.tokenize(**body))))
        for part in parts:
            yield part

    async def detokenize(self, tokens: list[int]) -> AsyncIterator[ReplyPart]:
        """``/detokenize``, as a stream of bounded parts."""
        parts = await self._run(len(tokens), lambda: list(split_reply(self.pre.detokenize(tokens))))
        for part in parts:
            yield part
