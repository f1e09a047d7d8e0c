"""Where a process's resident memory lives, by kind of mapping: `python benchmarks/rss_maps.py PID [--every 15]`.

The soak's RSS is one number; this splits /proc/PID/smaps into the kinds that grow for different
reasons: glibc's main heap (`[heap]`, brk), glibc's per-thread arenas (64 MiB-aligned anonymous
reservations), pymalloc's 1 MiB arenas, the KV pool (the largest anonymous shared mapping), other
anonymous mappings (large mmap'd mallocs, torch's big tensors), and file-backed pages. With --every it
prints one line per sample until the process ends.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ARENA_ALIGN = 64 << 20  # glibc HEAP_MAX_SIZE on 64-bit: non-main arenas are reserved this big and aligned
PYMALLOC_ARENA = 1 << 20


def classify(header: list[str], size_kib: int) -> str:
    start = int(header[0].split("-")[0], 16)
    perms = header[1]
    path = header[5] if len(header) > 5 else ""
    if path == "[heap]":
        return "heap"
    if path.startswith("/") and not path.startswith("/dev/zero"):
        return "file"
    if path.startswith("["):
        return "other"
    if perms[3] == "s":
        return "shared"  # the KV pool (mmap(-1) shared)
    if start % ARENA_ALIGN == 0 and size_kib * 1024 <= ARENA_ALIGN:
        return "arena"
    if size_kib * 1024 == PYMALLOC_ARENA:
        return "pymalloc"
    return "anon"


def sample(pid: int) -> dict[str, float]:
    """Resident MiB by kind (and a count of pymalloc-sized mappings)."""
    totals: dict[str, float] = {}
    header: list[str] | None = None
    size_kib = 0
    counts = 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(" ", 1)[0]
        if "-" in first and not first.endswith(":"):
            header = line.split()
        elif line.startswith("Size:"):
            size_kib = int(line.split()[1])
        elif line.startswith("Rss:") and header is not None:
            kind = classify(header, size_kib)
            totals[kind] = totals.get(kind, 0.0) + int(line.split()[1]) / 1024
            counts += kind == "pymalloc"
    totals["n_pymalloc"] = counts
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("--every", type=float, default=0.0, help="seconds between samples (0: one sample)")
    args = parser.parse_args()
    began = time.monotonic()
    while True:
        try:
            kinds = sample(args.pid)
        except (FileNotFoundError, ProcessLookupError):
            return 0
        print(f"[{time.monotonic() - began:6.0f}s] " + ", ".join(
            f"{k} {v:.0f}" for k, v in sorted(kinds.items())), flush=True)
        if args.every <= 0:
            return 0
        time.sleep(args.every)


if __name__ == "__main__":
    raise SystemExit(main())
