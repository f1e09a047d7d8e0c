"""Int8 activations (`--activation-quant int8`): the native kernel against its torch twin, the twin against
the fp32-activation result within the quantization error bound, the option's plumbing and refusals, and the
default model's greedy tokens against transformers fp32.

The native half runs for each ISA this CPU has (the VNNI path and the forced AVX2 path where both exist),
as tests/test_kernels.py does.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ISA_PARAMS
from kvserve.cli import build_parser, engine_config_from_args
from kvserve.config import EngineConfig
from kvserve.kernels import reference
from kvserve.kernels.ops import Kernels
from kvserve.kernels.quant import BLOCK_QTYPES
from test_kernels import random_quant

SETTINGS = settings(max_examples=25, deadline=None)


@pytest.fixture(scope="module", params=ISA_PARAMS)
def kernels(request) -> Kernels:
    forced = Kernels.create("native", isa=request.param, activation_quant="int8")
    assert forced.isa == request.param and forced.activation_quant == "int8"
    return forced


def activations(rows: int, width: int, seed: int) -> torch.Tensor:
    """Gaussian rows with a few outliers and (beyond the first) an all-zero block, whose d is 0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen)
    x[:, :: max(1, width // 7)] *= 20.0
    if x.numel() > 32:
        x[0, :32] = 0.0
    return x


@SETTINGS
@given(rows=st.integers(1, 12), width=st.sampled_from([32, 64, 576]), seed=st.integers(0, 2**16))
def test_quantization_is_bit_identical_to_the_twin(kernels, rows, width, seed):
    x = activations(rows, width, seed)
    q, d, s = kernels.native.quantize_i8(x)
    expected = reference.quantize_activations(x)
    for got, want in zip((q, d, s), expected, strict=True):
        assert torch.equal(got, want)
    assert int(q.abs().max()) <= 127
    zero_blocks = x.view(rows, -1, 32).abs().amax(-1) == 0
    assert torch.equal(d == 0, zero_blocks) and not q.view(rows, -1, 32)[zero_blocks].any()


@SETTINGS
@given(
    rows=st.integers(1, 40), out_features=st.integers(1, 70), blocks=st.integers(1, 6),
    qtype=st.sampled_from(sorted(BLOCK_QTYPES)), seed=st.integers(0, 2**16),
)
def test_native_int8_matmul_matches_twin(kernels, rows, out_features, blocks, qtype, seed):
    weight = random_quant(out_features, blocks * 32, qtype, seed)
    x = activations(rows, blocks * 32, seed)
    expected = reference.qlinear_i8(x, weight)
    native = kernels.native.qmatmul_i8(x, weight.data, weight.qtype, weight.in_features)
    # Same quantized integers, exact integer dots: only the float summation order differs.
    scale = float(expected.abs().max()) + 1.0
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=2e-6 * scale)
    torch.testing.assert_close(kernels.linear(x, weight), native, rtol=0, atol=0)  # every batch size: qmatmul_i8


@pytest.mark.parametrize("qtype", sorted(BLOCK_QTYPES))
def test_int8_matmul_row_passes_are_bit_identical(kernels, qtype):
    """Enough rows for several row passes (csrc/qmatmul_i8.h's i8_pass_rows: ~2,100 rows of k = 192 on the
    AVX-512 kernel, ~840 on the AVX2 one), a count that is no multiple of a pass or a row tile: each row's
    outputs equal the same rows computed alone in a short call, bit for bit, and the twin up to summation order."""
    rows, blocks = 4_421, 6
    weight = random_quant(37, blocks * 32, qtype, 7)
    x = activations(rows, blocks * 32, 7)
    native = kernels.native.qmatmul_i8(x, weight.data, weight.qtype, weight.in_features)
    for start in (0, 837, 2_180, 4_400):
        piece = kernels.native.qmatmul_i8(x[start:start + 21].contiguous(), weight.data, weight.qtype,
                                          weight.in_features)
        assert torch.equal(native[start:start + 21], piece)
    expected = reference.qlinear_i8(x, weight)
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=2e-6 * (float(expected.abs().max()) + 1.0))


