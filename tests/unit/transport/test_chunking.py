"""Replies in bounded parts (stages/transport/chunking.py): cut and joined back exactly, every part under the
byte bound once pickled, and JSON rendered in slices byte-identical to Starlette's JSONResponse."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from stages.transport.chunking import join_reply, render_json, split_reply
from stages.transport.messages import ReplyPart

_VALUE = st.one_of(st.integers(-(2**40), 2**40), st.text(max_size=300), st.none(), st.booleans(),
                   st.lists(st.integers(0, 2**31), max_size=400), st.lists(st.text(max_size=40) | st.none(), max_size=200))
REPLY = st.dictionaries(st.text(min_size=1, max_size=8), _VALUE, max_size=6)


async def _aiter(parts: list[ReplyPart]) -> Any:
    for part in parts:
        yield pickle.loads(pickle.dumps(part))  # what crossing a deployment does


def _join(parts: list[ReplyPart]) -> dict[str, Any]:
    return asyncio.run(join_reply(_aiter(parts)))


@settings(max_examples=200, deadline=None)
@given(reply=REPLY, part_bytes=st.integers(256, 4096))
def test_split_then_join_is_the_reply_and_parts_stay_under_the_bound(reply: dict[str, Any], part_bytes: int) -> None:
    parts = list(split_reply(reply, part_bytes))
    assert _join(parts) == reply and list(_join(parts)) == list(reply)  # same keys, same order
    for part in parts:
        assert len(pickle.dumps(part.fields)) <= part_bytes + 64


def test_a_big_tokenize_reply_is_cut_into_parts_under_a_mebibyte() -> None:
    n = 300_000
    reply = {"prompt": "é" * 1_000_000, "tokens": list(range(n)), "count": n, "max_model_len": 8192,
             "token_strs": [f"tok{i}" for i in range(n)]}
    parts = list(split_reply(reply))
    assert 6 <= len(parts) <= 30
    assert all(len(pickle.dumps(p)) <= 1024 * 1024 for p in parts)
    assert _join(parts) == reply


def test_a_small_reply_is_one_part() -> None:
    reply = {"prompt": "hi", "tokens": [1, 2], "count": 2}
    assert [p.fields for p in split_reply(reply)] == [reply]
    assert [p.fields for p in split_reply({})] == [{}]


def test_an_item_bigger_than_a_part_is_an_error() -> None:
    with pytest.raises(ValueError):
        list(split_reply({"token_strs": ["x" * 1000]}, part_bytes=512))


@settings(max_examples=100, deadline=None)
@given(reply=REPLY)
def test_render_json_matches_jsonresponse(reply: dict[str, Any]) -> None:
    assert asyncio.run(render_json(reply)) == JSONResponse(reply).body


def test_render_json_slices_long_lists() -> None:
    reply = {"tokens": list(range(100_000)), "token_strs": ["a\"b"] * 40_000, "count": 3}
    assert asyncio.run(render_json(reply)) == JSONResponse(reply).body
