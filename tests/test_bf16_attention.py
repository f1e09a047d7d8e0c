"""bf16 attention products (`--attention-dtype bfloat16`, csrc/prefill.h's ATTN_BF16) over a bf16 KV pool.

Prefill and shared-prefix attention round the scaled queries and the unnormalised probabilities to bf16 and
sum the (exact) products in float32: AVX512-BF16 pair dot products where the CPU has them, float32 FMAs on
the same rounded values elsewhere (the AVX2 build, or a CPU without them). The oracle is
`reference.paged_attention(..., bf16_products=True)`; it rounds the probabilities against the row's max where
the kernel rounds against its running max (moved lazily: prefill.h's pf_lazy_max), so the check is a
tolerance -- and, to show the rounding really happens, that the kernel sits several times closer to the bf16
oracle than to the float32 one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import avx512_with, on_then_off, random_prompts
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.kv_tiers import arithmetic_config
from kvserve.kernels import pair_products, reference
from kvserve.kernels.crossover import cpu_identity
from kvserve.kernels.ops import Kernels
from kvserve.kv.cascade import plan_cascade
from test_cascade_attention import CASE, draw_case, padded

SETTINGS = settings(max_examples=25, deadline=None)
AMX_SPAN = dict(block_size=st.sampled_from([1, 5, 16, 32]), kv_heads=st.integers(1, 3),
                group=st.sampled_from([1, 3, 4]), head_dim=st.sampled_from([32, 64, 128]),
                cached=st.integers(0, 200), tokens=st.integers(1, 70),
                seed=st.integers(0, 2**16))  # the AMX tests' spans: head dims the tiles take
TOLERANCE = dict(rtol=2e-2, atol=2e-2)


def bf16_pool(gen: torch.Generator, num_blocks: int, block_size: int, kv_heads: int, head_dim: int):
    return tuple(torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16() for _ in range(2))


def one_span(gen: torch.Generator, cached: int, tokens: int, block_size: int, kv_heads: int, group: int,
             head_dim: int):
    context = cached + tokens
    width = -(-context // block_size)
    keys, values = bf16_pool(gen, width + 2, block_size, kv_heads, head_dim)
    table = torch.randperm(width + 2, generator=gen)[:width].view(1, -1)
    queries = torch.randn(tokens, kv_heads * group, head_dim, generator=gen)
    return queries, keys, values, torch.tensor([[0, tokens, context]]), table


def expected(queries, keys, values, spans, table, scale, bf16_products):
    _, tokens, context = spans[0].tolist()
    lens = torch.arange(context - tokens + 1, context + 1)
    return reference.paged_attention(queries, keys, values, table.expand(tokens, -1), lens, scale, bf16_products)


@SETTINGS
@given(block_size=st.sampled_from([1, 4, 16, 32]), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4]),
       head_dim=st.sampled_from([16, 64]), cached=st.integers(0, 140), tokens=st.integers(1, 80),
       seed=st.integers(0, 2**16))
def test_prefill_matches_the_bf16_oracle(kernels, block_size, kv_heads, group, head_dim, cached, tokens, seed):
    """Odd key counts (a last key paired with zero), single keys, GQA groups, both builds."""
    case = one_span(torch.Generator().manual_seed(seed), cached, tokens, block_size, kv_heads, group, head_dim)
    native = kernels.native.prefill_attention(*case, 0.3, bf16_products=True)
    torch.testing.assert_close(native, expected(*case, 0.3, True), **TOLERANCE)


@pytest.mark.parametrize("cached, tokens", [(0, 64), (30, 34), (50, 1)])
def test_prefill_rounds_what_the_oracle_rounds(kernels, cached, tokens):
    """Within one 64-key step the kernel's running max is the row's max, so it rounds exactly the oracle's
    operands: equal up to summation order, where the float32 products are ~1e-3 away (~4e-4 on average).
    Summation order (the kernel's, or torch's, which differs by CPU) now and then tips a probability to its
    neighbouring bf16: 0.2% of outputs moved by up to 4e-5 on an AMX Xeon (none on a Zen 4), so the bound on
    the largest difference is 1e-4 and the average, ~7e-8, is what shows the rounding is the oracle's."""
    case = one_span(torch.Generator().manual_seed(3), cached, tokens, 16, 3, 3, 64)
    native = kernels.native.prefill_attention(*case, 0.125, bf16_products=True)
    torch.testing.assert_close(native, expected(*case, 0.125, True), rtol=1e-4, atol=1e-4)
    assert (native - expected(*case, 0.125, True)).abs().mean() < 1e-6
    assert (native - expected(*case, 0.125, False)).abs().mean() > 1e-4


