"""Native kernels against their torch twins (kvserve.kernels.reference) on random shapes.

Every test runs for each ISA this CPU has (AVX-512 and the forced AVX2 path where both exist), so the
AVX2 code is covered on AVX-512 machines too. Without the native library (no compiler, no AVX2) the
native half is skipped with the reason and only the fallback is checked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kernels import reference
from kvserve.kernels.ops import Kernels
from kvserve.kernels.quant import QTYPES, QuantWeight, bf16_weight

SETTINGS = settings(max_examples=25, deadline=None)





def random_quant(out_features: int, in_features: int, qtype: int, seed: int) -> QuantWeight:
    """A random matrix in GGUF block format with well-behaved fp16 scales (BF16: values in [-1, 1])."""
    rng = np.random.default_rng(seed)
    if QTYPES[qtype][0] == "BF16":  # raw bf16 rows (dense weights stored for fp32 arithmetic)
        values = torch.from_numpy(rng.uniform(-1.0, 1.0, (out_features, in_features)).astype(np.float32))
        return bf16_weight(values)
    num_blocks = in_features // 32
    scale = rng.uniform(-0.05, 0.05, (out_features, num_blocks, 1)).astype(np.float16).view(np.uint8)
    if QTYPES[qtype][0] == "Q8_0":
        quants = rng.integers(-128, 128, (out_features, num_blocks, 32), dtype=np.int8).view(np.uint8)
        blocks = np.concatenate([scale, quants], axis=-1)
    else:
        nibbles = rng.integers(0, 256, (out_features, num_blocks, 16), dtype=np.uint8)
        parts = [scale, nibbles]
        if QTYPES[qtype][0] == "Q4_1":
            parts.insert(1, rng.uniform(-0.2, 0.2, (out_features, num_blocks, 1)).astype(np.float16).view(np.uint8))
        blocks = np.concatenate(parts, axis=-1)
    data = torch.from_numpy(np.ascontiguousarray(blocks.reshape(out_features, -1)))
    return QuantWeight(data, qtype, in_features)


@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_dequantize_is_bit_exact_with_gguf(kernels, qtype):
    import gguf

    weight = random_quant(24, 96, qtype, seed=qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(weight.data.numpy(), gguf.GGMLQuantizationType(qtype)))
    assert torch.equal(reference.dequantize(weight), expected)
    assert torch.equal(kernels.dequantize(weight), expected)
    rows = torch.tensor([5, 0, 5, 23])
    assert torch.equal(kernels.embedding(rows, weight), expected[rows])


@SETTINGS
@given(
    rows=st.integers(1, 12), out_features=st.integers(1, 70), blocks=st.integers(1, 6),
    qtype=st.sampled_from(sorted(QTYPES)), seed=st.integers(0, 2**16),
)
def test_qmatmul_matches_reference(kernels, rows, out_features, blocks, qtype, seed):
    weight = random_quant(out_features, blocks * 32, qtype, seed)
    x = torch.randn(rows, blocks * 32, generator=torch.Generator().manual_seed(seed))
    expected = reference.qlinear(x, weight)
    native = kernels.native.qmatmul(x, weight.data, weight.qtype, weight.in_features)
    # Outputs reach ~100 (Q8_0: |w| <= 6.4): the summation order moves them by a few fp32 ulps of that.
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.linear(x, weight), expected, rtol=1e-5, atol=1e-4)


@SETTINGS
@given(
    block_size=st.sampled_from([1, 2, 4, 16, 32]), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4]),
    head_dim=st.sampled_from([16, 32, 64]), lens=st.lists(st.integers(1, 70), min_size=1, max_size=5),
    shared=st.booleans(), seed=st.integers(0, 2**16),
)
def test_paged_attention_matches_reference(kernels, block_size, kv_heads, group, head_dim, lens, shared, seed):
    """Decode rows with their own tables, or prefill-like rows sharing one table (stride 0)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = max_blocks * len(lens) + 1
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    queries = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen)
    context = torch.tensor(lens)
    if shared:
        table = torch.randperm(num_blocks, generator=gen)[:max_blocks]
        tables = table.expand(len(lens), -1)
        native = kernels.paged_attention(queries, keys, values, table, context, 0.125)
    else:
        tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks)
        native = kernels.paged_attention(queries, keys, values, tables, context, 0.125)
    expected = reference.paged_attention(queries, keys, values, tables, context, 0.125)
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(rows=st.integers(1, 20), width=st.sampled_from([16, 48, 64, 576]), residual=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rms_norm_matches_reference(kernels, rows, width, residual, seed):
    gen = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(rows, width, generator=gen), torch.randn(width, generator=gen)
    extra = torch.randn(rows, width, generator=gen) if residual else None
    expected, expected_sum = reference.rms_norm(x, weight, 1e-5, extra)
    original = x.clone()
    out, total = kernels.rms_norm(x, weight, 1e-5, extra)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(total, expected_sum)
    assert torch.equal(x, original)  # the caller's tensor is never modified


@pytest.mark.parametrize("qtype", [8, 3])
def test_qmatmul_reads_every_finite_fp16_scale_exactly(kernels, qtype):
    """The matmuls look block scales up in a table (csrc/kernels.cpp): every finite fp16 pattern, subnormals
    and signed zeros included, must come out as its float32 value. One block per row, x = e_0: Q8_0 with
    quant 1 gives d; Q4_1 with d = 1 and nibble 0 gives m."""
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    finite = patterns[((patterns.to(torch.int32) >> 10) & 0x1F) != 0x1F]
    halves = finite.view(torch.float16)
    rows = halves.shape[0]
    head = halves.view(torch.uint8).reshape(rows, 2)
    if qtype == 8:
        quants = torch.zeros(rows, 32, dtype=torch.uint8)
        quants[:, 0] = 1
        blocks = torch.cat([head, quants], dim=1)
    else:
        one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8).expand(rows, 2)
        blocks = torch.cat([one, head, torch.zeros(rows, 16, dtype=torch.uint8)], dim=1)
    weight = QuantWeight(blocks.contiguous(), qtype, 32)
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    out = kernels.native.qmatmul(x, weight.data, weight.qtype, 32)[0]
    torch.testing.assert_close(out, halves.float(), rtol=0, atol=0)


