"""Grammar compilation for structured outputs, in the Preprocess stage (CPU, no torch).

A client's JSON schema, regex, choice list or Lark/GBNF grammar becomes an llguidance grammar,
which is validated against the model's tokenizer here (the full compile: the grammar is parsed,
its lexer built, its limits checked), so a schema that cannot be compiled is a 400 naming the
request field before the request ever reaches an engine. Compiled grammars are kept in an LRU
cache bounded in bytes and keyed by a digest of the spec and the tokenizer, so a repeated schema
costs a dictionary lookup.

Why llguidance (BENCHMARKS.md "Structured outputs"): it has no Python dependencies (xgrammar pulls
torch; these replicas deliberately never import it), and it compiles a 60-field schema in 5.5-6.7 ms
on this CPU against 30-123 ms for xgrammar and 5.6-8.1 s for outlines-core, because its lexer is
built lazily rather than by walking the whole vocabulary up front.

Compilation runs on a small thread pool (llguidance releases the GIL while it builds), never on
the event loop, under a timeout; the spec's size and the grammar's size are bounded too. Past
either limit the request is a 400.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import threading
import time
from collections import OrderedDict
from typing import Any

import llguidance
from llguidance import LLMatcher

from stages.config import StructuredOutputSettings
from stages.errors import InvalidRequestError
from stages.transport.messages import GrammarSpec, StructuredOutputSpec

#: Compact JSON (no free whitespace between tokens): small models otherwise tend to emit runs of
#: newlines that a flexible-whitespace grammar allows until ``max_tokens``.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ByteLRU:
    """An LRU mapping bounded by the total ``nbytes`` of its values (thread-safe)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[str, GrammarSpec] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> GrammarSpec | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: str, value: GrammarSpec) -> None:
        size = value.nbytes
        if size > self.max_bytes:
            return  # larger than the whole cache: compile it every time rather than flush everything
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._items[key] = value
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self.nbytes -= evicted.nbytes

    def __len__(self) -> int:
        return len(self._items)


def tokenizer_json(tokenizer: Any) -> str:
    """The serialised ``tokenizers`` tokenizer (what llguidance builds its token trie from)."""
    backend = tokenizer.backend_tokenizer
    return backend.to_str()


def tokenizer_digest(tok_json: str, n_vocab: int) -> str:
    """Digest naming a tokenizer: a compiled grammar is only valid for the tokenizer it was built for."""
    return hashlib.sha256(f"{n_vocab}\0{tok_json}".encode()).hexdigest()[:32]


