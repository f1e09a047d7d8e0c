"""OpenMP and the threads of one process: keep the parallel work on the engine's thread.

libgomp (torch's copy, which the native kernels share) lets the workers of a parallel region spin while
they wait for the next region only while the threads it manages number no more than the CPUs. Each
thread that runs a parallel region of its own gets its own team, and on a 2-core machine a second team
tips it over: from then on every region's workers sleep between regions and each region pays their
wake-up, for the rest of the process (a 7-row decode step 37.6 ms instead of 18.8). So the server builds
and steps the engine on one thread (`AsyncEngine.spawn`), and a helper thread that may touch large
tensors (a tier's loader promoting blocks into host RAM copies 700 KiB buffers, which torch splits
across threads) first calls `serial_thread()`, after which its torch ops run on itself alone.
"""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (by path: a wheel may bundle it under another soname), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def serial_thread() -> bool:
    """Make the calling thread run torch's parallel ops on itself (an initializer for helper threads);
    False when there is no libgomp to tell (another OpenMP runtime, or none: nothing to do)."""
    torch.get_num_threads()  # torch's per-thread lazy init, which would later reset the count set below
    gomp = _libgomp()
    if gomp is None:
        return False
    gomp.omp_set_num_threads(1)
    return True
