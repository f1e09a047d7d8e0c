"""Hand freed heap memory back to the OS now and then (glibc's `malloc_trim`), so RSS tracks live memory.

Requests come and go on several threads (the event loop, the input workers, the engine thread), and
glibc keeps what they free in its arenas instead of returning it. In the soak the server's RSS grew
30-40 MiB a minute while the Python heap stayed flat (tracemalloc: ~1 MiB over 3 minutes) and no
cyclic garbage held memory (a full `gc.collect()` every 30 s lowered RSS by nothing), whereas
`malloc_trim(0)` every 30 s returned 30-40 MiB each time (about 190 MiB the first time: model loading's
temporaries) in a few milliseconds. So the server calls it every `interval` seconds, on a worker thread
(it takes the allocator's locks, never the GIL-bound event loop's time). Without glibc it does nothing.

The native kernels keep their scratch (csrc/scratch.h: per-thread arenas mapped once, grown to the largest
step, never freed while serving, so glibc's dynamic mmap threshold no longer climbs with them); an arena
idle for SCRATCH_IDLE_S (no step on its thread: the engine has been idle that long) is unmapped at the
next trim, so an idle server gives it back. A busy engine uses its arenas every step and keeps them: remapping
costs page faults on the next large step (~4,000 for a 17 MiB prefill buffer, a few ms), nothing after a
minute of idleness.

For investigations, each trim can also log: `KVSERVE_HEAP_LOG=1` glibc's statistics, `KVSERVE_TRACEMALLOC=N`
the Python heap's growth by site, `KVSERVE_HEAP_TYPES=1` the object types whose count grew (the soak's
later growth showed up there as `tiers.host._Entry` and `torch.Tensor`: the host KV tier filling).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import logging
import os
import tracemalloc
from collections.abc import AsyncIterator

from kvserve.kernels.malloc import libc as _libc
from kvserve.kernels.malloc import pin_mmap_threshold
from kvserve.kernels.scratch import release_idle_scratch, scratch_mapped
from kvserve.server.periodic import every

TRIM_INTERVAL_S = 30.0
SCRATCH_IDLE_S = 60.0  # an arena unused this long is unmapped at the next trim
SERVER_MMAP_THRESHOLD = 256 * 1024  # bytes: glibc's mmap threshold pinned at server start (fix_mmap_threshold)
MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                    "fordblks", "keepcost")
logger = logging.getLogger("uvicorn.error")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]


def heap_stats() -> dict[str, int]:
    """glibc's `mallinfo2()` summed over all arenas, in bytes (empty without glibc >= 2.33): `arena` is
    what the arenas took from the OS by brk/mmap, `hblkhd` the large mmap'd blocks, `uordblks` in use,
    `fordblks` free but kept."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {name: int(getattr(info, name)) for name in MALLINFO2_FIELDS}


def _malloc_trim():
    libc = _libc()
    return getattr(libc, "malloc_trim", None) if libc is not None else None  # not glibc: nothing to trim


def trim_heap(log: bool = False) -> bool:
    """Return free heap pages to the OS; False where the C library has no `malloc_trim`. `log`: one line
    with the heap's statistics (MiB) before and after."""
    trim = _malloc_trim()
    if trim is None:
        return False
    before = heap_stats() if log else {}
    trim(0)
    if log:
        after = heap_stats()
        scratch = scratch_mapped()
        logger.info("heap (MiB, before -> after trim): %s%s", ", ".join(
            f"{k} {before[k] / 2**20:.1f} -> {after[k] / 2**20:.1f}" for k in ("arena", "hblkhd", "uordblks",
                                                                                "fordblks") if k in after),
            "" if scratch is None else f", kernel scratch {scratch / 2**20:.1f}")
    return True


def release_scratch(min_idle_s: float = SCRATCH_IDLE_S, log: bool = False) -> int:
    """Unmap the native kernels' scratch arenas idle for `min_idle_s` (csrc/scratch.h); the bytes unmapped
    (0 without the native kernels)."""
    released = release_idle_scratch(min_idle_s) or 0
    if log and released:
        logger.info("kernel scratch: %.1f MiB idle for %.0f s unmapped", released / 2**20, min_idle_s)
    return released


