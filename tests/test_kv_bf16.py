"""A bf16 KV cache (`--kv-cache-dtype bfloat16`): half the bytes per token under float32 arithmetic.

The oracle is transformers with a cache that rounds every key and value to bf16 as it stores them, which is
what the pool holds; attention then reads those rounded values whether they were computed in this step,
cached by an earlier request or loaded from a tier. The torch kernels run the oracle's arithmetic: their
greedy tokens equal it, batched, chunked, cached (tests/test_kv_narrow.py, for every narrow dtype). The native
kernels write the pool with the same rounding
as torch's (bit for bit) and read a bf16 pool exactly as the same values widened to float32; end to end they
differ from the oracle by summation order *before* the rounding, and a key that lands on the other side of a
bf16 rounding boundary moves by 2^-8 of itself (9 of 9,600 pool values for a 50-token prompt here), so their
check is on log-probabilities, teacher-forced: within 0.03 of the twin's, where float32 KV is 0.2 away.
"""

from __future__ import annotations

import pytest
import torch

from conftest import on_then_off, random_prompts
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.kernels import reference
from kvserve.kv.cascade import plan_cascade
from test_kv_narrow import hf_greedy_rounded

MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(8, 3, 90, seed=1)


@pytest.fixture(scope="module")
def reference_bf16(tiny_hf_model, prompts) -> list[list[int]]:
    return [hf_greedy_rounded(tiny_hf_model, p, "bfloat16", MAX_NEW) for p in prompts]


# --- the native path against the twin (batched, chunked, cached, tiers: tests/test_kv_narrow.py) ------


def teacher_forced_logprobs(model_dir, requests: list[list[int]], **engine_args) -> torch.Tensor:
    """The top-5 log-probabilities of the next token after each request, computed fresh (no cache)."""
    llm = LLM(str(model_dir), progress=False, num_blocks=256, prefix_cache="off", **engine_args)
    outputs = llm.generate(requests, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5))
    return torch.tensor([[value for _, value in output.logprobs[0].top] for output in outputs])


def test_native_kernels_track_the_twin(tiny_model_dir, prompts, reference_bf16):
    """Every prefix of the oracle's continuations (192 requests: prefill through csrc/prefill.h and the
    native write) gives log-probabilities within 0.03 of the torch twin's with a bf16 cache; a float32 cache
    is 0.1+ away from it, so the bound tells the two apart (measured: 0.0098 and 0.21 on AVX-512)."""
    requests = [p + r[:k] for p, r in zip(prompts, reference_bf16, strict=True) for k in range(MAX_NEW)]
    twin = teacher_forced_logprobs(tiny_model_dir, requests, kernels="torch", kv_cache_dtype="bfloat16")
    native = teacher_forced_logprobs(tiny_model_dir, requests, kernels="native", kv_cache_dtype="bfloat16")
    float32 = teacher_forced_logprobs(tiny_model_dir, requests, kernels="native")
    assert (native - twin).abs().max() < 0.03
    assert (float32 - twin).abs().max() > 0.1


def test_config_names_the_supported_dtypes(tiny_model_dir):
    from kvserve.cli import build_parser, engine_config_from_args

    assert EngineConfig().kv_cache_dtype == "auto"
    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "bfloat16"])
    assert engine_config_from_args(args).kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(str(tiny_model_dir), progress=False, kv_cache_dtype="int4")
    auto = LLM(str(tiny_model_dir), progress=False, num_blocks=8, dtype="bfloat16", kernels="torch")
    assert auto.engine.kv_pool.tensor.dtype == torch.bfloat16  # auto: the model's dtype


# --- kernels -------------------------------------------------------------------------------------------


def random_bits(count: int, gen: torch.Generator) -> torch.Tensor:
    """Float32 values from random bit patterns (finite, exponents spread around 1, a quarter of them exact
    ties for the rounding: low 16 bits 0x8000), subnormals and zeros among them."""
    bits = torch.randint(0, 2**31, (count,), generator=gen, dtype=torch.int64)
    exponent = torch.randint(100, 140, (count,), generator=gen)
    pattern = (bits & 0x807FFFFF) | (exponent << 23)
    ties = torch.rand(count, generator=gen) < 0.25
    pattern = torch.where(ties, (pattern & ~0xFFFF) | 0x8000, pattern)
    pattern[:8] = torch.tensor([0, 1, 0x8000, 0x7FFFFF, 0x80000001, 0x00018000, 0x3F808000, 0x3F818000])
    return pattern.to(torch.int32).view(torch.float32)


