"""The server's periodic heap trim (server/heap.py): it runs off the event loop, on schedule, and stops."""

from __future__ import annotations

import asyncio
import platform
import threading

from kvserve.server import heap


def test_trim_heap_works_on_glibc():
    assert heap.trim_heap() is (platform.libc_ver()[0] == "glibc")


def test_periodic_trim_runs_on_a_worker_thread_until_closed(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(threading.current_thread().name))
    monkeypatch.setattr(heap, "_malloc_trim", lambda: object())  # as on glibc, wherever the test runs

    async def scenario() -> int:
        async with heap.periodic_trim(0.01):
            await asyncio.sleep(0.2)
        count = len(calls)
        await asyncio.sleep(0.05)
        assert len(calls) == count  # closed: no more trims
        return count

    assert asyncio.run(scenario()) >= 3
    assert threading.main_thread().name not in calls  # never on the event loop's thread


def test_interval_zero_never_trims(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(1))

    async def scenario() -> None:
        async with heap.periodic_trim(0):
            await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert calls == []


def test_python_heap_diff_names_what_grew(caplog):
    """KVSERVE_TRACEMALLOC's logger: the first call only records; the next names the growth's site."""
    import logging
    import tracemalloc

    was_tracing = tracemalloc.is_tracing()
    diff = heap.PythonHeapDiff(frames=1)
    try:
        diff.log()
        held = [str(i) * 8 for i in range(50_000)]  # a few MiB of new str objects, held on this line
        with caplog.at_level(logging.INFO, logger="uvicorn.error"):
            diff.log()
    finally:
        if not was_tracing:
            tracemalloc.stop()
    lines = [r.getMessage() for r in caplog.records if "python heap" in r.getMessage()]
    assert len(lines) == 1 and "test_heap.py" in lines[0], lines
    assert len(held) == 50_000
