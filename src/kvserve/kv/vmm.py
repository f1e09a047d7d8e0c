"""A prototype of the virtual-contiguous KV cache (vAttention / kvcached's idea, on CPU with mmap).

Block tables make attention look a block id up for every `block_size` tokens. The alternative maps the
physical blocks of one shared pool into a *contiguous virtual range per sequence*, so attention reads
each sequence's K and V as plain contiguous arrays and sharing a prefix is mapping the same physical
pages into several ranges. This module builds that on Linux and measures what it costs
(benchmarks/vmm.py, docs/vmm.md); it is not wired into the engine.

Physical memory: one memfd laid out exactly as `KVPool` -- ``[layer, k|v, block, block_size, kv_heads,
head_dim]`` -- and mapped whole once (the *flat* view, what the block-table kernel reads), so both views
alias the same bytes. One layer's K (or V) block is the unit mapped, so it must be whole pages: 16 tokens
x 3 KV heads x 64 dims x 4 bytes = 12 KiB for the default model in float32 (3 pages).

Virtual memory: one PROT_NONE reservation of ``slots x [layer, k|v, max_blocks]`` blocks::

    base + slot * slot_bytes + (layer * 2 + kv) * max_blocks * block_bytes + j * block_bytes
         = position j of that sequence's K (kv=0) or V (kv=1) range of that layer

A sequence's slot region is contiguous, so freeing it is one mmap(PROT_NONE, MAP_FIXED) over the slot;
mapping a run of consecutive physical blocks into one (layer, kv) range is one mmap, so growing by a run
costs ``2 * num_layers`` syscalls.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.kv.block_allocator import BlockAllocator
from kvserve.kv.vmm_os import PAGE_SIZE, Mapper, coalesce, memfd


@dataclass(slots=True)
class VmmShape:
    num_layers: int
    num_blocks: int  # physical blocks in the memfd
    block_size: int
    num_kv_heads: int
    head_dim: int
    max_blocks_per_seq: int  # size of each sequence's virtual range, in blocks
    max_seqs: int  # number of sequence slots reserved
    dtype: torch.dtype = torch.float32

    @property
    def block_bytes(self) -> int:
        """One layer's K (or V) block: the unit that is mapped."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def range_bytes(self) -> int:
        return self.max_blocks_per_seq * self.block_bytes

    @property
    def slot_bytes(self) -> int:
        return self.num_layers * 2 * self.range_bytes


