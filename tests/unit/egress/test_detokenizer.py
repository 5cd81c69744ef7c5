"""Incremental detokeniser: streamed text equals ``tokenizer.decode``, and stop strings are exact."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.egress.detokenizer import IncrementalDetokenizer
from stages.model_info import EMBEDDED_MODEL, load_tokenizer

REPLACEMENT = "\ufffd"

CASES = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\tindented\r\nend\n",
    "family: 👨‍👩‍👧 and 🏳️‍🌈 flags 👍🏽!",
    "你好世界，今天天气很好。",
    "Crème brûlée, naïve café, Ærø, Øresund, ß",
    "def f(x: int) -> dict[str, int]:\n    return {'a': x ** 2 | 0x1F}  # ~!@#$%^&*()",
    "mixed: abc你好😀def 🇯🇵 Ω≈ç√∫",
    "😀",
    " ",
]


@functools.cache
def tok():
    """The embedded model's tokenizer, loaded once (a plain cache: hypothesis dislikes fixtures)."""
    return load_tokenizer(EMBEDDED_MODEL)


def encode(text: str) -> list[int]:
    return tok().encode(text, add_special_tokens=False)


def batches(ids: list[int], rng: random.Random, max_size: int = 5) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_size)
        out.append(ids[i : i + n])
        i += n
    return out


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    """All deltas, including the final flush."""
    deltas = [detok.add(chunk).text for chunk in chunks]
    deltas.append(detok.finish())
    return deltas


