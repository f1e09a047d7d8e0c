"""The wide quantized GEMM (csrc/qgemm.h) against its torch twin, dequantize + matmul, on random shapes.

Row counts cover a single row, partial tiles (1..W and W+1..2W rows left over), several M blocks (over
64 rows), several superblocks of row blocks (prefill sizes) and more; widths cover one block and several
128-input panel blocks with a remainder; output counts cover partial panels (any N, odd included). Each
runs for every ISA the CPU has, the forced AVX2 path included (`conftest.ISA_PARAMS`).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kernels import ops, reference
from kvserve.kernels.quant import QTYPES
from test_kernels import random_quant

SETTINGS = settings(max_examples=30, deadline=None)


@SETTINGS
@given(
    rows=st.one_of(st.integers(1, 40), st.integers(41, 300)), out_features=st.integers(1, 75),
    blocks=st.integers(1, 13), qtype=st.sampled_from(sorted(QTYPES)), seed=st.integers(0, 2**16),
)
def test_qgemm_matches_dequantize_then_matmul(kernels, rows, out_features, blocks, qtype, seed):
    weight = random_quant(out_features, blocks * 32, qtype, seed)
    x = torch.randn(rows, blocks * 32, generator=torch.Generator().manual_seed(seed))
    expected = reference.qlinear(x, weight)
    got = kernels.native.qgemm(x, weight.data, weight.qtype, weight.in_features)
    assert got.shape == (rows, out_features)
    # Exact to the dequantized weights up to summation order: a few fp32 ulps of outputs reaching ~100.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 5, 8, 9, 12, 16, 17, 20, 24, 25, 31, 40, 56, 129, 140])
@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_qgemm_every_tile_shape_and_row_block(kernels, rows, qtype):
    """Row counts that end on each tile shape (a 2-vector tile of 1, 2 or 4 inputs per lane group: 32/16/8 rows
    on AVX-512, 16/8/4 on AVX2), partial last tiles, and a second row block (over 128 rows)."""
    weight = random_quant(29, 96, qtype, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    got = kernels.native.qgemm(x, weight.data, weight.qtype, weight.in_features)
    torch.testing.assert_close(got, reference.qlinear(x, weight), rtol=1e-5, atol=1e-4)


@SETTINGS
@given(
    rows=st.integers(60, 700), blocks=st.sampled_from([18, 40, 64, 130]), out_features=st.integers(1, 30),
    qtype=st.sampled_from(sorted(QTYPES)), seed=st.integers(0, 2**16),
)
def test_qgemm_across_superblocks(kernels, rows, blocks, out_features, qtype, seed):
    """Prefill-sized calls: each panel is dequantized once per superblock of row blocks (about 1 MiB of packed
    x: 455 rows at 576 inputs, 128 at 2,048, one 64-row block at 4,160), kept and reused by its other blocks;
    rows cross superblock boundaries with partial last tiles and blocks."""
    weight = random_quant(out_features, blocks * 32, qtype, seed)
    x = torch.randn(rows, blocks * 32, generator=torch.Generator().manual_seed(seed))
    got = kernels.native.qgemm(x, weight.data, weight.qtype, weight.in_features)
    # Up to summation order over up to 4,160 inputs: bounded by a few dozen ulps of the sum of |products|.
    bound = 4e-6 * (x.abs() @ reference.dequantize(weight).abs().t()) + 1e-6
    assert ((got - reference.qlinear(x, weight)).abs() <= bound).all()


@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_wide_avx2_kernel_gives_a_row_the_same_bits_wherever_it_sits(kernels, qtype):
    """On AVX2 from 48 rows (qgemm_wide.h) each output sums its products in input order from zero, across
    KC slices and row blocks alike: a row's result does not depend on the call's row count or the row's place
    (micro-tile, row block) among calls of 48 rows or more (below, qgemm.h's tiles depend on the row count)."""
    if kernels.native.isa != "avx2":
        pytest.skip("qgemm_wide.h is the AVX2 build's kernel; AVX-512 keeps qgemm.h's")
    weight = random_quant(45, 20 * 32, qtype, seed=qtype)  # 640 inputs: 3 KC slices; 45 outputs: a partial panel
    x = torch.randn(400, 640, generator=torch.Generator().manual_seed(qtype))  # 3 row blocks
    full = kernels.native.qgemm(x, weight.data, weight.qtype, weight.in_features)
    for start, rows in ((0, kernels.native.wide_gemm_rows()), (7, 53), (300, 100), (151, 145)):
        part = kernels.native.qgemm(x[start:start + rows].contiguous(), weight.data, weight.qtype,
                                    weight.in_features)
        assert torch.equal(part, full[start:start + rows]), (start, rows)
    torch.testing.assert_close(full, reference.qlinear(x, weight), rtol=1e-5, atol=1e-4)


@SETTINGS
@given(rows=st.integers(1, 320), out_features=st.integers(1, 70), blocks=st.integers(1, 20),
       qtype=st.sampled_from(sorted(QTYPES)), seed=st.integers(0, 2**16))
def test_both_avx2_wide_kernels_agree_with_the_reference(kernels, rows, out_features, blocks, qtype, seed):
    """qgemm_wide.h at every row count (its crossover forced to 1) and qgemm.h's tiles at every row count (the
    crossover out of reach): both exact to the dequantized weights up to summation order, on partial micro-tiles,
    partial panels, several KC slices and row blocks."""
    if kernels.native.isa != "avx2":
        pytest.skip("qgemm_wide.h is the AVX2 build's kernel")
    weight = random_quant(out_features, blocks * 32, qtype, seed)
    x = torch.randn(rows, blocks * 32, generator=torch.Generator().manual_seed(seed))
    expected = reference.qlinear(x, weight)
    bound = 4e-6 * (x.abs() @ reference.dequantize(weight).abs().t()) + 1e-6
    default = kernels.native.wide_gemm_rows()
    try:
        for crossover in (1, 1 << 40):
            kernels.native.wide_gemm_rows(crossover)
            got = kernels.native.qgemm(x, weight.data, weight.qtype, weight.in_features)
            assert ((got - expected).abs() <= bound).all(), crossover
    finally:
        kernels.native.wide_gemm_rows(default)


def test_wide_gemm_crossover_is_checked(kernels):
    with pytest.raises(ValueError, match="at least 1"):
        kernels.native.wide_gemm_rows(0)


@pytest.mark.parametrize("rows", [ops.QGEMM_MIN_ROWS - 1, ops.QGEMM_MIN_ROWS, ops.QGEMM_MAX_ROWS,
                                  ops.QGEMM_MAX_ROWS + 1])
def test_linear_dispatch_is_exact_on_both_sides_of_each_crossover(kernels, rows):
    weight = random_quant(37, 160, 3, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(kernels.linear(x, weight), reference.qlinear(x, weight), rtol=1e-5, atol=1e-4)


def test_qgemm_agrees_with_the_per_row_kernel_on_the_model_shapes(kernels):
    """The fused q/k/v shape of the default model, 32 decode rows: both native kernels, same answer."""
    weight = random_quant(960, 576, 3, seed=7)
    x = torch.randn(32, 576, generator=torch.Generator().manual_seed(7))
    per_row = kernels.native.qmatmul(x, weight.data, weight.qtype, weight.in_features)
    wide = kernels.native.qgemm(x, weight.data, weight.qtype, weight.in_features)
    torch.testing.assert_close(wide, per_row, rtol=1e-5, atol=1e-4)


def test_qgemm_rejects_mismatched_shapes(kernels):
    weight = random_quant(8, 64, 8, seed=1)
    with pytest.raises(ValueError, match="features"):
        kernels.native.qgemm(torch.randn(3, 96), weight.data, weight.qtype, weight.in_features)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.native.qgemm(torch.randn(64, 3).t(), weight.data, weight.qtype, weight.in_features)
    with pytest.raises(ValueError, match="unsupported quantization type"):
        kernels.native.qgemm(torch.randn(3, 64), weight.data, 14, weight.in_features)
