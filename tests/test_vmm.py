"""The VMM prototype (kv/vmm.py): mappings alias the right physical blocks, shared prefixes are the same
pages, every block comes back, and attention over the contiguous views equals the block-table kernels."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.kernels import reference
from kvserve.kernels.ops import Kernels
from kvserve.kv.vmm import VmmPool, VmmShape, contiguous_decode_attention

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs Linux memfd")


def small_shape(**overrides) -> VmmShape:
    fields = dict(num_layers=2, num_blocks=12, block_size=16, num_kv_heads=1, head_dim=64, max_blocks_per_seq=6,
                  max_seqs=4)
    return VmmShape(**{**fields, **overrides})


def test_flat_writes_show_through_the_sequence_view_and_growth_maps_at_the_end():
    with VmmPool(small_shape()) as pool:
        seq = pool.open(2)
        pool.grow(seq, 1)
        for position, block_id in enumerate(seq.blocks):
            pool.flat[1, 0, block_id].fill_(float(position + 1))
            pool.flat[1, 1, block_id].fill_(float(-position - 1))
        keys, values = pool.keys(seq, 1), pool.values(seq, 1)
        assert keys.shape == (48, 1, 64) and keys.is_contiguous()
        assert keys[:, 0, 0].tolist() == [1.0] * 16 + [2.0] * 16 + [3.0] * 16
        assert values[:, 0, 0].tolist() == [-1.0] * 16 + [-2.0] * 16 + [-3.0] * 16
        assert pool.keys(seq, 0).abs().sum() == 0  # layer 0 untouched: memfd pages start zeroed


def test_shared_prefix_is_the_same_memory_in_both_ranges():
    with VmmPool(small_shape()) as pool:
        parent = pool.open(3)
        child = pool.fork(parent, 2)
        pool.grow(child, 1)
        assert child.blocks[:2] == parent.blocks[:2] and child.blocks[2] != parent.blocks[2]
        pool.keys(child, 0)[20].fill_(5.0)  # written through the child's mapping of shared block 1
        assert pool.keys(parent, 0)[20, 0, 0] == 5.0  # read through the parent's mapping
        assert pool.flat[0, 0, parent.blocks[1], 4, 0, 0] == 5.0
        pool.keys(child, 0)[40].fill_(9.0)  # the child's own block: the parent's third block unchanged
        assert pool.keys(parent, 0)[40, 0, 0] == 0.0
        assert pool.allocator.ref_counts[parent.blocks[0]] == 2
        pool.free(parent)
        assert pool.keys(child, 0)[20, 0, 0] == 5.0  # still mapped in the child after the parent is gone
        assert pool.allocator.ref_counts[child.blocks[0]] == 1
        pool.free(child)
        pool.check_invariants()
        assert pool.allocator.num_free == 12


def test_consecutive_blocks_are_mapped_in_one_call_per_layer_and_free_is_one_call():
    with VmmPool(small_shape()) as pool:
        before = pool.mapper.counts.mmap
        seq = pool.open(4)  # blocks 0..3: one run, so 2 layers x (K, V) = 4 mmaps
        assert pool.mapper.counts.mmap - before == 4
        pool.free(seq)
        assert pool.mapper.counts.mmap - before == 5


def test_loud_errors():
    with pytest.raises(ValueError, match="multiple of the"):
        VmmPool(small_shape(block_size=3))
    with VmmPool(small_shape(max_seqs=1)) as pool:
        seq = pool.open(1)
        with pytest.raises(RuntimeError, match="slots are in use"):
            pool.open(1)
        with pytest.raises(RuntimeError, match="its range holds 6"):
            pool.grow(seq, 6)
        with pytest.raises(ValueError, match="tokens requested"):
            pool.keys(seq, 0, 17)
        pool.free(seq)
        with pytest.raises(RuntimeError, match="not live"):
            pool.free(seq)


class VmmMachine(RuleBasedStateMachine):
    """Random open/grow/fork/free; every view must show exactly its blocks' physical contents."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = VmmPool(small_shape(num_blocks=10, max_seqs=5, max_blocks_per_seq=5))
        shape = self.pool.shape
        for layer in range(shape.num_layers):
            for kv in (0, 1):
                for block_id in range(shape.num_blocks):
                    self.pool.flat[layer, kv, block_id].fill_(self.tag(layer, kv, block_id))
        self.live: list = []

    @staticmethod
    def tag(layer: int, kv: int, block_id: int) -> float:
        return float(block_id * 4 + layer * 2 + kv)

    @precondition(lambda self: len(self.live) < 5)
    @rule(blocks=st.integers(0, 3))
    def open(self, blocks):
        if self.pool.allocator.can_allocate(blocks):
            self.live.append(self.pool.open(blocks))

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 4), blocks=st.integers(1, 2))
    def grow(self, index, blocks):
        seq = self.live[index % len(self.live)]
        if self.pool.allocator.can_allocate(blocks) and seq.num_blocks + blocks <= 5:
            self.pool.grow(seq, blocks)

    @precondition(lambda self: self.live and len(self.live) < 5)
    @rule(index=st.integers(0, 4), share=st.integers(0, 5))
    def fork(self, index, share):
        parent = self.live[index % len(self.live)]
        self.live.append(self.pool.fork(parent, min(share, parent.num_blocks)))

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 4))
    def free(self, index):
        self.pool.free(self.live.pop(index % len(self.live)))

    @invariant()
    def views_show_their_blocks(self):
        self.pool.check_invariants()
        bs = self.pool.shape.block_size
        for seq in self.live:
            for layer in range(self.pool.shape.num_layers):
                for kv, view in ((0, self.pool.keys(seq, layer)), (1, self.pool.values(seq, layer))):
                    expected = [self.tag(layer, kv, block_id) for block_id in seq.blocks]
                    assert view[::bs, 0, 0].tolist() == expected

    def teardown(self) -> None:
        for seq in self.live:
            self.pool.free(seq)
        self.pool.check_invariants()
        assert self.pool.allocator.num_free == self.pool.shape.num_blocks
        self.pool.close()