@pytest.fixture
def pairs_kernels():
    """The AVX-512 kernels with the pair products on and the AMX tiles off (whatever this CPU's choice), both
    restored afterwards; skipped without AVX512-BF16."""
    emulated = Kernels.create("native", isa="avx2")  # loading applies this CPU's choices: switch after it
    fast = Kernels.create("native", isa="avx512")
    if fast.isa != "avx512" or not pair_products.set_pairs(fast.native, True):
        pytest.skip("this CPU has no AVX512-BF16: only the emulation runs here (the other tests cover it)")
    tiles = fast.native.amx_exact
    fast.native.set_amx_exact(False)
    yield fast, emulated
    fast.native.set_amx_exact(tiles)
    pair_products.apply(fast.native)


def test_pair_products_equal_the_emulation(pairs_kernels):
    """AVX512-BF16's vdpbf16ps and the AVX2 build's FMAs multiply the same rounded queries and keys; their sums'
    order differs, so now and then a probability rounds to the neighbouring bf16 (~7e-5 here, 0.1% of outputs),
    where the float32 products are ~1e-3 away. The AVX-512 build's own FMA route (the choice where the pairs
    are slower) gives the emulation's products too."""
    fast, emulated = pairs_kernels
    assert not fast.native.amx_exact  # the pairs, not the tiles, run below
    case = one_span(torch.Generator().manual_seed(4), 130, 77, 16, 3, 3, 64)
    pairs, fmas = on_then_off(lambda on: pair_products.set_pairs(fast.native, on),
                              lambda: fast.native.prefill_attention(*case, 0.125, bf16_products=True))
    reference_run = emulated.native.prefill_attention(*case, 0.125, bf16_products=True)
    torch.testing.assert_close(pairs, reference_run, rtol=0, atol=3e-4)
    torch.testing.assert_close(fmas, reference_run, rtol=0, atol=3e-4)
    assert not torch.equal(pairs, fmas)  # two routes: vdpbf16ps sums pairs before adding them
    assert (pairs - fast.native.prefill_attention(*case, 0.125)).abs().max() > 1e-3


def test_the_pair_products_are_chosen_per_cpu():
    """Measured slower on Intel (vdpbf16ps issues once a cycle there), faster on Zen 4: the library loads with
    this CPU's choice, and the switch does nothing on a CPU without AVX512-BF16."""
    assert not pair_products.pairs_pay(("GenuineIntel", 6)) and pair_products.pairs_pay(("AuthenticAMD", 25))
    native = Kernels.create("native").native
    if native is None:
        pytest.skip("native kernels unavailable")
    expected_now = "avx512_bf16" in native.features and pair_products.pairs_pay(cpu_identity())
    assert bool(native.lib.kv_bf16_pairs(-1) > 0) == expected_now


def test_a_float32_pool_is_refused(kernels):
    queries, keys, values, spans, table = one_span(torch.Generator().manual_seed(5), 10, 5, 16, 1, 2, 16)
    with pytest.raises(ValueError, match="bfloat16 KV pool"):
        kernels.native.prefill_attention(queries, keys.float(), values.float(), spans, table, 0.1, bf16_products=True)


