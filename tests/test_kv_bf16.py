"""A bf16 KV cache (`--kv-cache-dtype bfloat16`): half the bytes per token under float32 arithmetic.

The oracle is transformers with a cache that rounds every key and value to bf16 as it stores them, which is
what the pool holds; attention then reads those rounded values whether they were computed in this step,
cached by an earlier request or loaded from a tier. The torch kernels run the oracle's arithmetic: their
greedy tokens equal it, batched, chunked, cached. The native kernels write the pool with the same rounding
as torch's (bit for bit) and read a bf16 pool exactly as the same values widened to float32; end to end they
differ from the oracle by summation order *before* the rounding, and a key that lands on the other side of a
bf16 rounding boundary moves by 2^-8 of itself (9 of 9,600 pool values for a 50-token prompt here), so their
check is on log-probabilities, teacher-forced: within 0.03 of the twin's, where float32 KV is 0.2 away.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import assert_pool_drained, hf_greedy, on_then_off, random_prompts
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.kernels import reference
from kvserve.kv.cascade import plan_cascade

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


class BF16Cache(DynamicCache):
    """transformers' cache, storing (and returning to attention) keys and values rounded to bf16."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rounded = (state.to(torch.bfloat16).to(state.dtype) for state in (key_states, value_states))
        return super().update(*rounded, layer_idx, *args, **kwargs)


def hf_greedy_bf16_cache(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    return hf_greedy(model, prompt_ids, max_new_tokens, cache=BF16Cache())


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(8, 3, 90, seed=1)


@pytest.fixture(scope="module")
def reference_bf16(tiny_hf_model, prompts) -> list[list[int]]:
    return [hf_greedy_bf16_cache(tiny_hf_model, p, MAX_NEW) for p in prompts]


def make_llm(model_dir, **engine_args) -> LLM:
    engine_args.setdefault("num_blocks", 256)
    return LLM(str(model_dir), progress=False, kv_cache_dtype="bfloat16", **engine_args)


# --- engine outputs ---------------------------------------------------------------------------------


def test_oracle_tells_bf16_from_float32(tiny_hf_model, prompts, reference_bf16):
    """The rounding matters on this model (else the tests below could not tell a bf16 cache from fp32)."""
    pairs = zip(prompts, reference_bf16, strict=True)
    assert any(hf_greedy(tiny_hf_model, p, MAX_NEW) != expected for p, expected in pairs)


@pytest.mark.parametrize("prefix_cache", ["radix", "hash", "off"])
def test_batched_greedy_equals_transformers_with_a_bf16_cache(tiny_model_dir, prompts, reference_bf16, prefix_cache):
    llm = make_llm(tiny_model_dir, kernels="torch", prefix_cache=prefix_cache)
    assert llm.engine.kv_pool.tensor.dtype == torch.bfloat16
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference_bf16
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize(("budget", "block_size"), [(5, 16), (33, 1), (16, 4)])
def test_chunked_prefill_and_block_sizes(tiny_model_dir, prompts, reference_bf16, budget, block_size):
    llm = make_llm(tiny_model_dir, kernels="torch", max_num_batched_tokens=budget, block_size=block_size,
                   num_blocks=2048 // block_size)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference_bf16


def test_cache_hits_do_not_change_outputs(tiny_model_dir, tiny_hf_model):
    """A prompt sharing a cached prefix (and the same prompt again) reads the cached bf16 blocks: the same
    tokens as computing everything fresh, which is what the oracle does."""
    shared = random_prompts(1, 40, 40, seed=5)[0]
    prompts = [shared + tail for tail in random_prompts(3, 5, 9, seed=6)]
    llm = make_llm(tiny_model_dir, kernels="torch")
    for prompt in prompts + prompts[:1]:
        output = llm.generate([prompt], GREEDY)[0]
        assert output.token_ids == hf_greedy_bf16_cache(tiny_hf_model, prompt, MAX_NEW)
    assert llm.stats()["prefix_cache_hits_device"] >= 3 * 32


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


def test_the_same_memory_holds_twice_the_blocks(tiny_model_dir):
    fp32 = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="4MiB")
    bf16 = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="4MiB", kv_cache_dtype="bfloat16")
    assert fp32.engine.kv_pool.tensor.dtype == torch.float32
    assert bf16.engine.kv_pool.num_blocks == 2 * fp32.engine.kv_pool.num_blocks
    assert bf16.engine.kv_pool.nbytes() == fp32.engine.kv_pool.nbytes()


