"""Cascade (shared-prefix) decode attention: the native kernel against its torch twin and against plain
paged attention, and the group detection, on random shapes (hypothesis).

Rows are drawn in groups that really share physical leading blocks (as cached prefixes and forked
samples do), with their own blocks after them; groups of one, unshared rows, context lengths of 1 and
not multiples of the block size, and contexts that end exactly at the shared boundary are all drawn.
Every native test runs for each ISA this CPU has (see test_kernels.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kernels import reference
from kvserve.kernels.cascade_plan import CascadeTensors, check_cascade_plan
from kvserve.kernels.ops import Kernels
from kvserve.kv.cascade import plan_cascade

SETTINGS = settings(max_examples=30, deadline=None)

# One group: (shared blocks, [own tokens of each member]); own tokens 0 ends a row at the shared boundary.
GROUPS = st.lists(
    st.tuples(st.integers(0, 5), st.lists(st.integers(0, 40), min_size=1, max_size=4)), min_size=1, max_size=4
)


def build_rows(groups: list[tuple[int, list[int]]], block_size: int, gen: torch.Generator):
    """Block tables (lists) and context lengths of rows that share physical leading blocks per group."""
    next_block = iter(range(1, 10_000))
    tables, lens = [], []
    for shared, owns in groups:
        head = [next(next_block) for _ in range(shared)]
        for own in owns:
            own = max(own, 1) if shared == 0 else own  # every row has at least one token
            own_blocks = -(-own // block_size)
            tables.append(head + [next(next_block) for _ in range(own_blocks)])
            lens.append(shared * block_size + own)
    order = torch.randperm(len(tables), generator=gen).tolist()  # members need not be adjacent rows
    return [tables[i] for i in order], [lens[i] for i in order], max(max(t) for t in tables) + 1


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)


def draw_case(block_size, kv_heads, group, head_dim, groups, seed):
    gen = torch.Generator().manual_seed(seed)
    tables, lens, num_blocks = build_rows(groups, block_size, gen)
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    queries = torch.randn(len(tables), kv_heads * group, head_dim, generator=gen)
    return tables, lens, keys, values, queries


CASE = dict(
    block_size=st.sampled_from([1, 2, 4, 16, 32]), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4, 8]),
    head_dim=st.sampled_from([16, 32, 64]), groups=GROUPS, seed=st.integers(0, 2**16),
)


@SETTINGS
@given(**CASE)
def test_native_cascade_matches_twin_and_paged_attention(kernels, block_size, kv_heads, group, head_dim, groups, seed):
    tables, lens, keys, values, queries = draw_case(block_size, kv_heads, group, head_dim, groups, seed)
    plan = plan_cascade(tables, lens, block_size, min_rows=1, min_blocks=1)
    table_tensor, context = padded(tables), torch.tensor(lens)
    plain = reference.paged_attention(queries, keys, values, table_tensor, context, 0.125)
    if plan is None:  # nothing shares a whole block: the groups are all empty
        assert all(shared == 0 or min(lens) < block_size for shared, _ in groups)
        return
    native = kernels.cascade_attention(queries, keys, values, table_tensor, context, plan, 0.125)
    twin = reference.cascade_attention(queries, keys, values, table_tensor, context, plan, 0.125)
    torch.testing.assert_close(twin, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native, twin, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native, kernels.paged_attention(queries, keys, values, table_tensor, context, 0.125),
                               rtol=1e-5, atol=1e-5)


@SETTINGS
@given(**CASE)
def test_torch_backend_cascade_is_the_twin(block_size, kv_heads, group, head_dim, groups, seed):
    tables, lens, keys, values, queries = draw_case(block_size, kv_heads, group, head_dim, groups, seed)
    plan = plan_cascade(tables, lens, block_size, min_rows=1, min_blocks=1)
    if plan is None:
        return
    out = Kernels.create("torch").cascade_attention(queries, keys, values, padded(tables), torch.tensor(lens),
                                                    plan, 0.125)
    expected = reference.paged_attention(queries, keys, values, padded(tables), torch.tensor(lens), 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(block_size=st.sampled_from([1, 4, 16]), groups=GROUPS, min_rows=st.integers(1, 3),
       min_blocks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_plan_groups_rows_that_share_physical_blocks(block_size, groups, min_rows, min_blocks, seed):
    tables, lens, _ = build_rows(groups, block_size, torch.Generator().manual_seed(seed))
    plan = plan_cascade(tables, lens, block_size, min_rows=min_rows, min_blocks=min_blocks)
    grouped: set[int] = set()
    for index in range(plan.num_groups if plan is not None else 0):
        members, count = plan.members(index), int(plan.group_shared_blocks[index])
        assert len(members) >= min_rows and count >= min_blocks
        assert not grouped & set(members)
        grouped |= set(members)
        assert count == common_blocks(tables, lens, members, block_size)  # the longest shared run
    if plan is not None:
        check_cascade_plan(plan, padded(tables), torch.tensor(lens), block_size, len(tables))
    # A row left out has no set of >= min_rows rows sharing >= min_blocks leading blocks with it.
    for row in set(range(len(tables))) - grouped:
        peers = [other for other in range(len(tables))
                 if lens[other] >= min_blocks * block_size and tables[other][0] == tables[row][0]]
        assert row not in peers or len(peers) < min_rows or common_blocks(tables, lens, peers, block_size) < min_blocks


def common_blocks(tables, lens, rows, block_size) -> int:
    limit = min(lens[row] // block_size for row in rows)
    return next((i for i in range(limit) if any(tables[row][i] != tables[rows[0]][i] for row in rows)), limit)


def test_unshared_rows_make_no_plan():
    tables, lens = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [80, 80]
    assert plan_cascade(tables, lens, 16) is None
    assert plan_cascade([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], lens, 16).members(0) == [0, 1]
    assert plan_cascade([[1, 2, 3, 4, 5], [1, 2, 3, 7, 6]], lens, 16) is None  # 3 blocks < MIN_CASCADE_BLOCKS


def test_bad_plans_are_value_errors(kernels):
    keys = torch.zeros(12, 4, 1, 16)
    tables, queries = torch.tensor([[1, 2, 3], [1, 2, 4]]), torch.zeros(2, 1, 16)

    def plan(offsets, rows, shared, row_shared) -> CascadeTensors:
        return CascadeTensors(*(torch.tensor(v, dtype=torch.long) for v in (offsets, rows, shared, row_shared)))

    cases = [
        ("do not start with the same blocks", plan([0, 2], [0, 1], [3], [3, 3]), [12, 12]),
        ("exceed a member's context", plan([0, 2], [0, 1], [3], [3, 3]), [9, 12]),
        ("outside", plan([0, 2], [0, 5], [1], [1, 0]), [9, 10]),
        ("disjoint runs", plan([0, 2], [0, 0], [1], [1, 0]), [9, 10]),
        ("row_shared_blocks does not match", plan([0, 2], [0, 1], [2], [2, 1]), [9, 10]),
        ("one more entry than groups", plan([0, 2], [0, 1], [], [0, 0]), [9, 10]),
        ("exceeds its block table", plan([0, 2], [0, 1], [2], [2, 2]), [9, 13]),
    ]
    for message, bad, lens in cases:
        with pytest.raises(ValueError, match=message):
            kernels.cascade_attention(queries, keys, keys, tables, torch.tensor(lens), bad, 1.0)
    good = plan([0, 2], [0, 1], [2], [2, 2])
    assert kernels.cascade_attention(queries, keys, keys, tables, torch.tensor([9, 10]), good, 1.0).shape == (2, 1, 16)