def fix_mmap_threshold(threshold: int | None = None) -> bool:
    """Pin glibc's mmap threshold at `threshold` bytes (default: KVSERVE_MMAP_THRESHOLD, else
    SERVER_MMAP_THRESHOLD; 0 leaves glibc's dynamic threshold). False: not pinned (0, not glibc, or the
    operator set it already through MALLOC_MMAP_THRESHOLD_ / GLIBC_TUNABLES). Called once at server start,
    before the model loads (kernels/malloc.py records it; the layer loop reads it).

    Why the server pins it: glibc starts at 128 KiB but raises the threshold to the size of any mmap'd
    block that is freed (up to 32 MiB), and the server frees such blocks every step (torch's activations,
    whose sizes vary with the step's rows), so soon nearly all of them come from the arenas, where blocks
    of varying sizes fragment them: under a load of mixed prefills the arenas' free-but-kept memory grew
    15 -> 66-250 MiB in minutes and the RSS less the KV pool and the host tier crept up (1.5-8 MiB/min) and
    sawed between trims. Pinned at 256 KiB the arenas stayed flat (free 11-16 MiB) and so did that RSS; at
    4 MiB they did not. The price: every larger temporary is a fresh mapping. The native kernels' scratch
    does not pay it (csrc/scratch.h: mapped once and kept), and pinned, the layer loop takes float32 steps of
    every size (the Python loop's torch temporaries faulted ~790k pages per 2,048-row step); what is left
    is torch's per-step tensors outside the loop (the logits: ~1% of a 16-row decode step) and the C loop
    being a little slower than torch's GEMM beyond 512 rows (a 2,048-token prefill ~0.93x, idle, 2 threads).
    `LLM()` (offline batches, short-lived) keeps glibc's default; KVSERVE_MMAP_THRESHOLD=0 turns the pin off
    (benchmarks/results/soak.md, "scratch arena" and the idle soak after it)."""
    env = os.environ
    if threshold is None:
        threshold = int(env.get("KVSERVE_MMAP_THRESHOLD", SERVER_MMAP_THRESHOLD))
    if threshold <= 0 or "MALLOC_MMAP_THRESHOLD_" in env or "mmap_threshold" in env.get("GLIBC_TUNABLES", ""):
        return False
    return pin_mmap_threshold(threshold)


def freeze_startup_objects() -> int:
    """Move every object alive now (the model's, the tokenizer's, the app's) out of the cyclic collector's
    reach, as vLLM's engine core does after start-up; returns how many were frozen.

    Why: a full collection walks every tracked object, and a loaded server tracks ~200k that live as long
    as it does: `gc.collect(2)` took 55 ms on this machine, a pause of the thread that triggers it (with
    the GIL, so the engine's Python too) whenever the request traffic's garbage set one off; frozen, 0.1
    ms. Objects created later are collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class PythonHeapDiff:
    """KVSERVE_TRACEMALLOC=N (frames): the Python allocations that grew most since the first trim, logged
    at each trim (investigation only: tracing costs speed). Tells Python-object growth from native."""

    def __init__(self, frames: int) -> None:
        tracemalloc.start(frames)
        self._first: tracemalloc.Snapshot | None = None

    def log(self, top: int = 8) -> None:
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        if self._first is None:
            self._first = snapshot
            return
        traced = tracemalloc.get_traced_memory()[0] / 2**20
        diffs = snapshot.compare_to(self._first, "traceback")[:top]
        logger.info("python heap: %.1f MiB traced; grew most: %s", traced, " | ".join(
            f"{d.size_diff / 2**20:+.2f} MiB {d.count_diff:+d} at {' < '.join(str(f) for f in d.traceback[:4])}"
            for d in diffs))


class ObjectCensus:
    """KVSERVE_HEAP_TYPES=1: the gc-tracked object types whose count grew most since the first trim, and
    the process's thread count (each new thread may get its own glibc arena), logged at each trim
    (investigation only: a walk over every tracked object, holding the GIL for a fraction of a second)."""

    def __init__(self) -> None:
        self._first: collections.Counter[str] | None = None

    @staticmethod
    def count() -> collections.Counter[str]:
        return collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())

    def log(self, top: int = 10) -> None:
        counts = self.count()
        if self._first is None:
            self._first = counts
            return
        counts.subtract(self._first)
        threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1
        logger.info("python objects: %d threads; grew most: %s", threads, ", ".join(
            f"{name} {n:+d}" for name, n in counts.most_common(top) if n > 0))


@contextlib.asynccontextmanager
async def periodic_trim(interval: float = TRIM_INTERVAL_S, log: bool = False) -> AsyncIterator[None]:
    """Run `trim_heap()` on a worker thread every `interval` seconds while the context is open (0: never)."""
    frames = int(os.environ.get("KVSERVE_TRACEMALLOC", "0") or 0)
    python_heap = PythonHeapDiff(frames) if frames > 0 else None
    census = ObjectCensus() if os.environ.get("KVSERVE_HEAP_TYPES") else None

    def job() -> bool:
        if python_heap is not None:
            python_heap.log()
        if census is not None:
            census.log()
        release_scratch(log=log)
        return trim_heap(log=True) if log else trim_heap()

    async with every(interval if _malloc_trim() is not None else 0, job, in_thread=True):
        yield
