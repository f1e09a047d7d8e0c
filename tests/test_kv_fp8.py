"""An fp8 KV cache (`--kv-cache-dtype fp8`, vLLM's name): e4m3fn keys and values, a quarter of float32's bytes.

As with the bf16 cache (tests/test_kv_bf16.py), the oracle is transformers with a cache that rounds every key
and value as the pool stores it (torch's `.to(torch.float8_e4m3fn)`: nearest even, saturating at +-448), and
attention reads those rounded values whether computed in this step, cached, or loaded from a tier. The torch
kernels run the oracle's arithmetic: their greedy tokens equal it, batched, chunked, cached. The native kernels
store the same bits as torch (every rounding case compared here) and read the pool exactly as the values widened
to float32 (bit for bit the same attention as over a float32 pool of those values); end to end they differ from
the twin by summation order before the rounding, which at 3 mantissa bits moves a key or value crossing a rounding
boundary by 1/16 of itself: their check is teacher-forced log-probabilities, against the twin's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import assert_pool_drained, hf_greedy, on_then_off, random_prompts
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.kernels import reference
from test_kv_bf16 import bit_for_bit, teacher_forced_logprobs

FP8 = torch.float8_e4m3fn
MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


class FP8Cache(DynamicCache):
    """transformers' cache, storing (and returning to attention) keys and values rounded to e4m3fn."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rounded = (state.to(FP8).to(state.dtype) for state in (key_states, value_states))
        return super().update(*rounded, layer_idx, *args, **kwargs)


def hf_greedy_fp8_cache(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    return hf_greedy(model, prompt_ids, max_new_tokens, cache=FP8Cache())


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(8, 3, 90, seed=1)


@pytest.fixture(scope="module")
def reference_fp8(tiny_hf_model, prompts) -> list[list[int]]:
    return [hf_greedy_fp8_cache(tiny_hf_model, p, MAX_NEW) for p in prompts]


def make_llm(model_dir, **engine_args) -> LLM:
    engine_args.setdefault("num_blocks", 256)
    return LLM(str(model_dir), progress=False, kv_cache_dtype="fp8", **engine_args)


# --- engine outputs ---------------------------------------------------------------------------------


def test_oracle_tells_fp8_from_float32(tiny_hf_model, prompts, reference_fp8):
    pairs = zip(prompts, reference_fp8, strict=True)
    assert any(hf_greedy(tiny_hf_model, p, MAX_NEW) != expected for p, expected in pairs)


@pytest.mark.parametrize("prefix_cache", ["radix", "hash", "off"])
def test_batched_greedy_equals_transformers_with_an_fp8_cache(tiny_model_dir, prompts, reference_fp8, prefix_cache):
    llm = make_llm(tiny_model_dir, kernels="torch", prefix_cache=prefix_cache)
    assert llm.engine.kv_pool.tensor.dtype == FP8
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference_fp8
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize(("budget", "block_size"), [(5, 16), (33, 1), (16, 4)])
def test_chunked_prefill_and_block_sizes(tiny_model_dir, prompts, reference_fp8, budget, block_size):
    llm = make_llm(tiny_model_dir, kernels="torch", max_num_batched_tokens=budget, block_size=block_size,
                   num_blocks=2048 // block_size)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference_fp8


@pytest.mark.parametrize("kernels_name", ["torch", "native"])
def test_cache_hits_do_not_change_outputs(tiny_model_dir, tiny_hf_model, kernels_name):
    """Prompts sharing a cached prefix read the cached fp8 blocks: the same tokens as computing everything
    fresh (the oracle, for the twin; the native kernels' own fresh run, for them)."""
    shared = random_prompts(1, 40, 40, seed=5)[0]
    prompts = [shared + tail for tail in random_prompts(3, 5, 9, seed=6)]
    llm = make_llm(tiny_model_dir, kernels=kernels_name)
    fresh = make_llm(tiny_model_dir, kernels=kernels_name, prefix_cache="off")
    for prompt in prompts + prompts[:1]:
        output = llm.generate([prompt], GREEDY)[0]
        expected = (hf_greedy_fp8_cache(tiny_hf_model, prompt, MAX_NEW) if kernels_name == "torch"
                    else fresh.generate([prompt], GREEDY)[0].token_ids)
        assert output.token_ids == expected
    assert llm.stats()["prefix_cache_hits_device"] >= 3 * 32


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


def test_the_same_memory_holds_four_times_float32s_blocks(tiny_model_dir):
    fp32 = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="4MiB")
    fp8 = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="4MiB", kv_cache_dtype="fp8_e4m3")
    assert fp8.engine.kv_pool.tensor.dtype == FP8
    assert fp8.engine.kv_pool.num_blocks // 4 == fp32.engine.kv_pool.num_blocks  # 1,365 against 341
    assert fp8.engine.kv_pool.nbytes() <= 4 * 2**20


