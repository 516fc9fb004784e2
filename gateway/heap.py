"""Giving freed heap memory back to the system, so that a gateway's memory levels off.

glibc's malloc keeps what a process frees inside its heap and arenas, and returns it to the
system only from the top of the heap. A gateway allocates and frees a little for every
request (bodies, answers, parsed JSON, token ids), so its resident memory crept up although
what it holds did not: in a soak (`benchmarks/soak_http.py`, issue 38) RSS grew about 40
bytes per request while Python's allocated blocks only swung within 420,000-445,000 from
71,000 to 81,000 requests (an in-process probe, tracing from 30,000), and one `malloc_trim(0)`
(through gdb, at about 65,000 requests) gave back 10 MB of a 103 MB process.
`HeapTrimmer` calls `malloc_trim(0)` every `TRIM_INTERVAL_S` in a worker thread (ctypes
releases the GIL: the event loop keeps serving). Where there is no glibc (musl, macOS) it
does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_INTERVAL_S = 30.0
"""How often freed heap memory is given back: often enough that RSS follows what the
process holds within a minute, rare enough that its cost (a walk of the heap, in a thread)
does not count."""


def glibc_trim() -> Callable[[], int] | None:
    """glibc's `malloc_trim(0)` as a callable, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def call() -> int:
        return int(trim(0))

    return call


class HeapTrimmer:
    """Every `interval_s`, `trim()` in a worker thread; `start` and `stop` with the runtime.
    `trim` None: glibc's, if there is one (else nothing runs)."""

    def __init__(
        self, interval_s: float = TRIM_INTERVAL_S, trim: Callable[[], int] | None = None
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        self.trim = trim if trim is not None else glibc_trim()
        self.calls = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.trim is not None and self._task is None:
            self._task = asyncio.create_task(self._run(), name="heap-trimmer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        assert self.trim is not None
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await asyncio.to_thread(self.trim)
            except Exception:  # never take the gateway down for this
                log.exception("malloc_trim failed; heap trimming stops")
                return
            self.calls += 1
