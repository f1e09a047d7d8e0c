"""HostStore: blocks in host RAM within a byte budget, least recently used out first.

Each payload lives in its own uint8 tensor. With `pin_memory` (the default when CUDA is available) the
tensors are page-locked, so a device block is demoted with one asynchronous device→host copy
(`put_blocks`, a CUDA event marks when the bytes have landed) and loaded back with an asynchronous
host→device copy (`get_blocks` returns pinned views the engine copies with ``non_blocking=True``).
Readers wait for a pending event before touching the bytes. On CPU the same code copies synchronously.

What falls out of the budget is handed to `on_evict` (outside the lock) so the offload policy can
demote it to disk. `on_change` (a `ChangeListener`, called under the lock) hears every key that
enters or leaves, so KV events can mirror the tier.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvserve.tiers.codec import BlockCodec
from kvserve.tiers.store import BlockKey, ChangeListener, ChangeSet, TierStats

EvictCallback = Callable[[list[tuple[BlockKey, bytes]]], None]


@dataclass(slots=True)
class _Entry:
    buffer: torch.Tensor  # uint8 payload (header ‖ data), pinned when the store pins
    ready: torch.cuda.Event | None = None  # set while an async device→host copy may be in flight

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


class HostStore:
    """LRU over payloads in host memory; see the module docstring."""

    name = "host"

    def __init__(
        self, capacity_bytes: int, pin_memory: bool | None = None, on_evict: EvictCallback | None = None
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.on_evict = on_evict
        self.on_change: ChangeListener | None = None  # set by whoever mirrors the keys (KV events)
        self._entries: OrderedDict[BlockKey, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = TierStats(self.name, capacity_bytes=capacity_bytes)

    # --- the BlockStore protocol ----------------------------------------------------------------

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            for count, key in enumerate(keys):
                if key not in self._entries:
                    return count
            return len(keys)

    def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        buffers = self._touch(keys)
        return [None if b is None else b.numpy().tobytes() for b in buffers]

    def put(self, items: Sequence[tuple[BlockKey, bytes]]) -> None:
        entries = []
        for key, payload in items:
            buffer = self._alloc(len(payload))
            buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            entries.append((key, _Entry(buffer)))
        self._insert(entries)

    def delete(self, keys: Sequence[BlockKey]) -> None:
        change = ChangeSet()
        with self._lock:
            for key in keys:
                entry = self._entries.pop(key, None)
                if entry is not None:
                    self._bytes -= entry.buffer.numel()
                    change.remove(key)
            change.report(self.on_change)

    def stats(self) -> TierStats:
        with self._lock:
            self._stats.blocks, self._stats.bytes = len(self._entries), self._bytes
            self._stats.extra["pinned"] = self.pin_memory
            return TierStats(**self._stats.as_dict())

    def check_invariants(self) -> None:
        with self._lock:
            total = sum(entry.buffer.numel() for entry in self._entries.values())
            assert total == self._bytes, f"host bytes {self._bytes} != sum of entries {total}"
            assert self._bytes <= self.capacity_bytes, f"host holds {self._bytes} > budget {self.capacity_bytes}"

    def close(self) -> None:
        """Free the memory; reports no change (the process is going away, and its listener with it)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def keys_lru_first(self) -> list[BlockKey]:
        """Keys from least to most recently used (tests and debugging)."""
        with self._lock:
            return list(self._entries)

    # --- the tensor path (pinned + async on CUDA) -----------------------------------------------

    def put_blocks(
        self, keys: Sequence[BlockKey], pool_tensor: torch.Tensor, block_ids: Sequence[int], codec: BlockCodec
    ) -> None:
        """Demote pool blocks `block_ids` under `keys` without a host round trip through `bytes`."""
        header = torch.frombuffer(bytearray(codec.header), dtype=torch.uint8)
        asynchronous = pool_tensor.is_cuda and self.pin_memory
        entries = []
        for key, block_id in zip(keys, block_ids, strict=True):
            buffer = self._alloc(codec.payload_bytes)
            buffer[: header.numel()].copy_(header)
            data = buffer[header.numel() :].view(codec.dtype).view(codec.shape)
            data.copy_(pool_tensor[:, :, block_id], non_blocking=asynchronous)
            entries.append((key, _Entry(buffer)))
        if asynchronous:
            event = torch.cuda.Event()
            event.record()
            for _, entry in entries:
                entry.ready = event
        self._insert(entries)

    def get_blocks(self, keys: Sequence[BlockKey], codec: BlockCodec) -> list[torch.Tensor | None]:
        """Block tensors (views of the stored, possibly pinned, buffers); None where missing or of
        another layout. The caller copies them into the pool before the next `put`/`delete`."""
        header = codec.header
        blocks: list[torch.Tensor | None] = []
        for buffer in self._touch(keys):
            if buffer is None or buffer.numel() != codec.payload_bytes:
                blocks.append(None)
            elif buffer[: len(header)].numpy().tobytes() != header:
                blocks.append(None)
            else:
                blocks.append(buffer[len(header) :].view(codec.dtype).view(codec.shape))
        return blocks

    # --- internals ------------------------------------------------------------------------------

    def _alloc(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    def _touch(self, keys: Sequence[BlockKey]) -> list[torch.Tensor | None]:
        found: list[_Entry | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                found.append(entry)
            hits = sum(entry is not None for entry in found)
            self._stats.hits += hits
            self._stats.misses += len(found) - hits
        for entry in found:
            if entry is not None:
                entry.wait()
        return [None if entry is None else entry.buffer for entry in found]

    def _insert(self, entries: list[tuple[BlockKey, _Entry]]) -> None:
        evicted: list[tuple[BlockKey, _Entry]] = []
        change = ChangeSet()
        with self._lock:
            for key, entry in entries:
                size = entry.buffer.numel()
                if size > self.capacity_bytes:
                    continue  # can never fit; not stored
                old = self._entries.pop(key, None)
                if old is not None:
                    self._bytes -= old.buffer.numel()
                else:
                    change.add(key)  # replacing a present key changes no key set
                self._entries[key] = entry
                self._bytes += size
                self._stats.puts += 1
                while self._bytes > self.capacity_bytes:
                    old_key, old_entry = self._entries.popitem(last=False)
                    self._bytes -= old_entry.buffer.numel()
                    self._stats.evictions += 1
                    evicted.append((old_key, old_entry))
                    change.remove(old_key)
            change.report(self.on_change)
        if evicted and self.on_evict is not None:
            payloads = []
            for key, entry in evicted:
                entry.wait()
                payloads.append((key, entry.buffer.numpy().tobytes()))
            self.on_evict(payloads)
