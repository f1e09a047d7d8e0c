"""DiskStore: one file per block under a directory, written atomically, checksummed, LRU in a budget.

Why files and not LMDB: a block is tens of KB to a few MB, written once and read whole, which is what a
file system does well. POSIX `rename` gives per-block atomicity for free (write a temp file, fsync,
rename over the final name: a reader sees the old name absent or the whole new file, never half of
it), eviction is an `unlink` that returns the space at once, and the directory *is* the index, so a
restart rebuilds it with one scan. LMDB would add a dependency, a map size fixed up front, one writer
at a time across the whole store, and a file that never shrinks after eviction. Its strengths (many
tiny values, transactions across keys) are not needed here: blocks are independent.

File ``<root>/<first key byte hex>/<key hex>.kvb``:

    magic     4 bytes   b"KVD1"
    checksum  8 bytes   XXH3-64 of (key ‖ payload), little-endian
    key_len   2 bytes   u16
    key       key_len bytes
    payload   the rest

A read verifies magic, key and checksum; a block that fails (bit rot, truncation, a foreign file) is
deleted and reported missing. Temp files (``*.tmp``) left by a crash mid-write are removed at start.
The index (key → size, least recently used first) lives in memory, rebuilt at start from the files'
mtimes; a read refreshes the file's mtime so the LRU order survives a restart. One process per
directory: two engines sharing a directory would each count only their own bytes.

`on_change` (a `ChangeListener`, called under the lock) hears every key the index gains or loses from
then on; the index found at start is not reported (read it with `keys_lru_first`).
"""

from __future__ import annotations

import os
import struct
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import xxhash

from kvserve.tiers.store import BlockKey, ChangeListener, ChangeSet, TierStats

_MAGIC = b"KVD1"
_HEAD = struct.Struct("<4sQH")
_SUFFIX = ".kvb"
_TEMP_SUFFIX = ".tmp"
_CHUNK = 1 << 20


