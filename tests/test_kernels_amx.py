"""The int8 path on AMX tiles (csrc/qmatmul_amx.h): bit-identical to the VNNI packed kernel and to the
GGUF-layout kernel for Q8_0 (where the engine runs tiles) and Q4_0 / Q4_1 (the tile code it keeps off),
whole tiles and ragged rows (16..130, odd and even block counts, column counts no multiple of 16), across
row passes, and through the engine's layer loop (prefill, mixed and 16+-row decode steps); the switch
itself (on where the CPU has AMX-INT8, off with KVSERVE_AMX=0, never on the AVX2 build). Needs a CPU with
AMX-INT8 (Sapphire Rapids or later): skipped elsewhere."""

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
from kvserve.kernels.native import AMX_ENV
from kvserve.kernels.ops import Kernels
from kvserve.kernels.quant import BLOCK_QTYPES
from test_kernels import random_quant
from test_kernels_int8 import activations

pytestmark = pytest.mark.skipif(not avx512_with("amx_int8"), reason="this CPU has no AMX-INT8 (or no AVX-512 build)")
SETTINGS = settings(max_examples=40, deadline=None)


@pytest.fixture(scope="module")
def int8() -> Iterator[Kernels]:
    kernels = Kernels.create("native", isa="avx512", activation_quant="int8")
    assert kernels.native.amx, "AMX-INT8 present but the tiles were not enabled"
    yield kernels
    kernels.native.set_amx(True)


def both(kernels: Kernels, call) -> tuple[torch.Tensor, torch.Tensor]:
    """`call()` with the tiles on for every weight type (Q4 too, where the engine keeps VNNI), then off
    (restored to the default: Q8_0 only)."""
    return on_then_off(lambda on: kernels.native.set_amx(on, every_type=on), call, lambda: kernels.native.set_amx(True))


@SETTINGS
@given(rows=st.sampled_from([16, 17, 31, 32, 33, 48, 70, 130]), out_features=st.integers(1, 70),
       blocks=st.integers(1, 7), qtype=st.sampled_from(sorted(BLOCK_QTYPES)), seed=st.integers(0, 2**16))
def test_tiles_are_bit_identical_to_vnni(int8, rows, out_features, blocks, qtype, seed):
    weight = random_quant(out_features, blocks * 32, qtype, seed)
    x = activations(rows, blocks * 32, seed)
    packed = int8.prepare_int8(weight)
    tiles, vnni = both(int8, lambda: int8.native.qmatmul_i8_packed(x, packed))
    assert torch.equal(tiles, vnni)
    assert torch.equal(tiles, int8.native.qmatmul_i8(x, weight.data, weight.qtype, weight.in_features))


@pytest.mark.parametrize("qtype", sorted(BLOCK_QTYPES))
def test_tiles_across_row_passes(int8, qtype):
    """~4,400 rows of k = 1,536 (many row passes, each a multiple of 16 rows) and 53 columns."""
    weight = random_quant(53, 48 * 32, qtype, 3)
    x = activations(4_421, 48 * 32, 3)
    packed = int8.prepare_int8(weight)
    tiles, vnni = both(int8, lambda: int8.native.qmatmul_i8_packed(x, packed))
    assert torch.equal(tiles, vnni)


def test_engine_logits_equal_with_and_without_tiles(tiny_model_dir, int8):
    """The quantized tiny Llama through the layer loop: 18 prompts prefilled one per step beside the decodes
    before them, then decoded together (18-row decode steps, a 40-token prefill): every logit bit-identical."""
    from test_layer_loop import quantized_tiny_llama, run_steps

    model = quantized_tiny_llama(tiny_model_dir, int8)
    assert model.layer_loop is not None
    prompts = [list(range(3, 43))] + [[(7 * i + j) % 500 + 3 for j in range(3 + i % 5)] for i in range(17)]
    tiles, vnni = both(int8, lambda: run_steps(model, prompts, 16, 4))
    assert len(tiles) == len(prompts) + 4 and tiles[-1].shape[0] == len(prompts)
    for got, want in zip(tiles, vnni, strict=True):
        assert torch.equal(got, want)


def test_the_switch():
    kernels = Kernels.create("native", isa="avx512", activation_quant="int8")
    assert kernels.native.amx and "AMX tiles" in kernels.describe()
    avx2 = Kernels.create("native", isa="avx2", activation_quant="int8")
    assert not avx2.native.set_amx(True) and not avx2.native.amx
    assert kernels.native.amx  # the AVX2 handle leaves the library's switch alone
    assert not kernels.native.set_amx(False) and not kernels.native.amx
    assert kernels.native.set_amx(True) and kernels.native.amx
    code = ("from kvserve.kernels.ops import Kernels; "
            "print(Kernels.create('native', activation_quant='int8').native.amx)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, AMX_ENV: "0"}, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"