def test_host_and_disk_tiers_round_trip_bf16_blocks(tiny_model_dir, tiny_hf_model, tmp_path):
    """Blocks evicted to the host and disk tiers come back bit for bit: outputs unchanged, hits from there."""
    llm = make_llm(tiny_model_dir, num_blocks=24, block_size=4, host_cache="8KiB", disk_cache=str(tmp_path / "d"))
    users = random_prompts(3, 30, 34, seed=9)
    sources: dict[str, int] = {}
    for _ in range(2):
        for prompt in users:
            llm.engine.tiers.policy.flush()
            output = llm.generate([prompt], GREEDY)[0]
            assert output.token_ids == hf_greedy_bf16_cache(tiny_hf_model, prompt, MAX_NEW)
            for source, tokens in output.cached_tokens_by_source.items():
                sources[source] = sources.get(source, 0) + tokens
    assert sources.get("host", 0) + sources.get("disk", 0) > 0, sources
    llm.engine.close()


def test_disk_blocks_not_shared_across_kv_dtypes(tiny_model_dir, tmp_path):
    """A float32 engine's disk blocks are never loaded by a bf16 one (the tiers' fingerprint has the KV
    dtype): the codec would refuse them anyway, and the rounding differs."""
    prompt = random_prompts(1, 41, 41, seed=11)[0]
    first = LLM(str(tiny_model_dir), progress=False, num_blocks=24, block_size=4, disk_cache=str(tmp_path / "d"))
    first.generate([prompt], GREEDY)
    first.engine.tiers.policy.flush()
    first.engine.close()
    second = make_llm(tiny_model_dir, num_blocks=24, block_size=4, disk_cache=str(tmp_path / "d"))
    assert not second.generate([prompt], GREEDY)[0].cached_tokens_by_source.get("disk")
    second.engine.close()


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


def test_rope_kv_write_rounds_as_torch(kernels):
    """The native write rounds keys (after RoPE) and values to nearest even as torch does: the same bits,
    including exact ties, subnormals and head sizes with a scalar tail (48 = 16 + 8 on AVX-512)."""
    gen = torch.Generator().manual_seed(3)
    for heads, kv_heads, head_dim in ((4, 2, 48), (3, 1, 64), (2, 2, 16)):
        rows, num_slots = 37, 64
        qkv = random_bits(rows * (heads + 2 * kv_heads) * head_dim, gen).view(rows, -1)
        positions = torch.randint(0, 100, (rows,), generator=gen)
        angles = torch.rand(100, head_dim, generator=gen) * 6.3
        cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
        slots = torch.randperm(num_slots, generator=gen)[:rows]
        pools = [torch.zeros(2, num_slots // 4, 4, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(2)]
        native_q = kernels.native.rope_kv_write(qkv, heads, kv_heads, positions, cos, sin, pools[0][0], pools[0][1],
                                                slots)
        twin_q = reference.rope_kv_write(qkv, heads, kv_heads, positions, cos, sin, pools[1][0], pools[1][1], slots)
        assert torch.equal(native_q, twin_q.view_as(native_q))
        assert torch.equal(pools[0].view(torch.int16), pools[1].view(torch.int16))


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
    width = 16 if kernels.isa == "avx512" else 8
    if head_dim % width:
        pytest.skip(f"head_dim {head_dim} is not a multiple of the {kernels.isa} vector")
    gen = torch.Generator().manual_seed(block_size * 31 + head_dim)
    lens = torch.tensor([1, block_size * 3 + 1, 7, 40, 2 * block_size])
    width_blocks = int(-(-lens.max() // block_size))
    num_blocks, heads = 5 * width_blocks + 8, kv_heads * group
    keys, keys32 = bf16_pool(gen, num_blocks, block_size, kv_heads, head_dim)
    values, values32 = bf16_pool(gen, num_blocks, block_size, kv_heads, head_dim)
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
    decode = native.paged_attention(queries, keys, values, tables, lens, 0.3)
    assert torch.equal(decode, native.paged_attention(queries, keys32, values32, tables, lens, 0.3))
    torch.testing.assert_close(decode, reference.paged_attention(queries, keys, values, tables, lens, 0.3),
                               rtol=1e-5, atol=1e-5)
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
                                                                  share_lens, 0.3), rtol=1e-5, atol=1e-5)
