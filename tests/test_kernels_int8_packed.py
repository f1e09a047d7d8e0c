"""The int8 path's packed weights (kernels/i8pack.py, csrc/qmatmul_i8_packed.h), on every ISA this CPU runs: the
native packing against its torch twin byte for byte, the packed kernel bit-identical to the GGUF-layout AVX-512
kernel (Q4_0, Q4_1, Q8_0; column counts no multiple of 16; rows 1..9, 33 and several row passes) -- the AVX2
packed kernel too, where the CPU runs both; on AVX2 alone, close to the torch twin and the same bits at every
row count -- the layout refused by every other kernel, and the engine's greedy tokens with packing equal to
those without it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ISAS
from kvserve.kernels import reference
from kvserve.kernels.i8pack import PackedI8Weight, pack_reference
from kvserve.kernels.ops import Kernels
from kvserve.kernels.quant import BLOCK_QTYPES
from test_kernels import random_quant
from test_kernels_int8 import activations

pytestmark = pytest.mark.skipif(not ISAS, reason="native kernels unavailable")
SETTINGS = settings(max_examples=30, deadline=None)


@pytest.fixture(scope="module", params=ISAS)
def int8(request) -> Kernels:
    kernels = Kernels.create("native", isa=request.param, activation_quant="int8")
    assert kernels.packs_int8()
    return kernels


def assert_like_gguf_kernel(kernels: Kernels, x: torch.Tensor, weight, got: torch.Tensor) -> None:
    """AVX-512: the GGUF-layout kernel's bits. AVX2 (whose GGUF-layout kernel sums 8 lanes a block, not exact
    block sums): the AVX-512 packed kernel's bits where this CPU has it, else the twin's value and the same
    bits for every row alone."""
    expected = kernels.native.qmatmul_i8(x, weight.data, weight.qtype, weight.in_features)
    if kernels.isa == "avx512":
        assert torch.equal(got, expected)
        return
    if "avx512" in ISAS:
        wide = Kernels.create("native", isa="avx512", activation_quant="int8")
        assert torch.equal(got, wide.native.qmatmul_i8_packed(x, wide.prepare_int8(weight)))
    want = reference.qlinear_i8(x, weight)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()) + 1e-30)
    packed = kernels.prepare_int8(weight)
    for r in range(0, x.shape[0], max(1, x.shape[0] // 5)):
        assert torch.equal(kernels.native.qmatmul_i8_packed(x[r : r + 1].contiguous(), packed)[0], got[r])


@SETTINGS
@given(out_features=st.integers(1, 70), blocks=st.integers(1, 6), qtype=st.sampled_from(sorted(BLOCK_QTYPES)),
       seed=st.integers(0, 2**16))
def test_native_packing_equals_the_torch_twin(int8, out_features, blocks, qtype, seed):
    weight = random_quant(out_features, blocks * 32, qtype, seed)
    packed = int8.native.pack_i8(weight.data, weight.qtype, weight.in_features)
    assert torch.equal(packed.data, pack_reference(weight).data)
    assert packed.shape == weight.shape and packed.code != weight.qtype
    if qtype != 8:  # Q4: the same bytes as the GGUF blocks, rearranged (plus zero padding columns)
        assert packed.nbytes() == -(-out_features // 16) * 16 * weight.row_bytes


@SETTINGS
@given(rows=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 33]), out_features=st.integers(1, 70),
       blocks=st.integers(1, 6), qtype=st.sampled_from(sorted(BLOCK_QTYPES)), seed=st.integers(0, 2**16))
def test_packed_matmul_is_bit_identical_to_the_gguf_kernel(int8, rows, out_features, blocks, qtype, seed):
    weight = random_quant(out_features, blocks * 32, qtype, seed)
    x = activations(rows, blocks * 32, seed)
    packed = int8.prepare_int8(weight)
    assert isinstance(packed, PackedI8Weight)
    got = int8.native.qmatmul_i8_packed(x, packed)
    assert_like_gguf_kernel(int8, x, weight, got)
    assert torch.equal(int8.linear(x, packed), got)


@pytest.mark.parametrize("qtype", sorted(BLOCK_QTYPES))
def test_packed_row_passes_are_bit_identical(int8, qtype):
    """Several row passes (~2,100 rows of k = 192 each) and a column count no multiple of 16 or 32."""
    weight = random_quant(53, 6 * 32, qtype, 11)
    x = activations(4_421, 6 * 32, 11)
    packed = int8.prepare_int8(weight)
    assert_like_gguf_kernel(int8, x, weight, int8.native.qmatmul_i8_packed(x, packed))


def test_other_kernels_refuse_the_packed_layout(int8):
    weight = random_quant(32, 64, 3, 5)
    packed = int8.prepare_int8(weight)
    x = torch.randn(2, 64)
    for entry in ("kv_qmatmul", "kv_qgemm"):  # an fp32 matmul handed the packed code
        status = getattr(int8.native.lib, entry)(int8.native.code, packed.code, x.data_ptr(), 2, 64,
                                                 packed.data.data_ptr(), 32, packed.group_bytes,
                                                 torch.empty(2, 32).data_ptr(), 32)
        assert status == -1, entry
    assert not Kernels.create("native", isa=int8.isa).packs_int8()  # exact activations: never packed
    with pytest.raises(ValueError, match="packed int8 weight needs"):
        Kernels("native", int8.native, "none").linear(x, packed)
    with pytest.raises(ValueError, match="must be contiguous uint8"):
        PackedI8Weight(packed.data[:, :-1].contiguous(), 3, 64, 32)


@pytest.mark.skipif("avx512" not in ISAS, reason="bit-identical to the GGUF-layout kernel on AVX-512 only")
def test_engine_greedy_tokens_equal_with_and_without_packing(tiny_model_dir, monkeypatch):
    """The tiny Llama quantized (Q8_0 / Q4_1 layers, layer_loop's fixture): packed (the default with int8 activations)
    against the GGUF-layout kernel (packing disabled), every step's logits bit-identical, through the layer
    loop's decode step, its prefill path and the Python loop."""
    from test_layer_loop import quantized_tiny_llama, run_steps

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    native = Kernels.create("native", isa="avx512").native
    packed_model = quantized_tiny_llama(tiny_model_dir, Kernels("native", native, activation_quant="int8"))
    assert isinstance(packed_model.layers[0].gate_up_proj, PackedI8Weight)
    monkeypatch.setattr(Kernels, "packs_int8", lambda self: False)
    plain_model = quantized_tiny_llama(tiny_model_dir, Kernels("native", native, activation_quant="int8"))
    assert not isinstance(plain_model.layers[0].gate_up_proj, PackedI8Weight)
    monkeypatch.undo()
    prompts = [[1, 5, 9, 33, 7], list(range(3, 40)), [2, 8]]
    for model in (packed_model, plain_model):
        assert model.layer_loop is not None
    packed_logits = run_steps(packed_model, prompts, 16, 6)
    plain_logits = run_steps(plain_model, prompts, 16, 6)
    for got, want in zip(packed_logits, plain_logits, strict=True):
        assert torch.equal(got, want)
    # The Python loop (the layer loop off) reads the packed weights through Kernels.linear: same tokens.
    packed_model.layer_loop = None
    python_logits = run_steps(packed_model, prompts, 16, 6)
    for got, want in zip(python_logits, plain_logits, strict=True):
        assert torch.equal(got.argmax(-1), want.argmax(-1))
