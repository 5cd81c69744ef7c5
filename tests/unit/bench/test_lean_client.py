"""``bench.lean_client``: the benchmark's low-overhead client counts what the httpx client counts.

The chunked decoder against every split of a real body. The client against the real app is in
``tests/app/test_lean_client.py``.
"""

from __future__ import annotations

import pytest

from bench.lean_client import _Chunked


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


EVENTS = [b'data: {"choices":[{"index":0,"text":"a\\"text\\":\\"b"}]}\n\n',  # an escaped pattern in a text
          b'data: {"choices":[{"index":0,"text":""}]}\n\n',
          b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\n', b"data: [DONE]\n\n"]
BODY = b"".join(_chunk(e) for e in EVENTS) + b"0\r\n\r\n"


@pytest.mark.parametrize("step", [1, 2, 3, 7, len(BODY)])
def test_chunked_decoder_any_split(step: int) -> None:
    dec = _Chunked()
    out = b"".join(dec.feed(BODY[i:i + step]) for i in range(0, len(BODY), step))
    assert out == b"".join(EVENTS)
    assert dec.done
    # What is left is the body's closing blank line (or part of it), nothing of the payload.
    assert bytes(dec.buf) in (b"", b"\r", b"\r\n")