@dataclass(slots=True)
class VmmSequence:
    slot: int
    blocks: list[int] = field(default_factory=list)  # physical ids, in token order

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class VmmPool:
    """Physical blocks of one memfd, mapped into contiguous per-sequence virtual ranges."""

    def __init__(self, shape: VmmShape, populate: bool = False) -> None:
        if shape.block_bytes % PAGE_SIZE:
            raise ValueError(f"a block of one layer is {shape.block_bytes} bytes, not a multiple of the "
                             f"{PAGE_SIZE}-byte page: choose a block size that makes it whole pages")
        self.shape = shape
        self.populate = populate  # MAP_POPULATE: pay the page-table fill in mmap instead of at first read
        self.mapper = Mapper()
        self.allocator = BlockAllocator(shape.num_blocks)
        self._free_slots = list(range(shape.max_seqs - 1, -1, -1))
        self._live: dict[int, VmmSequence] = {}
        self._pool_bytes = shape.num_layers * 2 * shape.num_blocks * shape.block_bytes
        self._fd = memfd(self._pool_bytes)
        self._flat = self.mapper.map_whole(self._pool_bytes, self._fd)
        self._base = self.mapper.reserve(shape.max_seqs * shape.slot_bytes)
        self.flat = _tensor_at(self._flat, self._pool_bytes, shape.dtype).view(
            shape.num_layers, 2, shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)

    # -- allocation -------------------------------------------------------------------------------------

    def open(self, num_blocks: int) -> VmmSequence:
        """A new sequence in a free slot with `num_blocks` fresh blocks mapped."""
        if not self._free_slots:
            raise RuntimeError(f"all {self.shape.max_seqs} sequence slots are in use")
        sequence = VmmSequence(self._free_slots.pop())
        self._live[sequence.slot] = sequence
        self.grow(sequence, num_blocks)
        return sequence

    def grow(self, sequence: VmmSequence, num_blocks: int) -> None:
        """Allocate `num_blocks` physical blocks and map them after the sequence's last one."""
        if sequence.num_blocks + num_blocks > self.shape.max_blocks_per_seq:
            raise RuntimeError(f"sequence would have {sequence.num_blocks + num_blocks} blocks; its range "
                               f"holds {self.shape.max_blocks_per_seq}")
        blocks = self.allocator.allocate(num_blocks)
        self._map(sequence, sequence.num_blocks, blocks)
        sequence.blocks.extend(blocks)

    def fork(self, parent: VmmSequence, num_shared: int) -> VmmSequence:
        """A new sequence whose first `num_shared` blocks are the parent's (same physical pages)."""
        if not 0 <= num_shared <= parent.num_blocks:
            raise ValueError(f"cannot share {num_shared} of a parent's {parent.num_blocks} blocks")
        if not self._free_slots:
            raise RuntimeError(f"all {self.shape.max_seqs} sequence slots are in use")
        child = VmmSequence(self._free_slots.pop())
        shared = parent.blocks[:num_shared]
        for block_id in shared:
            self.allocator.incref(block_id)
        self._map(child, 0, shared)
        child.blocks.extend(shared)
        self._live[child.slot] = child
        return child

    def free(self, sequence: VmmSequence) -> None:
        """Unmap the sequence's whole slot (one syscall) and release its references."""
        if self._live.get(sequence.slot) is not sequence:
            raise RuntimeError(f"sequence in slot {sequence.slot} is not live (double free?)")
        if sequence.blocks:
            self.mapper.unreserve_range(self._slot_address(sequence.slot), self.shape.slot_bytes)
        for block_id in sequence.blocks:
            if self.allocator.decref(block_id) == 0:
                self.allocator.free(block_id)
        sequence.blocks = []
        del self._live[sequence.slot]
        self._free_slots.append(sequence.slot)

    def _map(self, sequence: VmmSequence, first_position: int, blocks: list[int]) -> None:
        shape, bb = self.shape, self.shape.block_bytes
        for start, first_block, length in coalesce(blocks):
            for layer in range(shape.num_layers):
                for kv in (0, 1):
                    address = self._range_address(sequence.slot, layer, kv) + (first_position + start) * bb
                    offset = ((layer * 2 + kv) * shape.num_blocks + first_block) * bb
                    self.mapper.map_file(address, length * bb, self._fd, offset, self.populate)

    # -- views ------------------------------------------------------------------------------------------

    def keys(self, sequence: VmmSequence, layer: int, num_tokens: int | None = None) -> torch.Tensor:
        """The sequence's keys of one layer as one contiguous ``[tokens, kv_heads, head_dim]`` tensor."""
        return self._view(sequence, layer, 0, num_tokens)

    def values(self, sequence: VmmSequence, layer: int, num_tokens: int | None = None) -> torch.Tensor:
        return self._view(sequence, layer, 1, num_tokens)

    def region_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole reservation as ``[n, block_size, kv_heads, head_dim]`` K and V "pools" whose block i
        is virtual block i: with `contiguous_tables` the block-table kernel reads each sequence's range as
        one contiguous array. Unmapped parts are PROT_NONE: read only what the tables name."""
        shape = self.shape
        total = shape.max_seqs * shape.slot_bytes
        dims = (shape.block_size, shape.num_kv_heads, shape.head_dim)
        keys = _tensor_at(self._base, total, shape.dtype).view(-1, *dims)
        values = _tensor_at(self._base + shape.range_bytes, total - shape.range_bytes, shape.dtype).view(-1, *dims)
        return keys, values

    def contiguous_tables(self, sequences: list[VmmSequence], layer: int) -> torch.Tensor:
        """``[B, max_blocks]`` int64: virtual block ids (into `region_views`) -- consecutive per row."""
        shape = self.shape
        width = max(1, max(sequence.num_blocks for sequence in sequences))
        firsts = torch.tensor([self._range_address(s.slot, layer, 0) - self._base for s in sequences])
        return (firsts // shape.block_bytes).unsqueeze(1) + torch.arange(width).unsqueeze(0)

    def _view(self, sequence: VmmSequence, layer: int, kv: int, num_tokens: int | None) -> torch.Tensor:
        capacity = sequence.num_blocks * self.shape.block_size
        tokens = capacity if num_tokens is None else num_tokens
        if not 0 <= tokens <= capacity:
            raise ValueError(f"{tokens} tokens requested; the sequence has {capacity} mapped")
        shape = self.shape
        nbytes = tokens * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
        tensor = _tensor_at(self._range_address(sequence.slot, layer, kv), nbytes, shape.dtype)
        return tensor.view(tokens, shape.num_kv_heads, shape.head_dim)

    def _slot_address(self, slot: int) -> int:
        return self._base + slot * self.shape.slot_bytes

    def _range_address(self, slot: int, layer: int, kv: int) -> int:
        return self._slot_address(slot) + (layer * 2 + kv) * self.shape.range_bytes

    # -- invariants and teardown -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Ref count = number of live sequences mapping the block; no block both free and mapped."""
        counts = [0] * self.shape.num_blocks
        for sequence in self._live.values():
            for block_id in sequence.blocks:
                counts[block_id] += 1
        for block_id, count in enumerate(counts):
            if self.allocator.ref_counts[block_id] != count:
                raise AssertionError(f"block {block_id}: ref {self.allocator.ref_counts[block_id]}, mapped {count}")
            if self.allocator.is_free(block_id) == (count > 0):
                raise AssertionError(f"block {block_id} is {'free and mapped' if count else 'neither free nor mapped'}")
        if self.allocator.num_free + self.allocator.num_referenced() != self.shape.num_blocks:
            raise AssertionError("free + referenced != total")
        if len(self._free_slots) + len(self._live) != self.shape.max_seqs:
            raise AssertionError("free + live slots != total")

    def close(self) -> None:
        """Unmap everything; every tensor from this pool is dangling afterwards."""
        if self._fd < 0:
            return
        self.mapper.unmap(self._base, self.shape.max_seqs * self.shape.slot_bytes)
        self.mapper.unmap(self._flat, self._pool_bytes)
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> VmmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def contiguous_decode_attention(
    pool: VmmPool, sequences: list[VmmSequence], layer: int, queries: torch.Tensor, context_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Decode attention with torch's SDPA straight over each sequence's contiguous K/V views (no gather,
    no table): row b of ``queries [B, heads, D]`` attends to the first ``context_lens[b]`` tokens."""
    out = torch.empty_like(queries)
    for row, (sequence, length) in enumerate(zip(sequences, context_lens, strict=True)):
        keys = pool.keys(sequence, layer, length).transpose(0, 1)  # [kv_heads, L, D], strided view
        values = pool.values(sequence, layer, length).transpose(0, 1)
        query = queries[row].unsqueeze(1)  # [heads, 1, D]
        out[row] = F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True).squeeze(1)
    return out


def _tensor_at(address: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over raw memory (no copy); the caller keeps the mapping alive."""
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    buffer = (ctypes.c_char * nbytes).from_address(address)
    return torch.frombuffer(buffer, dtype=dtype, count=nbytes // dtype.itemsize)
