"""Incremental detokenisation with stop-string handling, for streaming responses.

Egress turns the token ids the engine streams into text deltas. Re-decoding the whole output on every
step costs O(n) per token (O(n^2) per response), so decoding is incremental: the Rust
``tokenizers.decoders.DecodeStream`` (about 1 us per token) when the tokenizer has a fast backend,
else a Python prefix/read window over ``tokenizer.decode``, which follows the same algorithm.

Guarantees, for the same output ids:

* the concatenated deltas plus :meth:`IncrementalDetokenizer.finish` equal
  ``tokenizer.decode(output_ids, skip_special_tokens=...)`` (when no stop string matched), so the
  streamed text equals the non-streamed text;
* a multi-byte UTF-8 character split across tokens is held back until complete, so no delta ever
  carries a U+FFFD for it; only a sequence still incomplete at the end is flushed (lossily) by
  ``finish``;
* a stop string is never partly emitted: the longest suffix of the pending text that is a prefix of
  some stop string is held back until the next tokens decide it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"


@dataclass
class DetokenizerUpdate:
    """What one :meth:`IncrementalDetokenizer.add` call produced."""

    #: New text that is safe to emit now (may be empty).
    text: str
    #: A stop string matched; no more text will ever be emitted and the request should be aborted.
    stopped: bool = False
    #: The stop string that matched, when ``stopped``.
    stop_string: str | None = None


def _backend(tokenizer: Any) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind ``tokenizer``, or ``None`` for a pure-Python one."""
    if type(tokenizer).__module__.startswith("tokenizers") and hasattr(tokenizer, "decode_batch"):
        return tokenizer  # already a raw tokenizers.Tokenizer
    # transformers 5 ``TokenizersBackend`` (and 4.x fast tokenizers) expose it as ``backend_tokenizer``.
    return getattr(tokenizer, "backend_tokenizer", None)


class _WindowDecoder:
    """Python fallback with DecodeStream's algorithm: decode a short window, emit the new suffix.

    ``prefix`` marks the first id of the window, ``read`` the first id not yet turned into text.
    Decoding the window (rather than the new ids alone) keeps context-dependent spacing right.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""

    def step(self, token_id: int) -> str | None:
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return None  # nothing new yet, or a multi-byte character is still incomplete
        new = text[len(self._prefix_text) :]
        self._prefix_text = self._tokenizer.decode(self._ids[self._read :], skip_special_tokens=self._skip)
        self._prefix, self._read = self._read, len(self._ids)
        del self._ids[: self._prefix]  # keep the window short; offsets are relative to it
        self._read -= self._prefix
        self._prefix = 0
        return new


class IncrementalDetokenizer:
    """Turns streamed token ids into text deltas, holding back incomplete characters and stop strings.

    ``prompt_token_ids`` is accepted for API stability but deliberately not used as decoding context:
    the contract is equality with ``tokenizer.decode(output_ids)``, and for tokenizers that strip the
    first token's leading space (SentencePiece ``Metaspace``) prompt context would break it.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        backend = _backend(tokenizer)
        self._step: Callable[[int], str | None]
        if backend is not None:
            stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            self._step = lambda token_id: stream.step(backend, token_id)
        else:
            self._step = _WindowDecoder(tokenizer, skip_special_tokens).step
        self._ids: list[int] = []
        self._last_text_end = 0  # ids[:_last_text_end] have all been turned into text
        self._last_text_start = 0  # start of the id run that produced the latest text chunk
        self._stops = [s for s in (stop or []) if s]  # an empty stop string would match everywhere
        # Every proper prefix of every stop string, so the hold-back test is a set lookup.
        self._stop_prefixes = {s[:k] for s in self._stops for k in range(1, len(s))}
        self._max_prefix = max((len(s) - 1 for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        self._pending = ""  # decoded but not yet emitted (a possible stop-string start)
        self._emitted: list[str] = []  # chunks, joined lazily: str += on an attribute is O(n)
        self._stopped = False
        self._stop_string: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        """Everything emitted so far."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def stopped(self) -> bool:
        """True once a stop string matched."""
        return self._stopped

    @property
    def stop_string(self) -> str | None:
        """The stop string that matched, or ``None``."""
        return self._stop_string

    def add(self, token_ids: list[int]) -> DetokenizerUpdate:
        """Feed the next output token ids; returns the text that is now safe to emit."""
        if self._stopped or self._finished:
            return DetokenizerUpdate("", self._stopped, self._stop_string)
        step = self._step
        ids = self._ids
        chunks: list[str] = []
        for token_id in token_ids:
            ids.append(token_id)
            text = step(token_id)
            if text is not None:  # None: an incomplete character, or a skipped special token
                chunks.append(text)
                self._last_text_start, self._last_text_end = self._last_text_end, len(ids)
        return self._release("".join(chunks), final=False)

    def finish(self) -> str:
        """Flush held-back text at the end of the stream; ``""`` if a stop string already matched.

        Held-back stop-string prefixes are released (the stream ended before they completed), and
        bytes of a character that never completed are decoded lossily, exactly as
        ``tokenizer.decode`` would.
        """
        if self._stopped or self._finished:
            return ""
        tail = ""
        if self._last_text_end < len(self._ids):
            # Decode the unconverted ids together with the run before them, as the stream would.
            window = self._ids[self._last_text_start :]
            known = self._ids[self._last_text_start : self._last_text_end]
            full = self._tokenizer.decode(window, skip_special_tokens=self._skip)
            tail = full[len(self._tokenizer.decode(known, skip_special_tokens=self._skip)) :]
            self._last_text_end = len(self._ids)
        text = self._release(tail, final=True).text
        self._finished = True
        return text

    def _release(self, new_text: str, *, final: bool) -> DetokenizerUpdate:
        """Append ``new_text`` to the pending text, look for stop strings, emit what is safe."""
        if not self._stops:
            if new_text:
                self._emitted.append(new_text)
            return DetokenizerUpdate(new_text)
        pending = self._pending + new_text
        match = self._find_stop(pending)
        if match is not None:
            start, stop = match
            out = pending[: start + len(stop)] if self._include_stop else pending[:start]
            self._pending = ""
            self._stopped, self._stop_string = True, stop
            self._emitted.append(out)
            return DetokenizerUpdate(out, True, stop)
        keep = 0 if final else self._holdback(pending)
        out = pending[: len(pending) - keep]
        self._pending = pending[len(pending) - keep :]
        if out:
            self._emitted.append(out)
        return DetokenizerUpdate(out)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string occurrence in ``text`` that completes first (ties: the longer one).

        "Completes first" is what a character-by-character stream would see, so the result does not
        depend on how the engine happened to batch the tokens.
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for k in range(min(len(text), self._max_prefix), 0, -1):
            if text[-k:] in self._stop_prefixes:
                return k
        return 0