def make_llg_tokenizer(tok_json: str, n_vocab: int, eos_token_ids: list[int], *,
                       masks: bool = True) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for masks of ``n_vocab`` entries (the model's logits width).

    ``masks=False`` builds it without llguidance's "slices" (token sets precomputed to speed up
    mask computation): what Preprocess needs, which validates grammars and never computes a mask.
    That holds 20 MB instead of 32 and validates as fast."""
    return llguidance.LLTokenizer(tok_json, n_vocab=n_vocab, eos_token=list(eos_token_ids) or None,
                                  slices=None if masks else [])


def _choice_grammar(spec: str, param: str) -> str:
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise InvalidRequestError("choice must be a non-empty list of non-empty strings", param=param)
    # Lark string literals take JSON's escapes, so json.dumps quotes any choice safely.
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def to_llguidance(spec: StructuredOutputSpec) -> str:
    """llguidance's grammar text for ``spec`` (not yet validated: :class:`GrammarCompiler` does)."""
    kind, param = spec.kind, spec.param
    if kind in ("json_schema", "tool_call"):
        try:
            schema = json.loads(spec.spec)
        except ValueError as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", param=param) from None
        if not isinstance(schema, dict):
            raise InvalidRequestError("the JSON schema must be a JSON object", param=param)
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        # ASCII classes (\d is [0-9], \w is [0-9A-Za-z_]), as JSON Schema patterns and xgrammar read them;
        # Rust's Unicode classes would let a model write any script's digits.
        return LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(spec.spec, 'dw')}/")
    if kind == "choice":
        return _choice_grammar(spec.spec, param)
    if kind == "grammar":
        text = spec.spec
        if "::=" in text:  # GBNF / EBNF as llama.cpp and xgrammar take it; llguidance speaks Lark
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = gbnf_to_lark(text)
            except Exception as exc:  # noqa: BLE001 - the converter raises plain errors on bad input
                raise InvalidRequestError(f"the GBNF grammar could not be converted: {exc}", param=param) from None
        return LLMatcher.grammar_from_lark(text)
    raise InvalidRequestError(f"unknown structured output kind {kind!r}", param=param)


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer."""

    def __init__(self, tokenizer: Any, n_vocab: int, eos_token_ids: list[int],
                 limits: StructuredOutputSettings | None = None) -> None:
        """``limits``: the ``structured_outputs`` section (its defaults when omitted)."""
        self.limits = limits if limits is not None else StructuredOutputSettings()
        tok_json = tokenizer_json(tokenizer)
        self.tokenizer_hash = tokenizer_digest(tok_json, n_vocab)
        self._tok_json, self._n_vocab, self._eos = tok_json, n_vocab, list(eos_token_ids)
        self._llg: llguidance.LLTokenizer | None = None
        self._llg_lock = threading.Lock()
        self.cache = ByteLRU(self.limits.cache_bytes)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.limits.compile_threads,
                                                           thread_name_prefix="grammar-compile")
        self.hits = 0
        self.misses = 0

    @property
    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (~0.3 s for a 49k vocabulary), then shared."""
        with self._llg_lock:
            if self._llg is None:
                self._llg = make_llg_tokenizer(self._tok_json, self._n_vocab, self._eos, masks=False)
                self._tok_json = ""  # its only use (a few MB of JSON)
            return self._llg

    def warm_up(self) -> None:
        """Build the llguidance tokenizer on a background thread, so the first request does not wait."""
        threading.Thread(target=lambda: self.llg_tokenizer, name="grammar-warm-up", daemon=True).start()

    def key(self, spec: StructuredOutputSpec) -> str:
        """Cache key: the spec's kind and text, and the tokenizer."""
        return hashlib.sha256(f"{spec.kind}\0{spec.spec}\0{self.tokenizer_hash}".encode()).hexdigest()[:32]

    def _check_size(self, spec: StructuredOutputSpec) -> None:
        size = len(spec.spec.encode())
        if size > self.limits.max_spec_bytes:
            raise InvalidRequestError(
                f"the {spec.kind} spec is {size} bytes; the limit is {self.limits.max_spec_bytes}", param=spec.param)

    def compile_sync(self, spec: StructuredOutputSpec) -> GrammarSpec:
        """Build and validate the grammar (no cache); raises :class:`InvalidRequestError`."""
        self._check_size(spec)
        try:
            grammar = to_llguidance(spec)
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - llguidance's converters raise plain errors on bad input
            raise InvalidRequestError(f"the {spec.kind} could not be compiled: {exc}"[:1000], param=spec.param,
                                      code="invalid_grammar") from None
        limits = llguidance.LLParserLimits(max_grammar_size=self.limits.max_grammar_size, verbose_errors=False)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.llg_tokenizer, limits=limits)
        if is_error:
            reason = messages[0] if messages else "unknown error"
            if len(reason) > 1000:  # llguidance quotes the offending text, which may be the whole spec
                reason = reason[:1000] + " ..."
            raise InvalidRequestError(f"the {spec.kind} could not be compiled: {reason}", param=spec.param,
                                      code="invalid_grammar")
        return GrammarSpec(kind=spec.kind, grammar=grammar, key=self.key(spec), tokenizer_hash=self.tokenizer_hash)

    async def compile(self, spec: StructuredOutputSpec) -> tuple[GrammarSpec, bool, float]:
        """``(compiled, cache_hit, seconds)``; compiles on the pool under the timeout on a miss."""
        t0 = time.perf_counter()
        self._check_size(spec)
        key = self.key(spec)
        cached = self.cache.get(key)
        if cached is not None:
            self.hits += 1
            return cached, True, time.perf_counter() - t0
        self.misses += 1
        future = asyncio.get_running_loop().run_in_executor(self._pool, self.compile_sync, spec)
        try:
            compiled = await asyncio.wait_for(future, self.limits.compile_timeout_s)
        except TimeoutError:
            # The thread runs on (it cannot be interrupted) but is bounded by llguidance's fuel limits.
            raise InvalidRequestError(
                f"compiling the {spec.kind} took longer than {self.limits.compile_timeout_s:g} s",
                param=spec.param, code="grammar_compile_timeout") from None
        self.cache.put(key, compiled)
        return compiled, False, time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "entries": len(self.cache), "bytes": self.cache.nbytes}
