"""`--prefill-dtype bfloat16`: prefill rows' matmuls as bf16 x bf16 products (csrc/gemm_bf16.h on AMX-BF16 tiles,
kernels/bf16pack.py), against the torch twin `reference.linear_bf16` (both operands rounded to bf16, products
summed in float32) -- equal up to summation order -- and shown to round (far from the float32 matmul).

The kernel and native-engine tests need AMX-BF16 and skip elsewhere; the twin, the packing, the row split and
the configuration run everywhere.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import avx512_with, random_prompts
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.kv_tiers import arithmetic_config
from kvserve.kernels import bf16pack, reference
from kvserve.kernels.ops import Kernels
from test_layer_loop import quantized_tiny_llama, run_steps

AMX = pytest.mark.skipif(not avx512_with("amx_bf16"), reason="this CPU has no AMX-BF16 (or no AVX-512 build)")
SETTINGS = settings(max_examples=40, deadline=None)


@pytest.fixture(scope="module")
def bf16_kernels() -> Kernels:
    return Kernels.create("native", isa="avx512", prefill_dtype="bfloat16")


@settings(max_examples=30, deadline=None)
@given(out=st.integers(1, 80), blocks=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_pack_keeps_every_rounded_weight_and_pads_with_zeros(out, blocks, seed):
    dense = torch.randn(out, 32 * blocks, generator=torch.Generator().manual_seed(seed))
    packed = bf16pack.pack(dense)
    assert torch.equal(bf16pack.unpack(packed), dense.bfloat16())
    assert packed.data.shape[0] * 16 % bf16pack.PANEL == 0
    padded = packed.data.permute(0, 3, 1, 2, 4).reshape(-1, 32 * blocks)
    assert not padded[out:].any()


def test_pack_refuses_widths_the_tiles_cannot_take():
    with pytest.raises(ValueError, match="divisible by 32"):
        bf16pack.pack(torch.zeros(4, 48))


def test_the_twin_rounds_both_operands():
    x, w = torch.randn(8, 64), torch.randn(5, 64)
    twin = reference.linear_bf16(x, w)
    assert torch.equal(twin, x.bfloat16().float() @ w.bfloat16().float().T)
    assert (twin - x @ w.T).abs().max() > 1e-3


@AMX
@SETTINGS
@given(rows=st.one_of(st.integers(1, 300), st.integers(513, 600)), blocks=st.sampled_from([1, 2, 3, 18]),
       out=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_tiles_equal_the_twin(bf16_kernels, rows, blocks, out, seed):
    """Odd row and column counts (tiles padded with zeros, stored through a mask), one to 18 k blocks, up to 512
    rows (threads split the panels) and more (threads split the row pairs): the twin's value up to float32
    summation order, and several times closer to it than to the float32 matmul."""
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, 32 * blocks, generator=gen), torch.randn(out, 32 * blocks, generator=gen)
    tiles = bf16pack.gemm(bf16_kernels.native, x, bf16pack.pack(w))
    twin = reference.linear_bf16(x, w)
    scale = twin.abs().max()
    assert (tiles - twin).abs().max() <= 1e-5 * scale
    if blocks * 32 >= 64:  # enough terms that rounding both operands shows
        assert (tiles - x @ w.T).abs().max() > 10 * (tiles - twin).abs().max()


@AMX
@settings(max_examples=20, deadline=None)
@given(rows=st.one_of(st.integers(1, 300), st.integers(513, 600)), blocks=st.sampled_from([1, 2, 18]),
       tiles=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_fused_swiglu_equals_the_product_then_swiglu(bf16_kernels, rows, blocks, tiles, seed):
    """gate_up fused with SwiGLU (the layer loop's prefill rows): bit for bit the product, then the native
    swiglu, for any row count (both thread splits); odd intermediate sizes are refused."""
    gen = torch.Generator().manual_seed(seed)
    intermediate = 16 * tiles
    x, w = torch.randn(rows, 32 * blocks, generator=gen), torch.randn(2 * intermediate, 32 * blocks, generator=gen)
    packed, native = bf16pack.pack(w), bf16_kernels.native
    fused = bf16pack.gemm(native, x, packed, swiglu=True)
    assert torch.equal(fused, native.swiglu(bf16pack.gemm(native, x, packed)))
    twin = reference.swiglu(reference.linear_bf16(x, w))  # summation order only: <= 8.8e-7 of the scale in 300
    assert (fused - twin).abs().max() <= 1e-5 * twin.abs().max()  # draws, where float32 products are 1e-3+ away
    with pytest.raises(ValueError, match="multiple of 16"):
        bf16pack.gemm(native, x, bf16pack.pack(torch.randn(2 * intermediate + 2, 32 * blocks)), swiglu=True)


@AMX
@pytest.mark.parametrize("rows", [40, 300, 1000])
def test_both_thread_splits_give_the_same_bits(bf16_kernels, rows):
    """Each output's sum runs over k in the same block order whichever way the threads split the work: the
    same rows give the same bits alone (1 thread: panel order) as among many (2+ threads: their panels up to 512
    rows, row pairs above)."""
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=gen), torch.randn(200, 576, generator=gen)
    packed, native = bf16pack.pack(w), bf16_kernels.native
    whole = bf16pack.gemm(native, x, packed)
    assert torch.equal(whole[:16], bf16pack.gemm(native, x[:16].contiguous(), packed))
    threads = torch.get_num_threads()
    native.lib.kv_set_num_threads(1)
    try:
        assert torch.equal(whole, bf16pack.gemm(native, x, packed))
    finally:
        native.lib.kv_set_num_threads(threads)


@AMX
def test_tiles_refuse_when_switched_off(bf16_kernels):
    native = bf16_kernels.native
    assert native.lib.kv_bf16_gemm(0) == 0
    try:
        with pytest.raises(ValueError, match="AMX-BF16"):
            bf16pack.gemm(native, torch.randn(4, 32), bf16pack.pack(torch.randn(3, 32)))
    finally:
        assert native.lib.kv_bf16_gemm(1) == 1


def test_prefill_rows_split_from_decode_rows(tiny_model_dir):
    """The Python loop's split: rows before it (decodes) in the configured arithmetic, rows from it on (the
    prefill chunks') through the bf16 twin; with no split, every row as before."""
    kernels = Kernels.create("torch", prefill_dtype="bfloat16")
    model = quantized_tiny_llama(tiny_model_dir, kernels)
    layer, x = model.layers[0], torch.randn(7, model.config.hidden_size)
    split = model._linear(x, layer, "gate_up_proj", 3)
    assert torch.equal(split[:3], kernels.linear(x[:3], layer.gate_up_proj))
    expected_tail = reference.linear_bf16(x[3:], reference.dequantize(layer.gate_up_proj))
    assert torch.equal(split[3:], expected_tail)
    assert torch.equal(model._linear(x, layer, "gate_up_proj", None), kernels.linear(x, layer.gate_up_proj))


@AMX
@pytest.mark.parametrize("activation_quant", ["none", "int8"])
def test_layer_loop_matches_python_loop_and_twin(tiny_model_dir, activation_quant, monkeypatch):
    """Mixed steps (a prefill beside earlier prompts' decodes) on the quantized tiny Llama: the C layer loop's
    logits equal the Python loop's on the same kernels bit for bit -- the loop's norms and SwiGLU write the
    spans' rows straight into bf16 tiles, where the Python loop rounds float32 rows (spans of 1 to 200 rows:
    padded tiles, both thread splits) -- track the torch twin, and differ from float32 prefill."""
    from kvserve.model.layer_loop import LayerLoop

    def model(**modes):
        kernels = Kernels.create("native", isa="avx512", activation_quant=activation_quant, **modes)
        return quantized_tiny_llama(tiny_model_dir, kernels)

    calls = []
    original = LayerLoop.forward
    monkeypatch.setattr(LayerLoop, "forward", lambda self, *args: calls.append(1) or original(self, *args))
    prompts = [[5, 9, 200, 31, 7], list(range(3, 12)), list(range(40, 100)), [11], list(range(1, 201))]
    bf16_model = model(prefill_dtype="bfloat16")
    native = run_steps(bf16_model, prompts, 16, steps=3)
    assert len(calls) == 8
    loop, bf16_model.layer_loop = bf16_model.layer_loop, None
    python = run_steps(bf16_model, prompts, 16, steps=3)
    twin_kernels = Kernels.create("torch", activation_quant=activation_quant, prefill_dtype="bfloat16")
    twin = run_steps(quantized_tiny_llama(tiny_model_dir, twin_kernels), prompts, 16, steps=3)
    float32 = run_steps(model(), prompts, 16, steps=3)
    together = run_steps(bf16_model, prompts, 16, steps=1, together=3)  # three prefill spans in one step
    bf16_model.layer_loop, before = loop, len(calls)
    assert all(torch.equal(a, b) for a, b in zip(run_steps(bf16_model, prompts, 16, steps=1, together=3), together,
                                                 strict=True))
    assert len(calls) == before + 4  # the loop ran those steps
    gaps = []
    for ours, theirs, oracle, plain in zip(native, python, twin, float32, strict=True):
        scale = theirs.abs().max()
        assert torch.equal(ours, theirs), float((ours - theirs).abs().max() / scale)
        assert (ours - oracle).abs().max() <= 2e-2 * scale
        gaps.append(float((ours - plain).abs().max() / scale))
    assert max(gaps) > 1e-3  # the prefill rows really run in bf16


def test_config_refuses_bad_values_and_speculation():
    with pytest.raises(ValueError, match="prefill_dtype must be one of"):
        EngineConfig(prefill_dtype="float16")
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineConfig(prefill_dtype="bfloat16", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    EngineConfig(prefill_dtype="bfloat16")


def test_native_without_the_tiles_is_refused(monkeypatch):
    """Where the tiles are missing the native backend says so instead of running slowly or falling back."""
    monkeypatch.setattr(bf16pack, "enable", lambda native: False)
    native = Kernels.create("native")
    if native.native is None:
        pytest.skip("native kernels unavailable")
    with pytest.raises(ValueError, match="AMX-BF16 tiles"):
        Kernels.create("native", prefill_dtype="bfloat16")


def test_tiers_never_mix_prefill_dtypes(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=64, kernels="torch")
    model_config = llm.engine.model_config
    plain, bf16 = EngineConfig(), EngineConfig(prefill_dtype="bfloat16")
    assert arithmetic_config(plain, model_config) != arithmetic_config(bf16, model_config)
    assert "prefill_dtype" not in arithmetic_config(plain, model_config)  # default fingerprints unchanged


def _engine_backends() -> list[str]:
    return ["torch", "native"] if avx512_with("amx_bf16") else ["torch"]


@pytest.mark.parametrize("kernels_name", _engine_backends())
def test_engine_cache_hits_and_chunking_do_not_change_outputs(tiny_model_dir, kernels_name):
    """Prompts continuing a cached prefix, or prefilled in small chunks, get what they get computed fresh in
    one chunk: each prompt token runs in bf16 whichever chunk carries it."""
    shared = random_prompts(1, 70, 70, seed=8)[0]
    prompts = [shared + tail for tail in random_prompts(3, 5, 30, seed=9)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    args = dict(progress=False, num_blocks=256, kernels=kernels_name, prefill_dtype="bfloat16")
    fresh = LLM(str(tiny_model_dir), prefix_cache="off", **args).generate(prompts, params)
    chunked = LLM(str(tiny_model_dir), prefix_cache="off", max_num_batched_tokens=16, **args).generate(prompts, params)
    cached_llm = LLM(str(tiny_model_dir), **args)
    cached = [cached_llm.generate([prompt], params)[0] for prompt in prompts]
    assert cached_llm.stats()["prefix_cache_hits_device"] >= 2 * 64
    for a, b, c in zip(fresh, cached, chunked, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        for x, y, z in zip(a.logprobs, b.logprobs, c.logprobs, strict=True):
            assert abs(x.top[0][1] - y.top[0][1]) < 1e-3 and abs(x.top[0][1] - z.top[0][1]) < 1e-3


@AMX
def test_engine_native_tracks_the_twin(tiny_model_dir):
    """Teacher-forced next-token log-probabilities after each prompt: the tiles within 0.03 of the torch twin,
    float32 prefill further away."""
    requests = random_prompts(12, 20, 120, seed=10)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)

    def top(**args):
        llm = LLM(str(tiny_model_dir), progress=False, num_blocks=256, prefix_cache="off", **args)
        return torch.tensor([[v for _, v in out.logprobs[0].top] for out in llm.generate(requests, params)])

    native = top(kernels="native", prefill_dtype="bfloat16")
    twin = top(kernels="torch", prefill_dtype="bfloat16")
    float32 = top(kernels="native")
    assert (native - twin).abs().max() < 0.03
    assert (float32 - twin).abs().max() > 2 * (native - twin).abs().max()


def test_lora_steps_take_the_split_too(tiny_model_dir, tmp_path):
    """Steps with an adapter run the Python loop, which splits prefill rows off as the C loop does (the adapter's
    update added after the bf16 product): the native kernels give the torch twin's tokens, with and without it."""
    from kvserve import LoRARequest
    from lora_util import make_peft_adapter

    make_peft_adapter(tiny_model_dir, tmp_path / "adapter", seed=3)
    adapter = LoRARequest("a", 1, str(tmp_path / "adapter"))
    prompt, params = [[5, 6, 7, 8, 9] * 10], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = {}
    for kernels_name in _engine_backends():
        llm = LLM(str(tiny_model_dir), progress=False, num_blocks=128, kernels=kernels_name,
                  prefill_dtype="bfloat16", enable_lora=True)
        runs[kernels_name] = [llm.generate(prompt, params, lora_request=lora)[0].token_ids for lora in (adapter, None)]
    assert runs["torch"][0] != runs["torch"][1]  # the adapter changes the answer
    assert runs.get("native", runs["torch"]) == runs["torch"]