class NoBackend:
    """A tokenizer without a Rust backend, to exercise the Python window fallback."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def decode(self, ids, skip_special_tokens=False):
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)


def check_roundtrip(tokenizer, ids: list[int], chunks: list[list[int]], *, skip: bool = True) -> None:
    detok = IncrementalDetokenizer(tokenizer, [1, 2], skip_special_tokens=skip)
    deltas = stream(detok, chunks)
    want = tok().decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == want
    assert detok.output_text == "".join(deltas)
    # Some rare code points (e.g. U+40000) have no byte tokens in this vocab, so their ids decode to
    # U+FFFD even in one piece; only a faithful encoding can promise deltas free of U+FFFD.
    if REPLACEMENT not in want:
        assert not any(REPLACEMENT in d for d in deltas), deltas


# --- 1. varied strings, one token at a time and in random batches --------------------------------


@pytest.mark.parametrize("fallback", [False, True], ids=["decodestream", "window"])
@pytest.mark.parametrize("text", CASES)
def test_stream_equals_decode(text: str, fallback: bool) -> None:
    ids = encode(text)
    assert tok().decode(ids) == text  # faithful, so the U+FFFD check in check_roundtrip applies
    tokenizer = NoBackend(tok()) if fallback else tok()
    check_roundtrip(tokenizer, ids, [[i] for i in ids])
    rng = random.Random(text)
    for _ in range(5):
        check_roundtrip(tokenizer, ids, batches(ids, rng))
    check_roundtrip(tokenizer, ids, [ids])


def test_cases_really_split_characters() -> None:
    """Guard: the emoji/CJK cases must split characters across tokens, or test 1 proves nothing."""
    for text in ("family: 👨‍👩‍👧 and 🏳️‍🌈 flags 👍🏽!", "你好世界，今天天气很好。"):
        assert any(REPLACEMENT in tok().decode([i]) for i in encode(text)), text


def test_incomplete_character_at_end_is_flushed_by_finish() -> None:
    ids = encode("ok 😀")[:-1]  # cut the emoji mid-character
    detok = IncrementalDetokenizer(tok(), [])
    streamed = detok.add(ids).text
    assert REPLACEMENT not in streamed
    tail = detok.finish()
    assert REPLACEMENT in tail
    assert streamed + tail == tok().decode(ids)


# --- 2. properties -----------------------------------------------------------------------------

TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters=REPLACEMENT), max_size=60
) | st.text(alphabet="ab \n\t.,é你好😀👍🏽\u200d👨", max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT, seed=st.integers(0, 2**32))
def test_property_random_text(text: str, seed: int) -> None:
    ids = encode(text)
    check_roundtrip(tok(), ids, batches(ids, random.Random(seed)))


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=40), seed=st.integers(0, 2**32), skip=st.booleans())
def test_property_random_ids_concatenate_to_decode(ids: list[int], seed: int, skip: bool) -> None:
    """Arbitrary ids (stray bytes, specials) may decode to U+FFFD, but the concatenation still agrees."""
    for tokenizer in (tok(), NoBackend(tok())):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        deltas = stream(detok, batches(ids, random.Random(seed)))
        assert "".join(deltas) == tok().decode(ids, skip_special_tokens=skip)


def reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Character-by-character reference: the first stop string to complete (ties: the longer)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[: end - len(stop)], stop
    return text, None


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab .", max_size=40),
    stops=st.lists(st.text(alphabet="ab .", min_size=1, max_size=4), min_size=1, max_size=3),
    seed=st.integers(0, 2**32),
)
def test_property_stop_strings_independent_of_batching(text: str, stops: list[str], seed: int) -> None:
    ids = encode(text)
    detok = IncrementalDetokenizer(tok(), [], stop=stops)
    final = "".join(stream(detok, batches(ids, random.Random(seed))))
    want, want_stop = reference_stop(tok().decode(ids), stops)
    assert (final, detok.stop_string, detok.stopped) == (want, want_stop, want_stop is not None)


# --- 3. stop strings -----------------------------------------------------------------------------

STOP = "\nObservation:"
BEFORE = "Thought: I should look it up. Action: search[weather]"
STOP_TEXT = BEFORE + STOP + " sunny and warm"


def longest_stop_prefix_suffix(text: str, stop: str) -> int:
    return max((k for k in range(len(stop)) if k and text.endswith(stop[:k])), default=0)


@pytest.mark.parametrize("include", [False, True])
def test_multi_token_stop_string(include: bool) -> None:
    ids = encode(STOP_TEXT)
    stop_ids = encode(STOP)
    assert len(stop_ids) >= 3, stop_ids  # the stop string really spans several tokens
    detok = IncrementalDetokenizer(tok(), [], stop=[STOP], include_stop_str_in_output=include)
    want = BEFORE + STOP if include else BEFORE
    seen = []
    update = None
    for i, token_id in enumerate(ids):
        update = detok.add([token_id])
        seen.append(token_id)
        if update.stopped:
            break
        out = detok.output_text
        # Nothing of the stop string leaks, and only the minimal tail is held back.
        assert BEFORE.startswith(out), (i, out)
        decoded = tok().decode(seen)
        assert len(decoded) - len(out) == longest_stop_prefix_suffix(decoded, STOP), (i, out)
    assert update is not None and update.stopped and update.stop_string == STOP
    assert detok.output_text == want
    assert detok.add(encode(" more")).text == "" and detok.finish() == ""
    assert detok.output_text == want


def test_partial_stop_is_released() -> None:
    text = "Action: search\nObserve the sky\nObs"
    ids = encode(text)
    detok = IncrementalDetokenizer(tok(), [], stop=[STOP])
    streamed = "".join(detok.add([i]).text for i in ids)
    assert streamed == text[: -len("\nObs")]  # the dangling partial is held, the earlier one released
    assert detok.finish() == "\nObs"
    assert not detok.stopped and detok.stop_string is None
    assert detok.output_text == text


def test_earliest_stop_wins() -> None:
    text = "alpha beta gamma delta"
    ids = encode(text)
    for stops in (["delta", "beta", "gamma"], ["beta", "delta"], ["ta gam", "beta"]):
        detok = IncrementalDetokenizer(tok(), [], stop=stops)
        final = "".join(stream(detok, [[i] for i in ids]))
        assert final == "alpha " and detok.stop_string == "beta", stops
    # Overlapping matches: the one that completes first wins, whatever the batching (a stream fed
    # character by character would see "ta g" complete before "beta gamma"); on a tie, the longer.
    for stops, want, want_stop in (
        (["beta gamma", "ta g"], "alpha be", "ta g"),
        (["gamma", "a gamma"], "alpha bet", "a gamma"),
    ):
        for chunks in ([ids], [[i] for i in ids]):
            detok = IncrementalDetokenizer(tok(), [], stop=stops)
            assert "".join(stream(detok, chunks)) == want and detok.stop_string == want_stop
    detok = IncrementalDetokenizer(tok(), [], stop=["nothing", "here"])
    assert "".join(stream(detok, [ids])) == text and not detok.stopped


# --- 4. special tokens ----------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(skip: bool) -> None:
    ids = encode("<|im_start|>assistant\nHi there 😀<|im_end|>")
    assert 1 in ids and 2 in ids  # really special tokens, not their characters
    detok = IncrementalDetokenizer(tok(), [], skip_special_tokens=skip)
    final = "".join(stream(detok, [[i] for i in ids]))
    assert final == tok().decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in final) is not skip
    assert final.endswith("Hi there 😀") if skip else final.endswith("😀<|im_end|>")
