"""VMM (virtual-contiguous KV, kv/vmm.py) against block tables: decode-attention cost and allocation cost.

    python benchmarks/vmm.py            # full grid (batch 1/8/32 x context 512/2048/8192), ~3-5 min
    python benchmarks/vmm.py --quick    # batch 1/8 x context 512/2048

Attention: one decode step of the default model's shapes (30 layers, 9 query heads, 3 KV heads, head dim
64, block size 16, float32) for every layer. To keep memory small on a shared machine the pool holds
PHYS_LAYERS physical layers and the 30 calls cycle over them; each layer's K/V at batch 32 x 8192 is
400 MiB, far past every cache, so the cycling does not flatter any method. Runners:
  block-table native   the native paged kernel reading the pool through block tables (the default)
  VMM native           the same kernel over the VMM ranges, tables consecutive per row (contiguous reads)
  VMM torch SDPA       torch's SDPA over each sequence's contiguous K/V views, no gather
  torch reference      the pure-torch paged kernel (gathers the context, then attends)

Allocation: full 30-layer shapes; per operation the median of many, with the mmap/munmap calls each made.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvserve.kernels import reference
from kvserve.kernels.ops import Kernels
from kvserve.kv.block_allocator import BlockAllocator
from kvserve.kv.vmm import VmmPool, VmmShape, contiguous_decode_attention
from kvserve.kv.vmm_os import PAGE_SIZE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
PHYS_LAYERS = 2
SCALE = HEAD_DIM ** -0.5
REFERENCE_MAX_TOKENS = 8 * 2048  # the torch reference materialises 3x the gathered context: cap it
SDPA_MAX_TOKENS = 8 * 8192


def median_ms(function: Callable[[], object], repeats: int) -> float:
    function()  # warm: page-table fill, allocator, OpenMP threads
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def attention_row(native, batch: int, context: int, repeats: int) -> list[object]:
    blocks = context // BLOCK
    shape = VmmShape(PHYS_LAYERS, batch * blocks, BLOCK, KV_HEADS, HEAD_DIM, blocks, batch)
    with VmmPool(shape) as pool:
        for layer in range(PHYS_LAYERS):  # fill layer by layer (a whole-pool randn would double the memory)
            pool.flat[layer].normal_()
        seqs = [pool.open(blocks) for _ in range(batch)]
        queries = torch.randn(batch, HEADS, HEAD_DIM)
        lens = [context] * batch
        context_lens = torch.tensor(lens)
        tables = torch.tensor([seq.blocks for seq in seqs])
        region_k, region_v = pool.region_views()
        virtual = [pool.contiguous_tables(seqs, layer) for layer in range(PHYS_LAYERS)]
        first_touch = _timed_once(lambda: [native.paged_attention(queries, region_k, region_v, virtual[p],
                                                                  context_lens, SCALE) for p in range(PHYS_LAYERS)])

        def step(attend: Callable[[int], object]) -> Callable[[], None]:
            return lambda: [attend(layer % PHYS_LAYERS) for layer in range(LAYERS)]

        paged = median_ms(step(lambda p: native.paged_attention(
            queries, pool.flat[p, 0], pool.flat[p, 1], tables, context_lens, SCALE)), repeats)
        vmm = median_ms(step(lambda p: native.paged_attention(
            queries, region_k, region_v, virtual[p], context_lens, SCALE)), repeats)
        sdpa = ref = float("nan")
        if batch * context <= SDPA_MAX_TOKENS:
            sdpa = median_ms(step(lambda p: contiguous_decode_attention(pool, seqs, p, queries, lens, SCALE)), repeats)
        if batch * context <= REFERENCE_MAX_TOKENS:
            ref = median_ms(step(lambda p: reference.paged_attention(
                queries, pool.flat[p, 0], pool.flat[p, 1], tables, context_lens, SCALE)), max(1, repeats // 2))
    return [batch, context, paged, vmm, vmm / paged, sdpa, ref, (first_touch * 1e3 / PHYS_LAYERS) / (vmm / LAYERS)]


def _timed_once(function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def allocation_rows(repeats: int) -> list[list[object]]:
    """Block tables (allocator + list) vs VMM (allocator + mmaps), per operation, 30 layers."""
    rows: list[list[object]] = []
    shape = VmmShape(LAYERS, 1100, BLOCK, KV_HEADS, HEAD_DIM, 520, 4)
    with VmmPool(shape) as pool:
        rows.append(_grow_row(pool, repeats, populate=False))
        rows.append(_grow_row(pool, repeats, populate=True))
        rows.append(_touch_row(pool, 50))
        for shared in (16, 128, 512):
            rows.extend(_fork_rows(pool, shared, max(3, repeats // 20)))
    return rows


def _measure(
    pool: VmmPool, operation: Callable[[], object], undo: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """(median µs, syscalls per op) of `operation`; `undo` (untimed) restores the state after each."""
    times, calls = [], []
    for _ in range(repeats):
        before = pool.mapper.counts.total
        start = time.perf_counter()
        operation()
        times.append(time.perf_counter() - start)
        calls.append(pool.mapper.counts.total - before)
        undo()
    return statistics.median(times) * 1e6, int(statistics.median(calls))


def _table_grow_us(repeats: int) -> float:
    allocator, table = BlockAllocator(1100), []
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        table.extend(allocator.allocate(1))
        times.append(time.perf_counter() - start)
        allocator.decref(table[-1])
        allocator.free(table.pop())
    return statistics.median(times) * 1e6


def _grow_row(pool: VmmPool, repeats: int, populate: bool) -> list[object]:
    pool.populate = populate
    seq = pool.open(1)

    def shrink() -> None:  # untimed: drop the block just mapped by reopening the sequence
        nonlocal seq
        pool.free(seq)
        seq = pool.open(1)

    vmm_us, calls = _measure(pool, lambda: pool.grow(seq, 1), shrink, repeats)
    pool.free(seq)
    pool.populate = False
    label = "map one more block" + (" (MAP_POPULATE)" if populate else "")
    return [label, _table_grow_us(repeats), 0, vmm_us, calls]


def _touch_row(pool: VmmPool, repeats: int) -> list[object]:
    """Writing one token's K and V in every layer of a block that is committed (written once through the
    flat pool) but freshly mapped into a sequence: VMM pays a page-table fill per page per mapping; the
    block table writes through the flat pool, mapped once for good. Both sides time the same bytes."""
    seq = pool.open(1)
    flat_times, vmm_times = [], []
    for _ in range(repeats):
        pool.grow(seq, 1)
        block = seq.blocks[-1]
        pool.flat[:, :, block].fill_(0.5)  # commit the block's pages (untimed)
        flat_keys = [pool.flat[layer, 0, block] for layer in range(LAYERS)]
        flat_values = [pool.flat[layer, 1, block] for layer in range(LAYERS)]
        flat_times.append(_timed_once(lambda: _write_token(flat_keys, flat_values)))  # noqa: B023
        keys = [pool.keys(seq, layer)[-BLOCK:] for layer in range(LAYERS)]
        values = [pool.values(seq, layer)[-BLOCK:] for layer in range(LAYERS)]
        vmm_times.append(_timed_once(lambda: _write_token(keys, values)))  # noqa: B023
        pool.free(seq)
        seq = pool.open(1)
    pool.free(seq)
    pages = 2 * LAYERS * pool.shape.block_bytes // PAGE_SIZE
    return [f"write a token into a newly mapped block, 30 layers ({pages} minor faults)",
            statistics.median(flat_times) * 1e6, 0, statistics.median(vmm_times) * 1e6, 0]


def _write_token(keys, values) -> None:
    for layer_keys, layer_values in zip(keys, values, strict=True):
        for page in range(0, BLOCK, BLOCK // 4):  # one token per 4 KiB page of the 12 KiB block
            layer_keys[page].fill_(1.0)
            layer_values[page].fill_(1.0)


def _fork_rows(pool: VmmPool, shared: int, repeats: int) -> list[list[object]]:
    rows = []
    for fragmented in (False, True):
        layout = "scattered" if fragmented else "consecutive"
        parent = _open_fragmented(pool, shared) if fragmented else pool.open(shared)
        try:
            vmm_us, calls = _fork_cost(pool, parent, shared, repeats)
            free_us, free_calls = _free_cost(pool, parent, shared, repeats)
        except OSError as err:  # the mapping limit (see vma_limit_row)
            print(f"fork {shared} {layout}: {err}", flush=True)
            vmm_us = calls = free_us = free_calls = float("nan")
        table_fork, table_free = _table_fork_free_us(shared, repeats)
        rows.append([f"fork sharing {shared} blocks ({layout})", table_fork, 0, vmm_us, calls])
        rows.append([f"free a {shared}-block sequence ({layout})", table_free, 0, free_us, free_calls])
        pool.free(parent)
    return rows


def _open_fragmented(pool: VmmPool, blocks: int):
    """A sequence grown in step with another, as in continuous batching: its physical blocks alternate
    with the other's, so no two are consecutive and each block is its own mmap per layer and K/V."""
    parent, other = pool.open(0), pool.open(0)
    for _ in range(blocks):
        pool.grow(parent, 1)
        pool.grow(other, 1)
    pool.free(other)
    return parent