@SETTINGS
@given(
    rows=st.integers(1, 8), out_features=st.integers(1, 40), blocks=st.integers(1, 6),
    qtype=st.sampled_from(sorted(BLOCK_QTYPES)), seed=st.integers(0, 2**16),
)
def test_twin_is_within_the_quantization_bound(rows, out_features, blocks, qtype, seed):
    """|x_i - dx*qx_i| <= dx/2, so |y_int8 - y_fp32| <= sum over blocks of dx/2 * sum |w| (plus float slack)."""
    weight = random_quant(out_features, blocks * 32, qtype, seed)
    x = activations(rows, blocks * 32, seed)
    dense = reference.dequantize(weight)
    exact = x.double() @ dense.double().t()
    _, d, _ = reference.quantize_activations(x)
    w_abs = dense.abs().view(out_features, blocks, 32).sum(-1).double()  # [out, nb]
    bound = 0.5 * d.double() @ w_abs.t()
    error = (reference.qlinear_i8(x, weight).double() - exact).abs()
    slack = 1e-5 * (x.abs().double() @ dense.abs().double().t()) + 1e-6
    assert bool((error <= bound + slack).all()), float((error - bound).max())
    assert float(bound.max()) > 0  # the bound is not vacuous: activations really were rounded


def test_torch_backend_runs_the_twin_and_dense_weights_ignore_it():
    kernels = Kernels.create("torch", activation_quant="int8")
    weight = random_quant(8, 64, 3, seed=1)
    x = torch.randn(3, 64)
    assert torch.equal(kernels.linear(x, weight), reference.qlinear_i8(x, weight))
    dense = torch.randn(64, 5)
    assert torch.equal(kernels.linear(x, dense), x @ dense)
    with pytest.raises(ValueError, match="activation_quant must be one of"):
        Kernels.create("torch", activation_quant="int4")


def test_option_is_one_flag_through_config_and_refused_without_quantized_weights(tiny_model_dir):
    from kvserve import LLM

    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--weights", "native", "--activation-quant", "int8"])
    assert engine_config_from_args(args).activation_quant == "int8"
    assert EngineConfig().activation_quant == "none"
    assert EngineConfig(activation_quant="int8").weights == "native"  # the default weights allow it
    with pytest.raises(ValueError, match="needs weights='native'"):
        EngineConfig(activation_quant="int8", weights="dense")
    with pytest.raises(ValueError, match="activation_quant must be one of"):
        EngineConfig(activation_quant="fp8", weights="native")
    # An HF directory has no quantized tensors: refused by name, not silently run in fp32.
    with pytest.raises(ValueError, match="needs quantized weights"):
        LLM(str(tiny_model_dir), progress=False, num_blocks=16, weights="native", activation_quant="int8")


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a dragon who",
]
NEAR_TIE = 0.5  # logits: HF's top-2 gap below which the bounded int8 error may legitimately swap them
NEW_TOKENS = 32


@pytest.mark.model
def test_int8_greedy_agrees_with_transformers_fp32(smollm2_hf):
    """Greedy int8 tokens, teacher-forced through transformers fp32: HF's top-1 must match at >= 90% of
    positions (teacher forcing: one near-tie does not cascade into the count), and the first generated token
    must equal HF's unless HF's own top-2 are within NEAR_TIE logits."""
    from kvserve import LLM, SamplingParams

    llm = LLM("smollm2-135m", progress=False, num_blocks=256, weights="native", activation_quant="int8")
    assert llm.engine.model.kernels.activation_quant == "int8"
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    hf = smollm2_hf
    agree = total = 0
    for out in outputs:
        prompt, generated = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + generated])).logits[0]
        steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]
        hf_top1 = steps.argmax(-1).tolist()
        top2 = steps[0].topk(2).values
        assert hf_top1[0] == generated[0] or float(top2[0] - top2[1]) < NEAR_TIE, out.prompt
        agree += sum(a == b for a, b in zip(hf_top1, generated, strict=True))
        total += len(generated)
    rate = agree / total
    print(f"int8 activations: top-1 agreement with transformers fp32 {agree}/{total} = {rate:.3f}")
    assert rate >= 0.9
