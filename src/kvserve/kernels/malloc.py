"""glibc's mmap threshold: pinned by a long-running server (server/heap.py says why), and whether it is.

glibc raises its mmap threshold to the size of any mapped block that is freed, after which the step's
varying large temporaries come from its arenas and fragment them (the soak's RSS crept). Pinned, every
temporary above the threshold is a fresh mapping instead, paid in page faults. The native layer loop reads
`mmap_threshold_pinned()` when it is built: pinned, it takes float32 steps of every size (its scratch is
mapped once and kept, csrc/scratch.h), since the Python loop's per-layer torch temporaries would each fault
in fresh pages (a 2,048-token prefill step: ~790k faults, 0.75x the speed; through the C loop ~25k).

The state lives here, at module level, because it mirrors a process-wide setting of the C library that
can be made once and not undone; nothing else in kvserve is process-global this way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


@dataclass(slots=True)
class _Pinned:
    threshold: int = 0  # bytes; 0: glibc's dynamic threshold


_PINNED = _Pinned()


def libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def pin_mmap_threshold(threshold: int) -> bool:
    """Pin glibc's mmap threshold at `threshold` bytes (> 0); False where there is no glibc `mallopt`."""
    if threshold <= 0:
        raise ValueError(f"mmap threshold must be > 0 bytes, got {threshold}")
    lib = libc()
    mallopt = getattr(lib, "mallopt", None) if lib is not None else None
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if not mallopt(M_MMAP_THRESHOLD, threshold):
        return False
    _PINNED.threshold = threshold
    return True


def mmap_threshold_pinned() -> int:
    """The threshold this process pinned (bytes), or 0 while glibc's dynamic threshold is in force."""
    return _PINNED.threshold
