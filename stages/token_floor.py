"""A floor on a text's token count that costs no encoding, for tokenizers where one is exact.

Preprocess refuses a prompt whose floor alone exceeds the context before encoding it: encoding a
1 MB prompt only to refuse it costs half a second and ~130 MB of a replica's heap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenizers import Tokenizer as RustTokenizer


def _byte_level_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte 0..255 in the vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


@dataclass(frozen=True)
class TokenFloor:
    """A floor on a text's token count that costs no encoding, where one is exact.

    Exact for a byte-level BPE without a normaliser and without fused unknowns (GPT-2, Llama 3,
    SmolLM): every token stands for at most ``max_bytes`` bytes of the text (a vocabulary entry's
    byte-level string has one character per byte; an added token is its own text), and every byte
    becomes part of some token except the ``dropped`` bytes, whose byte-level character the
    vocabulary lacks (BPE without an unknown token drops them). So a prompt that cannot fit the
    context is refused without spending a second and a hundred MB encoding it."""

    max_bytes: int
    dropped: bytes

    @classmethod
    def of(cls, backend: RustTokenizer) -> TokenFloor | None:
        """The floor of ``backend``; None for any other tokenizer (normalisers that may shrink
        text, WordPiece or Unigram unknowns that swallow whole words)."""
        spec = json.loads(backend.to_str())
        model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
        byte_level = pre.get("type") == "ByteLevel" or any(
            p.get("type") == "ByteLevel" for p in pre.get("pretokenizers") or [])
        vocab = model.get("vocab") or {}
        if model.get("type") != "BPE" or spec.get("normalizer") or model.get("fuse_unk") or not byte_level or not vocab:
            return None
        added = [len(t.content.encode()) for t in backend.get_added_tokens_decoder().values()]
        dropped = bytes(b for b, ch in enumerate(_byte_level_chars()) if ch not in vocab)
        return cls(max([len(tok) for tok in vocab] + added), dropped)

    def __call__(self, text: str) -> int:
        data = text.encode("utf-8", "surrogatepass")  # a lone surrogate is the encoder's error to report
        kept = len(data) - sum(data.count(b) for b in self.dropped)
        return -(-kept // self.max_bytes)