def test_bad_arguments_are_value_errors(kernels):
    weight = random_quant(4, 64, 8, seed=0)
    with pytest.raises(ValueError, match="expects 64"):
        kernels.native.qmatmul(torch.zeros(1, 32), weight.data, weight.qtype, 64)
    with pytest.raises(ValueError, match="contiguous CPU torch.float32"):
        kernels.native.qmatmul(torch.zeros(1, 64, dtype=torch.float64), weight.data, weight.qtype, 64)
    with pytest.raises(ValueError, match="out of range"):
        kernels.dequantize(weight, torch.tensor([4]))
    keys = torch.zeros(2, 4, 1, 16)
    with pytest.raises(ValueError, match="exceeds its block table"):
        kernels.native.paged_attention(torch.zeros(1, 1, 16), keys, keys, torch.tensor([[0]]), torch.tensor([5]), 1.0)


def test_unknown_backend_and_isa():
    with pytest.raises(ValueError, match="kernels must be one of"):
        Kernels.create("cuda")
    # An ISA the CPU lacks (or a nonsense one) is not a crash: it logs and falls back to torch.
    assert Kernels.create("native", isa="sse2").backend == "torch"


def test_torch_backend_is_the_reference():
    kernels = Kernels.create("torch")
    weight = random_quant(8, 64, 3, seed=1)
    x = torch.randn(3, 64)
    assert kernels.native is None
    assert torch.equal(kernels.linear(x, weight), reference.qlinear(x, weight))
