"""The kernels' scratch arenas (csrc/scratch.h) seen process-wide: every loaded kernel library's, for the
server's periodic heap trim (server/heap.py), which holds no handle on the engine's model."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

# These return int64. Optional: a library built from sources before the scratch arena (benchmarks' `--before`
# builds of older revisions) lacks them, and has no arena to release (its calls then return 0).
_SCRATCH_SIGNATURES = {"kv_scratch_release": [ctypes.c_int64], "kv_scratch_mapped": []}


def bind_scratch(lib: ctypes.CDLL) -> None:
    for name, argtypes in _SCRATCH_SIGNATURES.items():
        function = getattr(lib, name, None)
        if function is None:
            continue
        function.argtypes = argtypes
        function.restype = ctypes.c_int64


def loaded_libraries() -> list[ctypes.CDLL]:
    """The kernel libraries this process has loaded (`libkvkernels-*.so` in /proc/self/maps, whatever sources
    they were built from), opened without loading anything (RTLD_NOLOAD); empty where none is (torch kernels,
    no compiler, not Linux). The scratch arenas are per process, like glibc's heaps, so the server's periodic
    heap trim (server/heap.py) reaches them without a handle on the engine's model."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths = {line.split(maxsplit=5)[5] for line in maps.splitlines()
             if line.count(" ") >= 5 and "/libkvkernels-" in line and line.endswith(".so")}
    libraries = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        except OSError:
            continue
        bind_scratch(lib)
        libraries.append(lib)
    return libraries


def scratch_call(lib: ctypes.CDLL, name: str, *args: int) -> int | None:
    """A scratch entry point's answer, or None for a library built before the arena (no such entry)."""
    function = getattr(lib, name, None)
    return int(function(*args)) if function is not None else None


def _over_loaded(name: str, *args: int) -> int | None:
    answers = [answer for lib in loaded_libraries() if (answer := scratch_call(lib, name, *args)) is not None]
    return sum(answers) if answers else None


def release_idle_scratch(min_idle_s: float) -> int | None:
    """`NativeLibrary.release_scratch` on every loaded kernel library: the bytes unmapped (None: none loaded)."""
    return _over_loaded("kv_scratch_release", int(min_idle_s * 1000))


def scratch_mapped() -> int | None:
    """`NativeLibrary.scratch_mapped` summed over the loaded kernel libraries (None: none loaded)."""
    return _over_loaded("kv_scratch_mapped")
