"""The server's heap care (server/heap.py): the periodic trim runs off the event loop, on schedule, and
stops; the opt-in pinned mmap threshold gives host-tier-sized blocks mappings of their own."""

from __future__ import annotations

import asyncio
import os
import platform
import subprocess
import sys
import threading

import pytest

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


def test_periodic_trim_releases_kernel_scratch_idle_for_a_while(monkeypatch, caplog):
    """Each trim unmaps the native kernels' scratch arenas idle for SCRATCH_IDLE_S (csrc/scratch.h) and, with
    the heap log on, says how much."""
    asked: list[float] = []
    monkeypatch.setattr(heap, "trim_heap", lambda log=False: True)
    monkeypatch.setattr(heap, "_malloc_trim", lambda: object())
    monkeypatch.setattr(heap, "release_idle_scratch", lambda idle: asked.append(idle) or 3 * 2**20)

    async def scenario() -> None:
        async with heap.periodic_trim(0.01, log=True):
            await asyncio.sleep(0.1)

    with caplog.at_level("INFO", logger="uvicorn.error"):
        asyncio.run(scenario())
    assert asked and set(asked) == {heap.SCRATCH_IDLE_S}
    assert "kernel scratch: 3.0 MiB idle for 60 s unmapped" in caplog.text


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


PINNED_PROBE = """
import ctypes, os, sys
from kvserve.kernels.malloc import mmap_threshold_pinned
from kvserve.server.heap import fix_mmap_threshold, heap_stats
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_void_p,)
for mode, env in (("pin", {"KVSERVE_MMAP_THRESHOLD": "262144"}), ("default", {}),
                  ("off", {"KVSERVE_MMAP_THRESHOLD": "0"}),
                  ("env", {"KVSERVE_MMAP_THRESHOLD": "262144", "MALLOC_MMAP_THRESHOLD_": "1"})):
    if os.fork() == 0:  # a fresh child per mode: the threshold is process-wide
        os.environ.update(env)
        pinned = fix_mmap_threshold()
        assert mmap_threshold_pinned() == (262144 if pinned else 0)
        libc.free(libc.malloc(8 << 20))  # a freed 8 MiB mapping: glibc's dynamic threshold rises to 8 MiB
        before = heap_stats()["hblkhd"]
        block = libc.malloc(700 << 10)  # a host-tier-sized block
        print(mode, pinned, heap_stats()["hblkhd"] - before, flush=True)
        os._exit(0)
    os.wait()
"""


@pytest.mark.skipif(not heap.heap_stats(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_pinned_mmap_threshold_gives_large_blocks_their_own_mapping():
    """Pinned (at the server's start: 256 KiB by default, or KVSERVE_MMAP_THRESHOLD), a 700 KiB block is its
    own mapping even after a large block was freed; with glibc's dynamic threshold (KVSERVE_MMAP_THRESHOLD=0;
    or when the operator set MALLOC_MMAP_THRESHOLD_, which is then left alone: glibc reads it only at its
    start, so here it changes nothing) it comes from an arena instead."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for name in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES", "KVSERVE_MMAP_THRESHOLD"):
        env.pop(name, None)
    lines = subprocess.run([sys.executable, "-c", PINNED_PROBE], env=env, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    results = {mode: (pinned, int(mapped)) for mode, pinned, mapped in (line.split() for line in lines)}
    assert results["pin"][0] == "True" and results["pin"][1] >= 700 << 10, results
    assert results["default"] == results["pin"], results  # the server pins 256 KiB unless told otherwise
    assert results["off"] == ("False", 0), results
    assert results["env"] == ("False", 0), results