def _fork_cost(pool: VmmPool, parent, shared: int, repeats: int) -> tuple[float, float]:
    children: list = []
    try:
        return _measure(pool, lambda: children.append(pool.fork(parent, shared)), lambda: pool.free(children.pop()),
                        repeats)
    finally:
        for child in children:
            pool.free(child)


def _free_cost(pool: VmmPool, parent, shared: int, repeats: int) -> tuple[float, float]:
    children: list = []

    def setup() -> None:
        children.append(pool.fork(parent, shared))

    setup()
    try:
        return _measure(pool, lambda: pool.free(children.pop()), setup, repeats)
    finally:
        for child in children:
            pool.free(child)


def _table_fork_free_us(shared: int, repeats: int) -> tuple[float, float]:
    allocator = BlockAllocator(1100)
    parent = allocator.allocate(shared)
    forks, frees = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        child = list(parent)
        for block_id in child:
            allocator.incref(block_id)
        middle = time.perf_counter()
        for block_id in child:
            if allocator.decref(block_id) == 0:
                allocator.free(block_id)
        end = time.perf_counter()
        forks.append(middle - start)
        frees.append(end - middle)
    return statistics.median(forks) * 1e6, statistics.median(frees) * 1e6


def vma_limit_row() -> str:
    """How many scattered blocks one process can map before the kernel's mapping limit says no."""
    limit = int(open("/proc/sys/vm/max_map_count").read())
    shape = VmmShape(1, 2 * 40_000, BLOCK, 1, HEAD_DIM, 40_000, 2)  # 4 KiB blocks, never touched
    with VmmPool(shape) as pool:
        seq, other = pool.open(0), pool.open(0)
        try:
            for step in range(40_000):
                pool.grow(seq, 1)
                pool.grow(other, 1)
                if step % 1000 == 999:  # keep the other's mappings few; its blocks go to the free list's tail
                    pool.free(other)
                    other = pool.open(0)
            outcome = f"all {seq.num_blocks} mapped"
            pool.free(other)
            pool.free(seq)
        except OSError as err:  # at the limit even a free fails (unmapping part of a range splits it): close
            outcome = f"{os.strerror(err.errno)} after {seq.num_blocks} blocks ({2 * seq.num_blocks} mappings)"
    return (f"Mapping limit: vm.max_map_count = {limit}; a 1-layer sequence growing block by block beside "
            f"another (scattered blocks, one mapping each for K and V): {outcome}. The default model needs "
            f"{2 * LAYERS} mappings per scattered block, so one process holds at most ~{limit // (2 * LAYERS):,} "
            f"scattered blocks ({limit // (2 * LAYERS) * BLOCK:,} tokens) across all its sequences.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    native = Kernels.create("native").native
    if native is None:
        raise SystemExit("the native kernels are needed for this comparison (python -m kvserve.kernels.build)")
    batches, contexts = ((1, 8), (512, 2048)) if args.quick else ((1, 8, 32), (512, 2048, 8192))
    rows = []
    for batch in batches:
        for context in contexts:
            rows.append(attention_row(native, batch, context, args.repeats))
            print(rows[-1], flush=True)
    alloc = allocation_rows(200)
    for row in alloc:
        print(row, flush=True)
    limit = vma_limit_row()
    print(limit)
    attention = markdown_table(
        ["batch", "context", "block-table native ms", "VMM native ms", "VMM / block-table", "VMM torch SDPA ms",
         "torch reference ms", "VMM first pass / steady"], rows)
    allocation = markdown_table(["operation (30 layers)", "block table µs", "syscalls", "VMM µs", "syscalls"], alloc)
    write_result("vmm", "VMM (virtual-contiguous KV) vs block tables",
                 f"Decode attention, one step over all {LAYERS} layers (median of {args.repeats}):\n\n{attention}\n\n"
                 f"Allocation:\n\n{allocation}\n\n{limit}",
                 NOTES)


NOTES = """Shared, noisy 2-core machine (8 jobs at once; the committed run had a load average above 20, so it ran
with OMP_NUM_THREADS=1 and absolute times are inflated several-fold): medians, compare within a row.
`nan`: not run at that size (the torch reference gathers and expands the whole context;
SDPA loops over sequences in Python).
VMM first pass / steady: the first native pass over freshly mapped ranges (page-table fill on first
touch; the pages were already committed through the flat pool), per layer, over a steady-state layer.
Analysis: docs/vmm.md."""


if __name__ == "__main__":
    main()
