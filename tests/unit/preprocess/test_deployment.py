"""Preprocess without Ray: a huge input is prepared off the event loop, so small requests on the
same replica are answered while it runs; the GIL-free encode gives the same ids; /tokenize
and /detokenize answer in parts that join back to the whole reply."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from stages.api.max_tokens import MaxTokens
from stages.model_info import EMBEDDED_MODEL
from stages.preprocess.deployment import INLINE_MAX_INPUT, PreprocessDeployment
from stages.preprocess.preprocessor import input_size
from stages.tokenizer import GIL_FREE_ENCODE_CHARS
from stages.transport.chunking import join_reply
from stages.transport.messages import PreprocessRequest, SamplingParams


@pytest.fixture(scope="module")
def pre() -> Iterator[Any]:
    interval = sys.getswitchinterval()  # the replica sets its own; give the test process its own back
    yield PreprocessDeployment.func_or_class(EMBEDDED_MODEL, 0)  # the plain class, in this process
    sys.setswitchinterval(interval)


def _request(text: str) -> PreprocessRequest:
    return PreprocessRequest("r", SamplingParams(), MaxTokens(1), messages=[{"role": "user", "content": text}])


def test_long_texts_encode_to_the_same_ids(pre: Any) -> None:
    tok = pre.pre.tokenizer
    rng = random.Random(0)
    for n in (GIL_FREE_ENCODE_CHARS, 3 * GIL_FREE_ENCODE_CHARS + 7):
        text = "".join(rng.choice("ab é你😀 \n,.0123456789") for _ in range(n))
        for special in (True, False):
            want = tok.backend_tokenizer.encode(text, add_special_tokens=special).ids
            assert tok.encode(text, add_special_tokens=special) == want


def test_input_size() -> None:
    assert input_size([{"role": "user", "content": "abc"}, {"role": "assistant", "content": ""}], None) == 3
    assert input_size(None, "hello") == 5 and input_size(None, [1, 2, 3]) == 3 and input_size(None, None) == 0


def test_small_requests_are_served_while_a_huge_one_is_prepared(pre: Any) -> None:
    huge = "".join(random.Random(1).choice("0123456789 ,.") for _ in range(300_000))
    assert len(huge) > INLINE_MAX_INPUT

    async def go() -> tuple[float, list[float]]:
        await pre.process(_request("warm up"))  # the chat template compiles on its first use
        t0 = time.perf_counter()
        big = asyncio.create_task(pre.tokenize({"prompt": huge, "messages": None, "add_generation_prompt": True,
                                                "add_special_tokens": True}).__anext__())
        await asyncio.sleep(0.05)
        small = []
        while not big.done():
            t = time.perf_counter()
            out = await pre.process(_request("Hello there"))
            small.append(time.perf_counter() - t)
            assert out.prompt_token_ids
            await asyncio.sleep(0.01)
        await big
        return time.perf_counter() - t0, small

    big_s, small = asyncio.run(go())
    # The huge one takes over a second here; inline, the first small request would have waited for it.
    assert len(small) >= 5, (big_s, len(small))
    assert max(small) < 0.1, small


def test_tokenize_and_detokenize_answer_in_parts(pre: Any) -> None:
    text = "".join(random.Random(2).choice("0123456789 ,.") for _ in range(400_000))

    async def go() -> tuple[dict[str, Any], int, dict[str, Any]]:
        parts = [p async for p in pre.tokenize({"prompt": text, "messages": None, "add_generation_prompt": True,
                                                "add_special_tokens": False})]

        async def again() -> Any:
            for p in parts:
                yield p

        reply = await join_reply(again())
        back = await join_reply(pre.detokenize(reply["tokens"]))
        return reply, len(parts), back

    reply, n_parts, back = asyncio.run(go())
    assert n_parts > 2 and reply["prompt"] == text and reply["count"] == len(reply["tokens"]) > 300_000
    assert reply["token_strs"] == pre.pre.tokenizer.convert_ids_to_tokens(reply["tokens"])
    assert back == {"prompt": text}