TestVmmMachine = VmmMachine.TestCase
TestVmmMachine.settings = settings(max_examples=40, stateful_step_count=20, deadline=None)


@pytest.mark.parametrize("block_size,kv_heads,group", [(16, 3, 3), (64, 1, 4), (16, 2, 1)])
def test_attention_over_vmm_views_equals_the_block_table_kernels(block_size, kv_heads, group):
    head_dim, scale = 64, 0.125
    shape = small_shape(num_layers=2, num_blocks=40, block_size=block_size, num_kv_heads=kv_heads,
                        head_dim=head_dim, max_blocks_per_seq=8, max_seqs=4)
    gen = torch.Generator().manual_seed(block_size + kv_heads)
    native = Kernels.create("native").native
    with VmmPool(shape) as pool:
        pool.flat.copy_(torch.randn(pool.flat.shape, generator=gen))
        root = pool.open(3)
        seqs = [root, pool.fork(root, 2), pool.fork(root, 3), pool.open(1)]
        for seq, extra in zip(seqs[1:3], (2, 1), strict=True):
            pool.grow(seq, extra)
        lens = [3 * block_size - 5, 4 * block_size, 4 * block_size - 1, 7]
        context = torch.tensor(lens)
        queries = torch.randn(4, kv_heads * group, head_dim, generator=gen)
        width = max(seq.num_blocks for seq in seqs)
        tables = torch.tensor([seq.blocks + [0] * (width - seq.num_blocks) for seq in seqs])
        for layer in range(shape.num_layers):
            key_blocks, value_blocks = pool.flat[layer, 0], pool.flat[layer, 1]
            expected = reference.paged_attention(queries, key_blocks, value_blocks, tables, context, scale)
            got = contiguous_decode_attention(pool, seqs, layer, queries, lens, scale)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            if native is None:
                continue
            paged = native.paged_attention(queries, key_blocks, value_blocks, tables, context, scale)
            region_keys, region_values = pool.region_views()
            virtual = native.paged_attention(queries, region_keys, region_values,
                                             pool.contiguous_tables(seqs, layer), context, scale)
            torch.testing.assert_close(paged, expected, rtol=1e-5, atol=1e-5)
            assert torch.equal(virtual, paged)  # same kernel, same bytes, only the addresses differ