def rope_writes(kernels, values, dtype: torch.dtype):
    """For three head shapes (48 = 16 + 8: a scalar tail on AVX-512): (native queries, twin queries, native
    pool, twin pool) after each writes the same rows, ``values(count, gen)`` float32 inputs, into a `dtype` pool."""
    gen = torch.Generator().manual_seed(3)
    for heads, kv_heads, head_dim in ((4, 2, 48), (3, 1, 64), (2, 2, 16)):
        rows, num_slots = 37, 64
        qkv = values(rows * (heads + 2 * kv_heads) * head_dim, gen).view(rows, -1)
        positions = torch.randint(0, 100, (rows,), generator=gen)
        angles = torch.rand(100, head_dim, generator=gen) * 6.3
        cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
        slots = torch.randperm(num_slots, generator=gen)[:rows]
        pools = [torch.zeros(2, num_slots // 4, 4, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
        native_q = kernels.native.rope_kv_write(qkv, heads, kv_heads, positions, cos, sin, pools[0][0], pools[0][1],
                                                slots)
        twin_q = reference.rope_kv_write(qkv, heads, kv_heads, positions, cos, sin, pools[1][0], pools[1][1], slots)
        yield native_q, twin_q.view_as(native_q), pools[0], pools[1]


def test_rope_kv_write_rounds_as_torch(kernels):
    """The native write rounds keys (after RoPE) and values to nearest even as torch does: the same bits,
    including exact ties, subnormals and head sizes with a scalar tail."""
    for native_q, twin_q, pool, twin_pool in rope_writes(kernels, random_bits, torch.bfloat16):
        assert torch.equal(native_q, twin_q)
        assert torch.equal(pool.view(torch.int16), twin_pool.view(torch.int16))


def bf16_pool(gen: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 pool half and the same values widened to float32."""
    half = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    return half, half.float()


@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim"), [(16, 3, 3, 64), (1, 1, 4, 32),
                                                                          (5, 2, 2, 16), (32, 2, 1, 48)])
def test_attention_kernels_read_bf16_as_the_widened_values(kernels, block_size, kv_heads, group, head_dim):
    """Decode, prefill and cascade attention over a bf16 pool give exactly (bit for bit) what they give over
    a float32 pool of the same values, and match the torch twin. Where AMX-BF16 tiles run a bf16 pool's
    prefill and shared-prefix products (csrc/prefill_amx.h: exact products, float32 sums in the tiles' order)
    that holds with the tiles off; with them on, within summation order."""
    attention_reads_widened(kernels, block_size, kv_heads, group, head_dim, bf16_pool)


def attention_reads_widened(kernels, block_size: int, kv_heads: int, group: int, head_dim: int, pool) -> None:
    """Decode, prefill and cascade attention over a narrow pool (``pool(gen, *shape)``: the pool half and its
    float32 widening) against the widened pool, bit for bit with AMX tiles off (`bit_for_bit`), and the tiles'
    prefill within summation order of the FMAs' where the CPU has them."""
    width = 16 if kernels.isa == "avx512" else 8
    if head_dim % width:
        pytest.skip(f"head_dim {head_dim} is not a multiple of the {kernels.isa} vector")
    gen = torch.Generator().manual_seed(block_size * 31 + head_dim)
    lens = torch.tensor([1, block_size * 3 + 1, 7, 40, 2 * block_size])
    width_blocks = int(-(-lens.max() // block_size))
    num_blocks, heads = 5 * width_blocks + 8, kv_heads * group
    keys, keys32 = pool(gen, num_blocks, block_size, kv_heads, head_dim)
    values, values32 = pool(gen, num_blocks, block_size, kv_heads, head_dim)
    tables = torch.randperm(num_blocks, generator=gen)[: 5 * width_blocks].view(5, width_blocks).contiguous()
    queries = torch.randn(5, heads, head_dim, generator=gen)
    native = kernels.native
    tiles = native.amx_exact
    native.set_amx_exact(False)
    try:
        bit_for_bit(native, queries, keys, values, keys32, values32, tables, lens, block_size, width_blocks)
    finally:
        native.set_amx_exact(tiles)
    if tiles:
        on, off = on_then_off(native.set_amx_exact, lambda: native.prefill_attention(
            queries, keys, values, torch.tensor([[0, 3, 3], [3, 2, int(lens[1])]]), tables[:2].contiguous(), 0.3))
        torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)


def bit_for_bit(native, queries, keys, values, keys32, values32, tables, lens, block_size, width_blocks):
    # Against the torch twin: within summation order, whose error scales with the values summed (the fp8 pool
    # reaches 7.5), not with an output that cancels to near zero: a fixed 1e-5 failed on a Zen 4 (1.02e-5 off at
    # 0.008, the cascade of the forced AVX2 path; it passed on the Intel CPUs).
    atol = 1e-5 * max(1.0, float(values32.abs().max()))
    decode = native.paged_attention(queries, keys, values, tables, lens, 0.3)
    assert torch.equal(decode, native.paged_attention(queries, keys32, values32, tables, lens, 0.3))
    torch.testing.assert_close(decode, reference.paged_attention(queries, keys, values, tables, lens, 0.3),
                               rtol=1e-5, atol=atol)
    spans = torch.tensor([[0, 3, 3], [3, 2, int(lens[1])]])  # a fresh 3-token span, 2 tokens after cached ones
    span_tables = tables[:2].contiguous()
    prefill = native.prefill_attention(queries, keys, values, spans, span_tables, 0.3)
    assert torch.equal(prefill, native.prefill_attention(queries, keys32, values32, spans, span_tables, 0.3))
    shared = [tables[1, :3].tolist() + [int(b)] for b in tables[2:, 0]]  # rows sharing 3 leading blocks
    share_tables = torch.tensor([row + [0] * (width_blocks - 4) for row in shared])
    share_lens = torch.tensor([3 * block_size + 1] * 3)
    plan = plan_cascade(share_tables.tolist(), share_lens.tolist(), block_size, min_rows=1, min_blocks=1)
    assert plan is not None and plan.num_groups == 1
    cascade = native.cascade_attention(queries[:3], keys, values, share_tables, share_lens, plan, 0.3)
    assert torch.equal(cascade, native.cascade_attention(queries[:3], keys32, values32, share_tables, share_lens,
                                                         plan, 0.3))
    torch.testing.assert_close(cascade, reference.paged_attention(queries[:3], keys, values, share_tables,
                                                                  share_lens, 0.3), rtol=1e-5, atol=atol)
