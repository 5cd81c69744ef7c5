"""The heap trimmer: trims after the RSS has grown by its threshold, or by less once it has
settled, and really returns memory."""

from __future__ import annotations

import ctypes

from stages.heap import HeapTrimmer, _malloc_trim, rss_bytes


def test_trims_only_after_growth_and_measures_from_the_trimmed_size() -> None:
    rss = [100]
    calls: list[int] = []

    def trim(pad: int) -> int:
        calls.append(pad)
        rss[0] -= 30  # what the trim returned
        return 1

    t = HeapTrimmer(trim, rss=lambda: rss[0], grow_bytes=50, settle_bytes=10**9)
    rss[0] = 140
    assert not t.check() and calls == []  # grew by 40 < 50
    rss[0] = 160
    assert t.check() and calls == [0] and t.baseline == 130
    rss[0] = 120  # shrank by itself: the baseline follows it down
    assert not t.check() and t.baseline == 120
    rss[0] = 171
    assert t.check() and t.trims == 2


def test_smaller_growth_is_trimmed_once_it_has_settled() -> None:
    rss = [100]
    calls: list[int] = []

    def trim(pad: int) -> int:
        calls.append(pad)
        rss[0] = 101
        return 1

    t = HeapTrimmer(trim, rss=lambda: rss[0], grow_bytes=50, settle_bytes=5)
    rss[0] = 110
    assert not t.check()  # still moving (100 -> 110)
    rss[0] = 120
    assert not t.check()  # still moving
    assert t.check() and calls == [0] and t.baseline == 101  # 120 twice: settled, 20 above the floor
    assert not t.check() and calls == [0]  # trimmed: nothing more to do while it stays put
    rss[0] = 104
    assert not t.check()
    assert not t.check() and calls == [0]  # settled, but within settle_bytes of the last trim


def test_without_malloc_trim_it_never_trims() -> None:
    t = HeapTrimmer(None, rss=lambda: 10**12, grow_bytes=1)
    assert not t.check()


def test_malloc_trim_returns_memory_that_free_keeps() -> None:
    """Real glibc: 64 MiB in small blocks, one block in 64 kept alive. The freed runs between the
    survivors are free chunks of many pages that ``free`` keeps in the heap (only the heap's top
    shrinks by itself); the trim returns them."""
    trim = _malloc_trim()
    assert trim is not None, "this machine's libc is glibc"
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    blocks = []
    for _ in range(64 * 1024):
        b = libc.malloc(1000)
        libc.memset(b, 1, 1000)
        blocks.append(b)
    for i, b in enumerate(blocks):
        if i % 64:
            libc.free(b)
    before = rss_bytes()
    trim(0)
    after = rss_bytes()
    for b in blocks[::64]:
        libc.free(b)
    assert before - after > 32 * 2**20, (before, after)
