"""Preprocess logic: chat template, tokenisation, length checks, final sampling parameters.

Plain Python, tested without Ray: :class:`Preprocessor` does the work, :class:`ContextLimit` keeps
its context length equal to the engines' own, and the helpers below are shared by the two places a
request is prepared, the Preprocess stage (:mod:`stages.preprocess.deployment`) and the Ingress
itself for short plain requests (:mod:`stages.ingress.prep`). The chat template is the model's
own; it silently adds role markers and, for many models, a default system prompt, which is why
``/tokenize`` exposes exactly what it made.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from stages.api.tool_calls import forcing_grammar, template_supports_tools
from stages.errors import ContextLengthExceededError, InvalidRequestError
from stages.model_info import load_cpu_tokenizer, model_info
from stages.preprocess.grammar import GrammarCompiler
from stages.telemetry import get_tracer, span_from_context
from stages.transport.messages import EngineRequest, PreprocessRequest


class Preprocessor:
    """Turns messages or a prompt into token ids the engine can run."""

    def __init__(self, model: str, max_model_len: int | None = None, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else load_cpu_tokenizer(model)
        info = model_info(model, tokenizer=self.tokenizer)
        self.max_model_len = max_model_len or info.max_model_len
        self.vocab_size = len(self.tokenizer)
        #: Logits width: masks and token-id checks follow the model, which may pad its vocabulary.
        self.model_vocab_size = max(info.vocab_size, self.vocab_size)
        self.eos_token_ids = list(info.eos_token_ids)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """Apply the chat template: the exact text the model will see (with ``tools``, when given)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
        if tools and not template_supports_tools(template):
            raise InvalidRequestError("this model's chat template has no tool support, so tools cannot be shown "
                                      "to it; send the request without tools", param="tools",
                                      code="tools_not_supported")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools or None,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # template errors (e.g. unsupported role order) are the client's
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def process(self, req: PreprocessRequest) -> EngineRequest:
        """Template, tokenise, check lengths and resolve ``max_tokens`` (:mod:`stages.api.max_tokens`)."""
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        if req.messages is not None:
            prompt_text: str | None = self.render(req.messages, req.add_generation_prompt, req.tools)
            t1 = time.perf_counter()
            timings["template"] = t1 - t0
            # The template already wrote every special token (BOS included when the model uses one).
            token_ids = self._encode_prompt(prompt_text, False, "messages")
        elif isinstance(req.prompt, str):
            prompt_text, t1 = req.prompt, t0
            token_ids = self._encode_prompt(req.prompt, True, "prompt")
        else:
            prompt_text, t1 = None, t0
            token_ids = list(req.prompt or [])
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                                          param="prompt")
        timings["tokenize"] = time.perf_counter() - t1
        if not token_ids:
            raise InvalidRequestError("the prompt is empty after tokenisation", param="prompt")
        max_tokens = req.max_tokens.resolve(len(token_ids), self.max_model_len,
                                            prompt_param="messages" if req.messages is not None else "prompt")
        params = dataclasses.replace(req.sampling_params, max_tokens=max_tokens,
                                     bad_words_token_ids=self._bad_words(req.bad_words))
        self._check_token_ids(params)
        return EngineRequest(request_id=req.request_id, prompt_token_ids=token_ids, sampling_params=params,
                             trace_context=req.trace_context, prompt_text=prompt_text, n=req.n,
                             upstream_timings=timings)

    def _encode_prompt(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """The prompt's ids; a prompt whose token floor alone exceeds the context is refused
        before it is encoded (:meth:`stages.tokenizer.Tokenizer.min_tokens`)."""
        floor = self.tokenizer.min_tokens(text) if hasattr(self.tokenizer, "min_tokens") else 0
        if floor > self.max_model_len:
            raise ContextLengthExceededError(floor, None, self.max_model_len, param=param, at_least=True)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token sequences, alone and after a space (as vLLM bans them)."""
        out: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = self.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def _check_token_ids(self, params: Any) -> None:
        for param, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < self.model_vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary "
                                          f"(0..{self.model_vocab_size - 1})", param=param)

    def tokenize(self, *, prompt: str | None, messages: list[dict[str, str]] | None,
                 add_generation_prompt: bool, add_special_tokens: bool) -> dict[str, Any]:
        """``/tokenize``: the rendered prompt exactly as the model sees it, its ids and count."""
        text = self.render(messages, add_generation_prompt) if messages is not None else (prompt or "")
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"prompt": text, "tokens": ids, "count": len(ids), "max_model_len": self.max_model_len,
                "token_strs": self.tokenizer.convert_ids_to_tokens(ids)}

    def detokenize(self, tokens: list[int]) -> dict[str, Any]:
        """``/detokenize``: text of the given ids (special tokens kept)."""
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return {"prompt": self.tokenizer.decode(tokens)}


#: Seconds Preprocess trusts its copy of the engines' context length before asking again.
LIMIT_REFRESH_S = 5.0
#: Seconds a refresh may wait for the Directory before the last known length is kept.
LIMIT_TIMEOUT_S = 1.0

def input_size(messages: list[dict[str, str]] | None, prompt: str | list[int] | None) -> int:
    """Characters (or token ids) of a request's input: what its preparation costs grows with."""
    if messages is not None:
        return sum(len(m.get("content") or "") for m in messages)
    return len(prompt or "")


#: Span attribute of ``preprocess``: where the request was prepared, ``ingress`` or ``stage``.
WHERE_ATTRIBUTE = "lifecycle.preprocess.where"


class ContextLimit:
    """Keeps a :class:`Preprocessor`'s context length equal to the engines' own, as the Directory
    reports it (after each engine capped it to its KV pool), asking at most every
    :data:`LIMIT_REFRESH_S`. Without a directory the model's own length stands."""

    def __init__(self, pre: Preprocessor, directory: Any = None) -> None:
        self.pre = pre
        self.directory = directory
        self._checked = -LIMIT_REFRESH_S

    async def refresh(self) -> None:
        if self.directory is None or time.monotonic() - self._checked < LIMIT_REFRESH_S:
            return
        self._checked = time.monotonic()
        try:
            # Bounded: a request waits on this (once per refresh), and a restarting directory
            # must not hold it up.
            engines_len = await asyncio.wait_for(self.directory.max_model_len(), LIMIT_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - keep the last known limit while the directory restarts
            return
        if engines_len:
            self.pre.max_model_len = engines_len


def needs_stage(req: PreprocessRequest, inline_max_chars: int) -> bool:
    """Whether ``req`` must go to the Preprocess stage rather than be prepared where it arrived:
    an input over ``inline_max_chars`` (its cost grows with it, and the stage runs big ones off its
    loop), a structured output or a forced tool call (grammars compile there, with their cache), or
    tools (templating them is the heavy case)."""
    return (inline_max_chars <= 0 or req.structured is not None or bool(req.tools)
            or input_size(req.messages, req.prompt) > inline_max_chars)


def preprocess_span(req: PreprocessRequest, where: str) -> Any:
    """The request's ``preprocess`` span (a child of its trace context), made current; ``where``
    says which process prepared it (``ingress`` or ``stage``)."""
    return span_from_context(get_tracer(), "preprocess", req.trace_context,
                             {"lifecycle.request_id": req.request_id, WHERE_ATTRIBUTE: where})


def annotate_prepared(span: Any, out: EngineRequest, tokenized_ns: int) -> None:
    """Put the prompt's length on ``span``, and template and tokenise under it as child spans of
    their measured durations, ending when tokenising did."""
    span.set_attribute("gen_ai.usage.input_tokens", len(out.prompt_token_ids))
    if span.is_recording():
        _child_spans(span, out.upstream_timings, tokenized_ns)


async def compile_grammar(compiler: GrammarCompiler, req: PreprocessRequest, out: EngineRequest) -> None:
    """Compile the request's output constraint (its own, or the one ``tool_choice`` forces) into
    ``out.grammar``, in a ``grammar_compile`` span that says whether the cache had it."""
    spec = req.structured
    if req.tools:
        forced = forcing_grammar(req.tools, req.tool_choice, req.parallel_tool_calls)
        if forced is not None and spec is not None:
            raise InvalidRequestError(f"tool_choice forces a tool call, so {spec.param} cannot also constrain "
                                      "the output", param=spec.param)
        spec = spec or forced
    if spec is None:
        return
    with get_tracer().start_as_current_span("grammar_compile", attributes={
            "lifecycle.grammar.kind": spec.kind, "lifecycle.grammar.param": spec.param}) as span:
        out.grammar, hit, seconds = await compiler.compile(spec)
        span.set_attribute("lifecycle.grammar.cache_hit", hit)
        span.set_attribute("lifecycle.grammar.key", out.grammar.key)
    out.upstream_timings["grammar_compile"] = seconds
    out.upstream_timings["grammar_cache_hit"] = 1.0 if hit else 0.0


def _child_spans(parent: Any, timings: dict[str, float], end_ns: int) -> None:
    """Emit ``chat_template`` and ``tokenize`` spans back to back inside ``parent``, ending at ``end_ns``."""
    from stages.telemetry import emit_timed_children

    emit_timed_children(parent, [("chat_template", timings.get("template")), ("tokenize", timings.get("tokenize"))],
                        end_ns)