class DiskStore:
    """See the module docstring."""

    name = "disk"

    def __init__(self, root: str | Path, capacity_bytes: int, fsync: bool = True) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"disk cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.on_change: ChangeListener | None = None  # set by whoever mirrors the keys (KV events)
        self._index: OrderedDict[BlockKey, int] = OrderedDict()  # key -> file size, LRU first
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = TierStats(self.name, capacity_bytes=capacity_bytes, extra={"corrupt": 0, "temp_removed": 0})
        self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild_index()

    # --- the BlockStore protocol ----------------------------------------------------------------

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            for count, key in enumerate(keys):
                if key not in self._index:
                    return count
            return len(keys)

    def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        payloads = [self._read(key) for key in keys]
        with self._lock:
            hits = sum(p is not None for p in payloads)
            self._stats.hits += hits
            self._stats.misses += len(keys) - hits
        return payloads

    def put(self, items: Sequence[tuple[BlockKey, bytes]]) -> None:
        for key, payload in items:
            size = _HEAD.size + len(key) + len(payload)
            if size > self.capacity_bytes:
                continue
            try:
                self._write_atomic(key, payload)
            except OSError:
                with self._lock:
                    self._stats.errors += 1
                continue
            self._account_put(key, size)

    def delete(self, keys: Sequence[BlockKey]) -> None:
        self._drop(keys)

    def stats(self) -> TierStats:
        with self._lock:
            self._stats.blocks, self._stats.bytes = len(self._index), self._bytes
            return TierStats(**{**self._stats.as_dict(), "extra": dict(self._stats.extra)})

    def check_invariants(self) -> None:
        with self._lock:
            assert sum(self._index.values()) == self._bytes, "disk byte count differs from the index"
            assert self._bytes <= self.capacity_bytes, f"disk holds {self._bytes} > budget {self.capacity_bytes}"

    def close(self) -> None:
        """Nothing to flush: every put is durable when it returns."""

    def keys_lru_first(self) -> list[BlockKey]:
        with self._lock:
            return list(self._index)

    def watch(self, listener: ChangeListener) -> None:
        """Install `listener` as `on_change` and report every key already indexed as added, under one hold
        of the lock: a consumer that mirrors from here on neither misses nor reorders a change (the disk
        tier outlives the process, so it starts with blocks a new subscriber has never heard of)."""
        with self._lock:
            self.on_change = listener
            if self._index:
                listener(list(self._index), [])

    def path_of(self, key: BlockKey) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + _SUFFIX)

    # --- files ------------------------------------------------------------------------------------

    def _write_atomic(self, key: BlockKey, payload: bytes) -> None:
        """Temp file in the final directory, fsync, rename: the final name never names a torn file."""
        final = self.path_of(key)
        final.parent.mkdir(exist_ok=True)
        temp = final.parent / f".{final.name}.{uuid.uuid4().hex}{_TEMP_SUFFIX}"
        checksum = xxhash.xxh3_64_intdigest(key + payload)
        data = memoryview(_HEAD.pack(_MAGIC, checksum, len(key)) + key + payload)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            self._write_chunks(fd, data)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(temp, final)

    def _write_chunks(self, fd: int, data: memoryview) -> None:
        for start in range(0, len(data), _CHUNK):
            chunk = data[start : start + _CHUNK]
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]

    def _read(self, key: BlockKey) -> bytes | None:
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self.path_of(key)
        try:
            data = path.read_bytes()
            os.utime(path)
        except FileNotFoundError:  # evicted or deleted meanwhile
            self._forget([key])
            return None
        except OSError:
            self._count_error(corrupt=False)
            return None
        payload = _verify(key, data)
        if payload is None:
            self._count_error(corrupt=True)
            self._drop([key])
        return payload

    def _rebuild_index(self) -> None:
        found: list[tuple[float, BlockKey, int]] = []
        for path in self.root.glob("*/*"):
            if path.name.endswith(_TEMP_SUFFIX):
                path.unlink(missing_ok=True)
                self._stats.extra["temp_removed"] += 1
            elif path.name.endswith(_SUFFIX):
                try:
                    key = bytes.fromhex(path.name[: -len(_SUFFIX)])
                    stat = path.stat()
                except (ValueError, OSError):
                    continue
                found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        self._evict_over_budget()

    # --- index ------------------------------------------------------------------------------------

    def _account_put(self, key: BlockKey, size: int) -> None:
        """Index a file just written, then evict to the budget: one change, reported under the lock."""
        change = ChangeSet()
        with self._lock:
            old_size = self._index.pop(key, None)
            if old_size is None:
                change.add(key)  # rewriting a present key changes no key set
            self._bytes += size - (old_size or 0)
            self._index[key] = size
            self._stats.puts += 1
            evicted = self._pop_over_budget(change)
            change.report(self.on_change)
        self._unlink(evicted)

    def _evict_over_budget(self) -> None:
        change = ChangeSet()
        with self._lock:
            evicted = self._pop_over_budget(change)
            change.report(self.on_change)
        self._unlink(evicted)

    def _pop_over_budget(self, change: ChangeSet) -> list[BlockKey]:
        """Least recently used keys out of the index until it fits (caller holds the lock, unlinks)."""
        evicted: list[BlockKey] = []
        while self._bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self._stats.evictions += 1
            change.remove(key)
            evicted.append(key)
        return evicted

    def _unlink(self, keys: list[BlockKey]) -> None:
        for key in keys:
            self.path_of(key).unlink(missing_ok=True)

    def _drop(self, keys: Sequence[BlockKey]) -> None:
        self._unlink(self._forget(keys))

    def _forget(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Take `keys` out of the index; the ones that were in it (one change, reported under the lock)."""
        change = ChangeSet()
        with self._lock:
            for key in keys:
                size = self._index.pop(key, None)
                if size is not None:
                    self._bytes -= size
                    change.remove(key)
            change.report(self.on_change)
        return list(change.removed)

    def _count_error(self, corrupt: bool) -> None:
        with self._lock:
            self._stats.errors += 1
            if corrupt:
                self._stats.extra["corrupt"] += 1


def _verify(key: BlockKey, data: bytes) -> bytes | None:
    """The payload of a block file, or None when anything about it is wrong."""
    if len(data) < _HEAD.size:
        return None
    magic, checksum, key_len = _HEAD.unpack_from(data)
    if magic != _MAGIC or data[_HEAD.size : _HEAD.size + key_len] != key:
        return None
    payload = data[_HEAD.size + key_len :]
    if xxhash.xxh3_64_intdigest(key + payload) != checksum:
        return None
    return payload
