"""smollm2-135m (GGUF) under PEFT adapters made here: kvserve equals transformers + peft in fp32, greedy.

transformers dequantizes the same GGUF file (`gguf_file=`: conftest's `smollm2_hf`, copied); two adapters
(non-zero B, fixed seeds) and the base model run in one kvserve batch, each checked against peft with that
adapter set.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import assert_pool_drained, hf_greedy
from kvserve import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.model

MAX_NEW = 16
TEXTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time"]
ADAPTERS = {  # name: (seed, rank, targets)
    "attn": (1, 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": (2, 4, ["gate_proj", "up_proj", "down_proj"]),
}


def _peft_model(base, out_dir):
    """The GGUF base (a copy: peft wraps a model in place) wrapped by peft with both adapters (random A and B,
    B scaled to a visible change)."""
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(base)
    for index, (name, (seed, rank, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0,
                            init_lora_weights=False)
        if index == 0:
            model = get_peft_model(model, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.mul_(0.3)
    model.save_pretrained(out_dir)  # one sub-directory per adapter name
    return model.eval()


def test_smollm2_with_adapters_matches_peft(tmp_path, smollm2_hf):
    oracle = _peft_model(smollm2_hf, tmp_path)
    llm = LLM("smollm2-135m", progress=False, num_blocks=256, enable_lora=True, max_lora_rank=8, weights="dense")
    prompts = [llm.tokenizer.encode(text) for text in TEXTS]
    names = ["attn", None, "mlp"]
    loras = [None if n is None else LoRARequest(n, i + 1, str(tmp_path / n)) for i, n in enumerate(names)]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=loras)
    for prompt, name, output in zip(prompts, names, outputs, strict=True):
        if name is None:
            with oracle.disable_adapter():
                assert output.token_ids == hf_greedy(oracle, prompt, MAX_NEW)
            continue
        oracle.set_adapter(name)
        assert output.token_ids == hf_greedy(oracle, prompt, MAX_NEW), name
        with oracle.disable_adapter():
            assert output.token_ids != hf_greedy(oracle, prompt, MAX_NEW), f"adapter {name} changed nothing"
    assert_pool_drained(llm.engine)
