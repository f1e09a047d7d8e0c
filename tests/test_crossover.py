"""The per-type crossover from the per-row kernel to the wide GEMM (kernels/crossover.py): chosen by CPU,
settable for A/B runs, and exact on both sides (the layer loop's output is the same up to summation order,
its greedy tokens equal transformers either way)."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import crossover, ops, reference
from kvserve.kernels.crossover import Q4_1, Q8_0
from kvserve.kernels.ops import Kernels
from test_kernels import random_quant
from test_layer_loop import quantized_tiny_llama, run_steps


def test_the_measured_table_applies_to_zen4_only():
    assert crossover.crossovers("avx512", ("AuthenticAMD", 25)) == {Q4_1: 16, Q8_0: 6}
    assert crossover.crossovers("avx2", ("AuthenticAMD", 25)) == {}  # a forced AVX2 build: not measured
    assert crossover.crossovers("avx512", ("GenuineIntel", 6)) == {}
    assert crossover.crossovers("avx512", ("AuthenticAMD", 26)) == {}  # Zen 5: full-width units, not measured
    vendor, family = crossover.cpu_identity()
    assert isinstance(vendor, str) and isinstance(family, int)


@pytest.mark.parametrize("rows", [5, 8, 12])
def test_linear_is_exact_with_either_kernel_below_the_crossover(kernels, rows):
    if kernels.native is None:
        pytest.skip("the native kernels did not load")
    weight = random_quant(40, 160, Q4_1, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    before = crossover.set_min_rows(kernels.native, Q4_1, rows + 1)  # the per-row kernel
    try:
        per_row = kernels.linear(x, weight)
        crossover.set_min_rows(kernels.native, Q4_1, 1)  # the wide GEMM
        wide = kernels.linear(x, weight)
    finally:
        crossover.set_min_rows(kernels.native, Q4_1, before)
    expected = reference.qlinear(x, weight)
    torch.testing.assert_close(per_row, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(wide, expected, rtol=1e-5, atol=1e-4)


def test_a_crossover_below_one_row_is_refused(kernels):
    if kernels.native is None:
        pytest.skip("the native kernels did not load")
    with pytest.raises(ValueError, match="at least 1"):
        crossover.set_min_rows(kernels.native, Q4_1, 0)
    assert kernels.native.qgemm_min_rows.get(Q4_1, ops.QGEMM_MIN_ROWS) >= 1


def test_layer_loop_is_exact_with_either_kernel(kernels, tiny_model_dir):
    """Steps of 5-12 rows through the layer loop (Q4_1 and Q8_0 layers), per-row kernel then wide GEMM:
    the logits of both agree with the torch kernels' within float32 summation order, argmax equal."""
    model = quantized_tiny_llama(tiny_model_dir, kernels)
    if model.layer_loop is None:
        pytest.skip("no native layer loop here")
    prompts = [list(range(3 + i, 9 + 2 * i)) for i in range(12)]  # mixed steps, then 12-row decodes
    oracle = run_steps(quantized_tiny_llama(tiny_model_dir, Kernels.create("torch")), prompts, 16, steps=3)
    native = kernels.native
    before = {qtype: native.qgemm_min_rows.get(qtype, ops.QGEMM_MIN_ROWS) for qtype in (Q4_1, Q8_0)}
    try:
        for rows in (64, 1):  # every step on the per-row kernel, then every step on the wide GEMM
            for qtype in (Q4_1, Q8_0):
                crossover.set_min_rows(native, qtype, rows)
            for ours, theirs in zip(run_steps(model, prompts, 16, steps=3), oracle, strict=True):
                assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max(), rows
                assert torch.equal(ours.argmax(-1), theirs.argmax(-1)), rows
    finally:
        for qtype, rows in before.items():
            crossover.set_min_rows(native, qtype, rows)
