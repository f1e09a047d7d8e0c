"""LoRA equivalence: kvserve's greedy output under PEFT adapters equals transformers + peft in fp32.

Alone and in one batch mixing three adapters (different ranks, targets, rslora) and the base model;
also with fewer slots than adapters (LRU swaps, the step split into parts).
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_pool_drained, hf_greedy, random_prompts
from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.lora.sgmv import add_lora, group_rows, lora_delta_reference
from lora_util import load_peft_model, make_peft_adapter

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_peft_adapter(tiny_model_dir, root / "a", seed=1, rank=8, alpha=16),
        "b": make_peft_adapter(tiny_model_dir, root / "b", seed=2, rank=4, alpha=8, targets=("q_proj", "v_proj")),
        "c": make_peft_adapter(
            tiny_model_dir, root / "c", seed=3, rank=16, alpha=4, use_rslora=True,
            targets=("k_proj", "o_proj", "gate_proj", "down_proj"),
        ),
    }


@pytest.fixture(scope="module")
def oracle(tiny_model_dir, tiny_hf_model, adapters):
    """name (or None) -> greedy continuation function of transformers (+ peft)."""
    models = {name: load_peft_model(tiny_model_dir, path) for name, path in adapters.items()}
    models[None] = tiny_hf_model
    return lambda name, prompt: hf_greedy(models[name], prompt, MAX_TOKENS)


def _llm(tiny_model_dir, **kwargs) -> LLM:
    return LLM(str(tiny_model_dir), progress=False, num_blocks=128, block_size=4, enable_lora=True,
               max_lora_rank=16, **kwargs)


def _lora(adapters, name):
    return None if name is None else LoRARequest(name, ord(name), str(adapters[name]))


def test_sgmv_matches_per_row_reference():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(11, 6, generator=generator)
    a, b = torch.randn(3, 6, 4, generator=generator), torch.randn(3, 4, 5, generator=generator)
    row_slots = torch.tensor([2, -1, 0, 2, 2, -1, 1, 0, -1, 2, 1])
    out = torch.zeros(11, 5)
    add_lora(out, x, group_rows(row_slots), a, b)
    torch.testing.assert_close(out, lora_delta_reference(x, row_slots, a, b))
    assert out[1].abs().sum() == 0 and out[0].abs().sum() > 0
    single = torch.full((11,), 1)  # one adapter for every row: the fused path
    out = torch.zeros(11, 5)
    add_lora(out, x, group_rows(single), a, b)
    torch.testing.assert_close(out, lora_delta_reference(x, single, a, b))


def test_each_adapter_alone_matches_peft(tiny_model_dir, adapters, oracle):
    llm = _llm(tiny_model_dir)
    prompt = random_prompts(1, 9, 9, seed=5)[0]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    base = llm.generate([prompt], params)[0].token_ids
    assert base == oracle(None, prompt)
    for name in adapters:
        got = llm.generate([prompt], params, lora_request=_lora(adapters, name))[0].token_ids
        assert got == oracle(name, prompt), name
        assert got != base, f"adapter {name} changed nothing: the test could not fail"
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize("max_loras", [4, 2])
def test_mixed_batch_of_three_adapters_and_base_matches_peft(tiny_model_dir, adapters, oracle, max_loras):
    llm = _llm(tiny_model_dir, max_loras=max_loras)
    prompts = random_prompts(8, 3, 14, seed=7)
    names = [None, "a", "b", "c", "a", None, "c", "b"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=[_lora(adapters, n) for n in names])
    for prompt, name, output in zip(prompts, names, outputs, strict=True):
        assert output.token_ids == oracle(name, prompt), name
    if max_loras == 2:
        assert llm.engine.lora.num_swaps > 3  # three adapters through two slots: swapped in and out
    assert_pool_drained(llm.engine)