def test_host_and_disk_tiers_round_trip_fp8_blocks(tiny_model_dir, tiny_hf_model, tmp_path):
    """Blocks evicted to the host and disk tiers come back bit for bit: outputs unchanged, hits from there."""
    llm = make_llm(tiny_model_dir, kernels="torch", num_blocks=24, block_size=4, host_cache="4KiB",
                   disk_cache=str(tmp_path / "d"))
    sources: dict[str, int] = {}
    for _ in range(2):
        for prompt in random_prompts(3, 30, 34, seed=9):
            llm.engine.tiers.policy.flush()
            output = llm.generate([prompt], GREEDY)[0]
            assert output.token_ids == hf_greedy_fp8_cache(tiny_hf_model, prompt, MAX_NEW)
            for source, tokens in output.cached_tokens_by_source.items():
                sources[source] = sources.get(source, 0) + tokens
    assert sources.get("host", 0) + sources.get("disk", 0) > 0, sources
    llm.engine.close()


def test_disk_blocks_not_shared_with_a_bf16_engine(tiny_model_dir, tmp_path):
    prompt = random_prompts(1, 41, 41, seed=11)[0]
    first = LLM(str(tiny_model_dir), progress=False, num_blocks=24, block_size=4, kv_cache_dtype="bfloat16",
                disk_cache=str(tmp_path / "d"))
    first.generate([prompt], GREEDY)
    first.engine.tiers.policy.flush()
    first.engine.close()
    second = make_llm(tiny_model_dir, num_blocks=24, block_size=4, disk_cache=str(tmp_path / "d"))
    assert not second.generate([prompt], GREEDY)[0].cached_tokens_by_source.get("disk")
    second.engine.close()


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
    subnormals, saturation at 448 (infinities too), head sizes with a scalar tail (48: 16 + 8 on AVX-512)."""
    gen = torch.Generator().manual_seed(3)
    for heads, kv_heads, head_dim in ((4, 2, 48), (3, 1, 64), (2, 2, 16)):
        rows, num_slots = 37, 64
        qkv = fp8_cases(rows * (heads + 2 * kv_heads) * head_dim, gen).view(rows, -1)
        positions = torch.randint(0, 100, (rows,), generator=gen)
        angles = torch.rand(100, head_dim, generator=gen) * 6.3
        cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
        slots = torch.randperm(num_slots, generator=gen)[:rows]
        pools = [torch.zeros(2, num_slots // 4, 4, kv_heads, head_dim, dtype=FP8) for _ in range(2)]
        native_q = kernels.native.rope_kv_write(qkv, heads, kv_heads, positions, cos, sin, pools[0][0], pools[0][1],
                                                slots)
        twin_q = reference.rope_kv_write(qkv, heads, kv_heads, positions, cos, sin, pools[1][0], pools[1][1], slots)
        finite = torch.isfinite(native_q)  # inf - inf in RoPE: NaNs whose sign is arbitrary
        assert torch.equal(native_q[finite], twin_q.view_as(native_q)[finite])
        keys, twin_keys = pools[0][0].view(torch.uint8), pools[1][0].view(torch.uint8)
        nan = (keys & 0x7F) == 0x7F
        assert torch.equal(keys[~nan], twin_keys[~nan]) and torch.equal(nan, (twin_keys & 0x7F) == 0x7F)
        assert torch.equal(pools[0][1].view(torch.uint8), pools[1][1].view(torch.uint8))  # values: no arithmetic


@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim"), [
    (16, 3, 3, 64), (1, 1, 4, 32), (5, 2, 2, 16), (32, 2, 1, 48), (8, 2, 4, 128), (3, 2, 2, 32), (16, 1, 5, 64)])
def test_attention_kernels_read_fp8_as_the_widened_values(kernels, block_size, kv_heads, group, head_dim):
    """Decode, prefill and cascade attention over an fp8 pool give bit for bit what they give over a float32
    pool of the widened values (every byte up to 7.5 among them, subnormals included) -- decode scores by KV
    head over a narrow pool (G 1-4, csrc/decode_attention.h's da_scores_group), query by query over float32 --
    and match the twin; where
    AMX-BF16 tiles run the prefill products (the fp8 rows widened to bf16, exactly), within summation order."""
    width = 16 if kernels.isa == "avx512" else 8
    if head_dim % width:
        pytest.skip(f"head_dim {head_dim} is not a multiple of the {kernels.isa} vector")
    gen = torch.Generator().manual_seed(block_size * 31 + head_dim)
    lens = torch.tensor([1, block_size * 3 + 1, 7, 40, 2 * block_size])
    width_blocks = int(-(-lens.max() // block_size))
    num_blocks, heads = 5 * width_blocks + 8, kv_heads * group
    pools = []
    for _ in range(2):
        shape = (num_blocks, block_size, kv_heads, head_dim)  # bytes up to 0x4F (7.5): subnormals included
        raw = torch.randint(0, 0x50, shape, generator=gen, dtype=torch.uint8) | (
            torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8) << 7)
        pools.append((raw.view(FP8), raw.view(FP8).float()))
    (keys, keys32), (values, values32) = pools
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