@SETTINGS
@given(**CASE)
def test_cascade_shared_parts_match_the_bf16_twin(kernels, block_size, kv_heads, group, head_dim, groups, seed):
    case = bf16_cascade_case(block_size, kv_heads, group, head_dim, groups, seed)
    if case is None:
        return
    native = kernels.native.cascade_attention(*case, 0.125, True)
    torch.testing.assert_close(native, reference.cascade_attention(*case, 0.125, True), **TOLERANCE)


def bf16_cascade_case(block_size, kv_heads, group, head_dim, groups, seed):
    """(queries, bf16 keys, bf16 values, tables, context lengths, plan) of a drawn cascade case; None when
    nothing is shared enough to plan."""
    tables, lens, keys, values, queries = draw_case(block_size, kv_heads, group, head_dim, groups, seed)
    plan = plan_cascade(tables, lens, block_size, min_rows=1, min_blocks=1)
    if plan is None:
        return None
    return queries, keys.bfloat16(), values.bfloat16(), padded(tables), torch.tensor(lens), plan


# --- engine ------------------------------------------------------------------------------------------


def test_config_needs_a_bf16_cache():
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16'"):
        EngineConfig(attention_dtype="bfloat16")
    with pytest.raises(ValueError, match="attention_dtype must be one of"):
        EngineConfig(attention_dtype="float16", kv_cache_dtype="bfloat16")
    EngineConfig(attention_dtype="bfloat16", kv_cache_dtype="bfloat16")


def test_tiers_never_mix_attention_dtypes(tiny_model_dir):
    """Keys of later layers depend on earlier layers' attention: a shared tier keys blocks by it."""
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=64, kv_cache_dtype="bfloat16")
    model_config = llm.engine.model_config
    base = EngineConfig(kv_cache_dtype="bfloat16")
    bf16 = EngineConfig(kv_cache_dtype="bfloat16", attention_dtype="bfloat16")
    assert arithmetic_config(base, model_config) != arithmetic_config(bf16, model_config)
    assert "attention_dtype" not in arithmetic_config(base, model_config)  # default fingerprints unchanged


