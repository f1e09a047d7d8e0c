"""What weights and dtype the engine runs (engine/setup.py `model_weights`), configuration by configuration.

`--dtype bfloat16` on a CPU without native bf16 arithmetic: bf16 weights in memory, fp32 arithmetic.

Emulated bf16 matmuls ran 4-60x slower than fp32 on an AVX2 CPU (BENCHMARKS.md), so there the engine keeps
dense weights as BF16 rows (kernels/quant.py) that the native float kernels widen in registers, with
activations and the KV cache in fp32. The oracle: transformers in fp32 on the same weights rounded to bf16
(every matrix; norms stay fp32, as kvserve keeps them) gives the same greedy tokens. The native-bf16 check is
patched off so the storage path runs on every CPU with the native kernels.

Without the native kernels, GGUF blocks are dequantized once at load instead of at every matmul.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ISAS, hf_greedy, random_prompts
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.kv_tiers import arithmetic_config
from kvserve.engine.setup import model_weights
from kvserve.kernels import reference
from kvserve.kernels.ops import Kernels
from kvserve.kernels.quant import BF16, QuantWeight, bf16_weight

needs_native = pytest.mark.skipif(not ISAS, reason="native kernels unavailable")


@pytest.fixture
def no_native_bf16(monkeypatch):
    monkeypatch.setattr(Kernels, "native_bf16", lambda self: False)


@pytest.fixture(scope="module")
def bf16_hf_model(tiny_model_dir):
    """The tiny model in fp32 with every matrix rounded to bf16 (what kvserve stores)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(param.to(torch.bfloat16).float())
    return model


def test_bf16_weight_round_trips_torch_rounding():
    dense = torch.randn(7, 64, generator=torch.Generator().manual_seed(0)) * 3
    weight = bf16_weight(dense)
    assert (weight.qtype, weight.shape, weight.row_bytes) == (BF16, (7, 64), 128)
    assert torch.equal(reference.dequantize(weight), dense.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="matrix"):
        bf16_weight(torch.ones(64))


@needs_native
@settings(max_examples=25, deadline=None)
@given(rows=st.one_of(st.integers(1, 12), st.integers(13, 300)), out_features=st.integers(1, 70),
       blocks=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_native_bf16_matmuls_match_reference(kernels, rows, out_features, blocks, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = bf16_weight(torch.randn(out_features, blocks * 32, generator=gen))
    x = torch.randn(rows, blocks * 32, generator=gen)
    expected = x @ reference.dequantize(weight).T
    for got in (kernels.native.qmatmul(x, weight.data, BF16, weight.in_features),
                kernels.native.qgemm(x, weight.data, BF16, weight.in_features), kernels.linear(x, weight)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@needs_native
def test_int8_kernel_refuses_bf16_rows(kernels):
    weight = bf16_weight(torch.randn(16, 64))
    with pytest.raises(ValueError, match="unsupported quantization type"):
        kernels.native.qmatmul_i8(torch.randn(2, 64), weight.data, BF16, 64)


@needs_native
def test_storage_only_where_bf16_is_not_native(no_native_bf16):
    native = Kernels.create("native")
    assert native.stores_bf16("bfloat16", "cpu")
    assert not native.stores_bf16("float32", "cpu")
    assert not Kernels.create("torch").stores_bf16("bfloat16", "cpu")  # torch's own bf16, emulated


@needs_native
def test_quantized_weights_store_bf16_on_every_cpu(monkeypatch):
    """With native (quantized) weights bf16 is storage on a CPU with native bf16 too (torch's bf16 decoded 4.4x
    slower there); dense weights on such a CPU keep torch's bf16 arithmetic (its AMX GEMMs prefill faster)."""
    monkeypatch.setattr(Kernels, "native_bf16", lambda self: True)
    native = Kernels.create("native")
    assert native.stores_bf16("bfloat16", "cpu", "native")
    assert not native.stores_bf16("bfloat16", "cpu", "dense")
    assert not native.stores_bf16("float32", "cpu", "native")


@needs_native
def test_engine_stores_bf16_and_matches_transformers_on_rounded_weights(tiny_model_dir, bf16_hf_model,
                                                                        no_native_bf16):
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", num_blocks=64, block_size=4, max_num_batched_tokens=24,
              progress=False)
    model = llm.engine.model
    assert model.dtype == torch.float32 and llm.engine.kv_pool.tensor.dtype == torch.float32
    layer = model.layers[0]
    for weight in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj, model.embed_tokens):
        assert isinstance(weight, QuantWeight) and weight.qtype == BF16
    assert model.layer_loop is not None  # the C layer loop runs the bf16 rows
    prompts = random_prompts(5, 3, 40, seed=3)  # chunked (24-token budget), batched, a few blocks each
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == hf_greedy(bf16_hf_model, prompt, 8)


@needs_native
def test_bf16_storage_has_its_own_tier_fingerprint(tiny_model_dir, no_native_bf16):
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", num_blocks=16, block_size=4, progress=False)
    config, model_config = llm.engine.config, llm.engine.model_config
    assert arithmetic_config(config, model_config, True) != arithmetic_config(config, model_config, False)
    assert arithmetic_config(config, model_config) == arithmetic_config(config, model_config, False)


def test_torch_kernels_dequantize_blocks_once_at_load():
    from test_kernels import random_quant

    blocks = random_quant(8, 64, 3, seed=1)
    weights = {"m": blocks, "norm": torch.ones(64)}
    dtype, held, rounded = model_weights(Kernels.create("torch"), EngineConfig(model="x"), weights)
    assert (dtype, rounded) == (torch.float32, False)
    assert isinstance(held["m"], torch.Tensor) and torch.equal(held["m"], reference.dequantize(blocks))
    assert held["norm"] is weights["norm"]
    int8 = EngineConfig(model="x", activation_quant="int8")
    _, kept, _ = model_weights(Kernels.create("torch", activation_quant="int8"), int8, weights)
    assert kept["m"] is blocks  # the int8 path's torch twin reads the blocks
