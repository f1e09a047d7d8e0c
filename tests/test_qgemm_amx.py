"""The exact path's wide GEMM on AMX-BF16 tiles (csrc/qgemm_amx.h) against its torch twin (dequantize +
matmul) and against the AVX-512 float32 GEMM it replaces from 16-64 rows: the same contract, exact to the
dequantized weights up to summation order, for every float weight type, partial tiles of rows and columns,
several tasks of rows (over 128) and both sides of each type's row threshold; the engine's greedy tokens
with and without the tiles; the switch. Needs a CPU with AMX-BF16 (Sapphire Rapids or later): skipped
elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import avx512_with, on_then_off
from kvserve.kernels import reference
from kvserve.kernels.native import AMX_ENV
from kvserve.kernels.ops import Kernels
from kvserve.kernels.quant import QTYPES
from test_kernels import random_quant

pytestmark = pytest.mark.skipif(not avx512_with("amx_bf16"), reason="this CPU has no AMX-BF16 (or no AVX-512 build)")
SETTINGS = settings(max_examples=40, deadline=None)


@pytest.fixture(scope="module")
def exact() -> Iterator[Kernels]:
    kernels = Kernels.create("native", isa="avx512")
    assert kernels.native.amx_exact, "AMX-BF16 present but the exact tiles were not enabled"
    yield kernels
    kernels.native.set_amx_exact(True)


def both(kernels: Kernels, call) -> tuple[torch.Tensor, torch.Tensor]:
    """`call()` with the exact tiles on, then off (restored on)."""
    return on_then_off(kernels.native.set_amx_exact, call)


@SETTINGS
@given(rows=st.one_of(st.integers(16, 80), st.integers(81, 400)), out_features=st.integers(1, 75),
       blocks=st.integers(1, 13), qtype=st.sampled_from(sorted(QTYPES)), seed=st.integers(0, 2**16))
def test_tiles_match_dequantize_then_matmul(exact, rows, out_features, blocks, qtype, seed):
    weight = random_quant(out_features, blocks * 32, qtype, seed)
    x = torch.randn(rows, blocks * 32, generator=torch.Generator().manual_seed(seed)) * 3
    tiles, fp32 = both(exact, lambda: exact.native.qgemm(x, weight.data, weight.qtype, weight.in_features))
    assert_within_summation_error(tiles, x, weight)
    assert_within_summation_error(fp32, x, weight)


def assert_within_summation_error(got: torch.Tensor, x: torch.Tensor, weight) -> None:
    """Every output within 1e-5 of sum |w| |x| of the float64 product of the dequantized weights: float32
    summation error in any order (outputs that cancel to near zero are held to their terms' size)."""
    dense = reference.dequantize(weight).double()
    bound = 1e-5 * (x.abs().double() @ dense.abs().T)
    assert ((got.double() - x.double() @ dense.T).abs() <= bound).all()


@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_tiles_on_model_shapes_and_extreme_activations(exact, qtype):
    """A prefill-sized call (2,049 rows: 17 tasks of rows, a partial last tile) on a k of 576, rows scaled from
    2^-60 to 2^40 and elements within a row over 2^-12..2^12 (each splits into three bf16 parts exactly), exact
    zeros: every output within float32 summation error of the reference (1e-5 of sum |w| |x|)."""
    weight = random_quant(70, 576, qtype, 7)
    generator = torch.Generator().manual_seed(7)
    rows = torch.pow(2.0, torch.randint(-60, 40, (2049, 1), generator=generator).float())
    within = torch.pow(2.0, torch.randint(-12, 12, (2049, 576), generator=generator).float())
    x = torch.randn(2049, 576, generator=generator) * rows * within
    x[::5] = 0.0
    tiles, fp32 = both(exact, lambda: exact.native.qgemm(x, weight.data, weight.qtype, weight.in_features))
    assert_within_summation_error(tiles, x, weight)
    assert_within_summation_error(fp32, x, weight)
    assert torch.equal(tiles[::5], torch.zeros_like(tiles[::5]))


def test_engine_tokens_equal_with_and_without_tiles(tiny_model_dir, exact):
    """The quantized tiny Llama (Q8_0 and Q4_1 layers) through the layer loop: prompts of 70 and 40 tokens
    prefilled beside decodes, then 50-row decode steps: greedy tokens equal, logits within float32 rounding."""
    from test_layer_loop import quantized_tiny_llama, run_steps

    model = quantized_tiny_llama(tiny_model_dir, exact)
    prompts = [list(range(3, 73)), list(range(100, 140))] + [[(7 * i + j) % 500 + 3 for j in range(3 + i % 5)]
                                                            for i in range(48)]
    tiles, fp32 = both(exact, lambda: run_steps(model, prompts, 64, 4))
    assert tiles[-1].shape[0] == len(prompts)
    for got, want in zip(tiles, fp32, strict=True):
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_switch():
    kernels = Kernels.create("native", isa="avx512")
    assert kernels.native.amx_exact and "AMX tiles" in kernels.describe()
    avx2 = Kernels.create("native", isa="avx2")
    assert not avx2.native.set_amx_exact(True) and not avx2.native.amx_exact
    assert kernels.native.amx_exact  # the AVX2 handle leaves the library's switch alone
    assert not kernels.native.set_amx_exact(False) and not kernels.native.amx_exact
    assert "AMX" not in kernels.describe()
    assert kernels.native.set_amx_exact(True) and kernels.native.amx_exact
    code = "from kvserve.kernels.ops import Kernels; print(Kernels.create('native').native.amx_exact)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, AMX_ENV: "0"}, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"