@pytest.mark.parametrize("kernels_name", ["native", "torch"])
def test_cache_hits_do_not_change_outputs(tiny_model_dir, kernels_name):
    """A prompt continuing a cached prefix gets the tokens and log-probabilities it gets computed fresh."""
    shared = random_prompts(1, 70, 70, seed=8)[0]
    prompts = [shared + tail for tail in random_prompts(3, 5, 30, seed=9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    args = dict(progress=False, num_blocks=256, kv_cache_dtype="bfloat16", attention_dtype="bfloat16",
                kernels=kernels_name)
    fresh = LLM(str(tiny_model_dir), prefix_cache="off", **args).generate(prompts, params)
    cached_llm = LLM(str(tiny_model_dir), **args)
    cached = [cached_llm.generate([prompt], params)[0] for prompt in prompts]
    assert cached_llm.stats()["prefix_cache_hits_device"] >= 2 * 64
    for a, b in zip(fresh, cached, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.top[0][1] - y.top[0][1]) < 1e-3


def test_native_tracks_the_torch_twin_and_differs_from_float32(tiny_model_dir):
    """Teacher-forced next-token log-probabilities: the native bf16 products within 0.03 of the torch twin's
    (which rounds the same operands: `reference.causal_attention`), float32 products 0.05+ away (measured on
    AVX-512: 0.009 and 0.11)."""
    requests = random_prompts(12, 20, 120, seed=10)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)

    def top(**args):
        llm = LLM(str(tiny_model_dir), progress=False, num_blocks=256, prefix_cache="off", kv_cache_dtype="bfloat16",
                  **args)
        return torch.tensor([[v for _, v in out.logprobs[0].top] for out in llm.generate(requests, params)])

    native = top(kernels="native", attention_dtype="bfloat16")
    twin = top(kernels="torch", attention_dtype="bfloat16")
    float32 = top(kernels="native")
    assert (native - twin).abs().max() < 0.03
    assert (float32 - twin).abs().max() > 0.05


def climbing_span(seed: int, cached: int = 320, tokens: int = 40):
    """A span whose keys grow along the context (x1 at position 0 to x7 at its end), so the scores' running max
    climbs step after step, past the lazy max's margin (ln 256) several times: each route must still agree."""
    queries, keys, values, spans, table = one_span(torch.Generator().manual_seed(seed), cached, tokens, 16, 3, 3, 64)
    context = cached + tokens
    for position in range(context):
        block, offset = int(table[0, position // 16]), position % 16
        keys[block, offset] = (keys[block, offset].float() * (1 + 6 * position / context)).bfloat16()
    return queries, keys, values, spans, table


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_climbing_max_gives_the_oracles_outputs(kernels, seed):
    """Scores that keep rising (the max moves, then holds within its margin while probabilities reach 256):
    bf16 products within the bf16 oracle's tolerance and closer to it than to float32's; float32 products (a
    bf16 pool) the oracle's up to summation order, whichever route this CPU takes (AMX tiles move the max lazily
    too)."""
    case = climbing_span(seed)
    bf16 = kernels.native.prefill_attention(*case, 0.125, bf16_products=True)
    torch.testing.assert_close(bf16, expected(*case, 0.125, True), **TOLERANCE)
    near, far = ((bf16 - expected(*case, 0.125, exact)).abs().mean() for exact in (True, False))
    assert near < far / 3
    float32 = kernels.native.prefill_attention(*case, 0.125)
    torch.testing.assert_close(float32, expected(*case, 0.125, False), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not avx512_with("amx_bf16"), reason="this CPU has no AMX-BF16 (or no AVX-512 build)")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_climbing_max_on_tiles_equals_the_fmas(seed):
    """The AMX tiles and the FMAs they replace keep the same lazy maxima, so over a climbing max they still
    differ only where summation order tips a probability to its neighbouring bf16 (bounded as in
    test_amx_tiles_equal_the_pair_products)."""
    fast = Kernels.create("native", isa="avx512")
    case = climbing_span(seed)
    tiles, fmas = on_then_off(fast.native.set_amx_exact, lambda: fast.native.prefill_attention(
        *case, 0.125, bf16_products=True))
    gap = (tiles - fmas).abs()
    assert gap.max() <= 2**-8 * case[2].float().abs().max()
    assert int((gap.amax(-1) > 1e-5).sum()) <= max(2, 0.05 * gap[..., 0].numel())


@pytest.mark.skipif(not avx512_with("amx_bf16"), reason="this CPU has no AMX-BF16 (or no AVX-512 build)")
@SETTINGS
@given(**AMX_SPAN)
def test_amx_tiles_equal_the_pair_products(block_size, kv_heads, group, head_dim, cached, tokens, seed):
    """csrc/prefill_amx.h (AMX-BF16 tiles, on with the exact GEMM's switch) multiplies the operands the pair
    products do, keys read in place from whole 16-key runs of a block or copied otherwise, odd and partial
    steps padded with zeros: the same outputs up to summation order. That order now and then tips a
    probability p <= 1 to its neighbouring bf16, moving that query's outputs by at most 2^-8 max|v| (the
    softmax's sum is at least 1; 300 random cases: at most 0.16 of that), and only a few queries' (at most 2,
    or 5%; 300 cases: one query of 14 at worst)."""
    described = Kernels.create("native", isa="avx512", attention_dtype="bfloat16").describe()
    assert "bf16 attention products on AMX tiles" in described
    fast = Kernels.create("native", isa="avx512")  # loading applies this CPU's choices: switch after it
    case = one_span(torch.Generator().manual_seed(seed), cached, tokens, block_size, kv_heads, group, head_dim)
    assert pair_products.set_pairs(fast.native, True)
    try:
        tiles, pairs = on_then_off(fast.native.set_amx_exact, lambda: fast.native.prefill_attention(
            *case, 0.125, bf16_products=True))
    finally:
        pair_products.apply(fast.native)
    gap = (tiles - pairs).abs()
    assert gap.max() <= 2**-8 * case[2].float().abs().max()
    differing = int((gap.amax(-1) > 1e-5).sum())
    assert differing <= max(2, 0.05 * gap[..., 0].numel())
    torch.testing.assert_close(tiles, expected(*case, 0.125, True), **TOLERANCE)


@pytest.mark.skipif(not avx512_with("amx_bf16"), reason="this CPU has no AMX-BF16 (or no AVX-512 build)")
@SETTINGS
@given(**AMX_SPAN)
def test_amx_exact_tiles_equal_the_float32_products(block_size, kv_heads, group, head_dim, cached, tokens, seed):
    """Float32 attention over a bf16 pool (the default products) also runs on AMX tiles (PF_EXACT_TILES): each
    scaled query and probability split into three bf16 parts that sum to it exactly, so every product is the
    FMAs' exact float32 product and only the order of the float32 sums differs (200 random cases: 2.5e-6 at
    most, the FMA path itself 2e-6 from the oracle)."""
    fast = Kernels.create("native", isa="avx512")
    case = one_span(torch.Generator().manual_seed(seed), cached, tokens, block_size, kv_heads, group, head_dim)
    tiles, fmas = on_then_off(fast.native.set_amx_exact, lambda: fast.native.prefill_attention(*case, 0.125))
    torch.testing.assert_close(tiles, fmas, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tiles, expected(*case, 0.125, False), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not avx512_with("amx_bf16"), reason="this CPU has no AMX-BF16 (or no AVX-512 build)")
@SETTINGS
@given(**CASE)
def test_cascade_shared_parts_on_exact_tiles(block_size, kv_heads, group, head_dim, groups, seed):
    """Cascade attention's shared parts over a bf16 pool with float32 products take the exact tiles too."""
    fast = Kernels.create("native", isa="avx512")
    case = bf16_cascade_case(block_size, kv_heads, group, head_dim, groups, seed)
    if case is None:
        return
    tiles, fmas = on_then_off(fast.native.set_amx_exact, lambda: fast.native.cascade_attention(*case, 0.125))
    torch.testing.assert_close(tiles, fmas, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tiles, reference.cascade_attention(*case, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not avx512_with("amx_bf16"), reason="this CPU has no AMX-BF16 (or no AVX-512 build)")
@pytest.mark.parametrize("bf16_products", [False, True])
def test_amx_tiles_with_more_query_pairs_than_the_deferral_holds(bf16_products):
    """A task of 32 tokens x G = 66 query heads per KV head has 66 query-tile pairs, more than P x V's deferral
    tracks (prefill_amx.h's PA_MAX_PAIRS): those tasks multiply every step at once and give what the FMAs give,
    over several 64-key steps with the max moving (keys growing along the context)."""
    fast = Kernels.create("native", isa="avx512")
    case = one_span(torch.Generator().manual_seed(5), 150, 40, 16, 1, 66, 32)
    keys = case[1].float()
    ramp = torch.linspace(1, 5, keys.shape[0] * keys.shape[1]).view(keys.shape[0], keys.shape[1], 1, 1)
    case = (case[0], (keys * ramp).bfloat16(), *case[2:])
    tiles, fmas = on_then_off(fast.native.set_amx_exact, lambda: fast.native.prefill_attention(
        *case, 0.125, bf16_products=bf16_products))
    if bf16_products:
        gap = (tiles - fmas).abs()
        assert gap.max() <= 2**-8 * case[2].float().abs().max()
        assert int((gap.amax(-1) > 1e-5).sum()) <= max(2, 0.05 * gap[..., 0].numel())
    else:
        torch.testing.assert_close(tiles, fmas, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tiles, expected(*case, 0.125, bf16_products), **TOLERANCE)
