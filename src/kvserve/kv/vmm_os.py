"""The few memory-mapping calls the VMM prototype needs, through ctypes (Linux only).

Python's `mmap.mmap` cannot place a mapping at a chosen address (no MAP_FIXED), and placing one file page
range at a chosen virtual address is the whole point: a sequence's range is reserved once (PROT_NONE,
no memory behind it) and physical blocks of one memfd are mapped into it with MAP_SHARED | MAP_FIXED as
the sequence grows -- the CPU analogue of ``cuMemAddressReserve`` + ``cuMemMap``. Every call is counted,
because the syscall count is what the benchmark compares against a block table's zero.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass, field

PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
MAP_POPULATE = 0x8000
MAP_FAILED = ctypes.c_void_p(-1).value
PAGE_SIZE = mmap.PAGESIZE


@dataclass(slots=True)
class SyscallCounts:
    mmap: int = 0
    munmap: int = 0

    @property
    def total(self) -> int:
        return self.mmap + self.munmap


@dataclass(slots=True)
class Mapper:
    """Counted ``mmap``/``munmap`` from libc; errors are OSError with errno and the call's arguments."""

    counts: SyscallCounts = field(default_factory=SyscallCounts)
    _mmap: ctypes._CFuncPtr = field(init=False, repr=False)
    _munmap: ctypes._CFuncPtr = field(init=False, repr=False)

    def __post_init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._mmap = libc.mmap
        self._mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long]
        self._mmap.restype = ctypes.c_void_p
        self._munmap = libc.munmap
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._munmap.restype = ctypes.c_int

    def reserve(self, length: int) -> int:
        """A PROT_NONE range of `length` bytes with nothing behind it (touching it is a SIGSEGV)."""
        return self._call(None, length, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)

    def unreserve_range(self, address: int, length: int) -> None:
        """Replace whatever is mapped at [address, address+length) by PROT_NONE again: one syscall."""
        self._call(address, length, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0)

    def map_file(self, address: int, length: int, fd: int, offset: int, populate: bool = False) -> int:
        """Map file bytes [offset, offset+length) read/write and shared at exactly `address`."""
        flags = MAP_SHARED | MAP_FIXED | (MAP_POPULATE if populate else 0)
        return self._call(address, length, PROT_READ | PROT_WRITE, flags, fd, offset)

    def map_whole(self, length: int, fd: int) -> int:
        """The whole file, shared, wherever the kernel likes (the flat, block-table view of the pool)."""
        return self._call(None, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)

    def unmap(self, address: int, length: int) -> None:
        self.counts.munmap += 1
        if self._munmap(address, length) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap({address:#x}, {length}): {os.strerror(err)}")

    def _call(self, address: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
        self.counts.mmap += 1
        result = self._mmap(address, length, prot, flags, fd, offset)
        if result is None or result == MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap(addr={address}, len={length}, fd={fd}, off={offset}): {os.strerror(err)}")
        if flags & MAP_FIXED and result != address:
            raise OSError(f"MAP_FIXED mapping landed at {result:#x}, not {address:#x}")
        return result


def memfd(nbytes: int, name: str = "kvserve-kv") -> int:
    """An anonymous shared-memory file of `nbytes` (zero-filled, committed page by page on first touch)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    return fd


def coalesce(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive ids as ``(position in the list, first id, length)``: one mmap per run."""
    runs: list[tuple[int, int, int]] = []
    for position, block_id in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block_id:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((position, block_id, 1))
    return runs
