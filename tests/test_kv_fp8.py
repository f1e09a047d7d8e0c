"""An fp8 KV cache (`--kv-cache-dtype fp8`, vLLM's name): e4m3fn keys and values, a quarter of float32's bytes.

As with the bf16 cache (tests/test_kv_bf16.py), the oracle is transformers with a cache that rounds every key
and value as the pool stores it (torch's `.to(torch.float8_e4m3fn)`: nearest even, saturating at +-448), and
attention reads those rounded values whether computed in this step, cached, or loaded from a tier. The torch
kernels run the oracle's arithmetic: their greedy tokens equal it, batched, chunked, cached (tests/
test_kv_narrow.py, with the tiers and cache hits on the native kernels too). The native kernels
store the same bits as torch (every rounding case compared here) and read the pool exactly as the values widened
to float32 (bit for bit the same attention as over a float32 pool of those values); end to end they differ from
the twin by summation order before the rounding, which at 3 mantissa bits moves a key or value crossing a rounding
boundary by 1/16 of itself: their check is teacher-forced log-probabilities, against the twin's.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from kvserve.config import EngineConfig
from test_kv_bf16 import attention_reads_widened, rope_writes, teacher_forced_logprobs
from test_kv_narrow import hf_greedy_rounded

FP8 = torch.float8_e4m3fn
MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(8, 3, 90, seed=1)


@pytest.fixture(scope="module")
def reference_fp8(tiny_hf_model, prompts) -> list[list[int]]:
    return [hf_greedy_rounded(tiny_hf_model, p, "fp8", MAX_NEW) for p in prompts]


# --- the native path against the twin (batched, chunked, cached, tiers: tests/test_kv_narrow.py) ------


def test_native_kernels_track_the_twin(tiny_model_dir, prompts, reference_fp8):
    """Every prefix of the oracle's continuations (192 requests, prefill through the native write and
    csrc/prefill.h) gives log-probabilities within 0.05 of the torch twin's with an fp8 cache, where a bf16
    cache's are 0.3+ away: the bound tells the native path's fp8 from bf16."""
    requests = [p + r[:k] for p, r in zip(prompts, reference_fp8, strict=True) for k in range(MAX_NEW)]
    twin = teacher_forced_logprobs(tiny_model_dir, requests, kernels="torch", kv_cache_dtype="fp8")
    native = teacher_forced_logprobs(tiny_model_dir, requests, kernels="native", kv_cache_dtype="fp8")
    bf16 = teacher_forced_logprobs(tiny_model_dir, requests, kernels="native", kv_cache_dtype="bfloat16")
    gap, bf16_gap = (native - twin).abs().max(), (bf16 - twin).abs().max()
    assert gap < 0.05 and bf16_gap > 0.3, (gap, bf16_gap)  # measured: 2.9e-5 and 1.35 (AVX-512, AMX)


def test_config_accepts_vllms_names_and_refuses_the_rest():
    from kvserve.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "fp8"])
    assert engine_config_from_args(args).kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*e4m3 only"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="attention_dtype='bfloat16' multiplies bf16 keys"):
        EngineConfig(kv_cache_dtype="fp8", attention_dtype="bfloat16")


# --- kernels -------------------------------------------------------------------------------------------


def fp8_cases(count: int, gen: torch.Generator) -> torch.Tensor:
    """Finite float32 values across e4m3's whole range and past it (2^-13 .. 2^10: zeros, subnormals,
    normals, saturation), a quarter of them exact rounding ties (low 20 bits 0x80000; below 2^-6 the ties of
    the 2^-9 grid), and the edges by hand."""
    bits = torch.randint(0, 2**31, (count,), generator=gen, dtype=torch.int64)
    exponent = torch.randint(114, 137, (count,), generator=gen)
    pattern = (bits & 0x807FFFFF) | (exponent << 23)
    ties = torch.rand(count, generator=gen) < 0.25
    pattern = torch.where(ties, (pattern & ~0xFFFFF) | 0x80000, pattern)
    values = pattern.to(torch.int32).view(torch.float32)
    grid_ties = (torch.arange(16) + 0.5) * 2.0**-9
    edges = torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 479.9, 480.0, 1e30, -1e30, 2.0**-6, 2.0**-9, 2.0**-10,
                          0.99 * 2.0**-10, 1.01 * 2.0**-10, float("inf"), float("-inf")])
    values[: 32] = torch.cat([grid_ties, edges])
    return values


def test_rope_kv_write_rounds_as_torch(kernels):
    """The native write stores keys (after RoPE) and values as torch's cast does, bit for bit: ties to even,
    subnormals, saturation at 448 (infinities too), head sizes with a scalar tail."""
    for native_q, twin_q, pool, twin_pool in rope_writes(kernels, fp8_cases, FP8):
        finite = torch.isfinite(native_q)  # inf - inf in RoPE: NaNs whose sign is arbitrary
        assert torch.equal(native_q[finite], twin_q[finite])
        keys, twin_keys = pool[0].view(torch.uint8), twin_pool[0].view(torch.uint8)
        nan = (keys & 0x7F) == 0x7F
        assert torch.equal(keys[~nan], twin_keys[~nan]) and torch.equal(nan, (twin_keys & 0x7F) == 0x7F)
        assert torch.equal(pool[1].view(torch.uint8), twin_pool[1].view(torch.uint8))  # values: no arithmetic


def fp8_pool(gen: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 pool half of bytes up to 0x4F (7.5; subnormals included, both signs) and its float32 widening."""
    raw = torch.randint(0, 0x50, shape, generator=gen, dtype=torch.uint8) | (
        torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8) << 7)
    return raw.view(FP8), raw.view(FP8).float()


@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim"), [
    (16, 3, 3, 64), (1, 1, 4, 32), (5, 2, 2, 16), (32, 2, 1, 48), (8, 2, 4, 128), (3, 2, 2, 32), (16, 1, 5, 64)])
def test_attention_kernels_read_fp8_as_the_widened_values(kernels, block_size, kv_heads, group, head_dim):
    """Decode, prefill and cascade attention over an fp8 pool give bit for bit what they give over a float32
    pool of the widened values -- decode scores by KV head over a narrow pool (G 1-4, csrc/decode_attention.h's
    da_scores_group), query by query over float32 -- and match the twin; where AMX-BF16 tiles run the prefill
    products (the fp8 rows widened to bf16, exactly), within summation order."""
    attention_reads_widened(kernels, block_size, kv_heads, group, head_dim, fp8_pool)
