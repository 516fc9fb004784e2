"""The heap trimmer (issue 38): gives freed heap memory back on a period, off the event
loop, and stops with the runtime."""

import asyncio

import pytest

from gateway.heap import HeapTrimmer, glibc_trim


async def test_it_trims_every_interval_in_a_thread_and_stops():
    loops: list[bool] = []

    def trim() -> int:
        try:
            asyncio.get_running_loop()
            loops.append(True)  # on the event loop: wrong
        except RuntimeError:
            loops.append(False)  # in a worker thread
        return 1

    trimmer = HeapTrimmer(0.01, trim)
    trimmer.start()
    await asyncio.sleep(0.2)
    await trimmer.stop()
    calls = trimmer.calls
    assert calls >= 3 and loops and not any(loops)
    await asyncio.sleep(0.05)
    assert trimmer.calls == calls  # stopped


async def test_a_failing_trim_stops_trimming_without_raising(caplog):
    def trim() -> int:
        raise OSError("no")

    trimmer = HeapTrimmer(0.01, trim)
    trimmer.start()
    await asyncio.sleep(0.1)
    assert trimmer.calls == 0 and "malloc_trim failed" in caplog.text
    await trimmer.stop()


def test_glibc_trim_is_found_on_this_linux_and_gives_memory_back():
    trim = glibc_trim()
    assert trim is not None  # the machines this project runs on use glibc (Debian)
    assert trim() in (0, 1)


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError):
        HeapTrimmer(0)
