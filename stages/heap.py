"""Hand freed heap memory back to the system after work that allocated a lot at once.

A 1 MB prompt leaves a CPU-stage replica at its peak RSS long after the request has gone: its
token lists, the tokenizer's encodings and a grammar compile's automata are many small allocations,
and glibc keeps the freed memory in its arenas for reuse instead of returning it. A replica that
once saw a huge prompt would otherwise hold that memory for its whole life, on every replica the
autoscaler starts.

The rule: a daemon thread per CPU-stage replica reads the process's RSS every ``period_s``; when it
has grown by ``grow_bytes`` since the last trim, it calls glibc's ``malloc_trim(0)``, which returns
the free pages of every arena. Growth below that threshold is trimmed once it has settled: the RSS
is ``settle_bytes`` above the last trim's and did not move over one period (the replica is idle),
so a run of mid-sized requests (grammar compiles after a huge prompt) cannot leave a replica tens
of MB above its floor for good. The check costs microseconds and a trim runs only after growth,
off the event loop (ctypes releases the GIL during the call). The engine's step process trims
after loading the model (:func:`trim_now`: the float state dict and the repacking's temporaries,
~250 MB for the embedded model) and when its step loop has gone idle; while it steps it is left
alone: its tensors are freed and reallocated every step, and returning those pages would make each
step fault them in again. Where libc has no ``malloc_trim`` (not glibc), this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time

logger = logging.getLogger("lifecycle.heap")

#: Seconds between RSS checks.
PERIOD_S = 2.0
#: RSS growth since the last trim that triggers the next one.
GROW_BYTES = 16 * 2**20
#: Smaller growth is trimmed once the RSS has stopped moving for a period.
SETTLE_BYTES = 2 * 2**20

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_started = False
_lock = threading.Lock()


def _malloc_trim():
    """glibc's ``malloc_trim``, or ``None`` where libc lacks it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_now() -> bool:
    """Return every arena's free pages to the system now; whether any were."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def rss_bytes() -> int:
    """This process's resident set size (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class HeapTrimmer:
    """Trims the heap when the RSS has grown by ``grow_bytes`` since the last trim."""

    def __init__(self, trim=None, rss=rss_bytes, grow_bytes: int = GROW_BYTES,
                 settle_bytes: int = SETTLE_BYTES) -> None:
        self._trim = trim
        self._rss = rss
        self.grow_bytes = grow_bytes
        self.settle_bytes = settle_bytes
        self.baseline = rss()
        self._last = self.baseline
        self.trims = 0

    def check(self) -> bool:
        """One check; returns whether it trimmed."""
        now, last = self._rss(), self._last
        self._last = now
        grown = now - self.baseline
        settled = grown >= self.settle_bytes and now == last
        if self._trim is None or (grown < self.grow_bytes and not settled):
            self.baseline = min(self.baseline, now)
            return False
        self._trim(0)
        self.trims += 1
        self.baseline = self._last = self._rss()
        return True


def start_trimmer(period_s: float = PERIOD_S) -> None:
    """Start this process's trimmer thread (once; later calls do nothing)."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
    trimmer = HeapTrimmer(_malloc_trim())
    if trimmer._trim is None:
        logger.info("no malloc_trim in this libc: freed heap memory stays with the process")
        return

    def run() -> None:
        while True:
            time.sleep(period_s)
            try:
                trimmer.check()
            except Exception:  # noqa: BLE001 - a failed check must not end the thread
                logger.exception("heap trim check failed")

    threading.Thread(target=run, name="heap-trimmer", daemon=True).start()
