"""Greedy output equals a Hugging Face forward loop, token for token, on a tiny random Llama (fp32)."""

from __future__ import annotations

import pytest

from conftest import assert_pool_drained, hf_greedy, random_prompts
from kvserve import LLM, SamplingParams

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(8, 3, 90, seed=1)


@pytest.fixture(scope="module")
def reference(tiny_hf_model, prompts) -> list[list[int]]:
    return [hf_greedy(tiny_hf_model, p, MAX_NEW) for p in prompts]


def make_llm(model_dir, **engine_args) -> LLM:
    engine_args.setdefault("num_blocks", 256)
    return LLM(str(model_dir), progress=False, **engine_args)


def test_one_at_a_time(tiny_model_dir, prompts, reference):
    llm = make_llm(tiny_model_dir)
    for prompt, expected in zip(prompts, reference, strict=True):
        assert llm.generate([prompt], GREEDY)[0].token_ids == expected
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize("max_step_rows", [None, 0, 1, 3])  # the row cap: None is auto (4 on a CPU); 0 off
@pytest.mark.parametrize("prefix_cache", ["radix", "hash", "off"])
def test_batched_mixed_lengths(tiny_model_dir, prompts, reference, prefix_cache, max_step_rows):
    llm = make_llm(tiny_model_dir, prefix_cache=prefix_cache, max_step_rows=max_step_rows)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert all(o.finish_reason == "length" for o in outputs)
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize("budget", [5, 16, 33])
def test_chunked_prefill(tiny_model_dir, prompts, reference, budget):
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=budget, prefix_cache="off")
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize("max_step_rows", [None, 0, 2])
@pytest.mark.parametrize("prefix_cache", ["radix", "hash", "off"])
def test_preemption_keeps_outputs(tiny_model_dir, prompts, reference, prefix_cache, max_step_rows):
    # 12 blocks of 16 = 192 slots: far less than 8 requests need at once, enough for the largest alone.
    llm = make_llm(tiny_model_dir, num_blocks=12, block_size=16, prefix_cache=prefix_cache,
                   max_step_rows=max_step_rows)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert llm.stats()["num_preemptions"] > 0
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize("threshold", [3, 8])
@pytest.mark.parametrize("prefix_cache", ["radix", "off"])
def test_long_prefill_threshold_and_tight_pool(tiny_model_dir, prompts, reference, prefix_cache, threshold):
    """Issue 8: prefill chunks of at most `threshold` tokens beside others, fair preemption on 12 blocks."""
    llm = make_llm(tiny_model_dir, num_blocks=12, prefix_cache=prefix_cache, long_prefill_token_threshold=threshold)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert llm.stats()["num_preemptions"] > 0
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize("block_size", [1, 2, 16, 64])
def test_block_sizes(tiny_model_dir, prompts, reference, block_size):
    llm = make_llm(tiny_model_dir, block_size=block_size, num_blocks=4096 // block_size)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert_pool_drained(llm.engine)


def test_first_step_logits_match_hf(tiny_model_dir, tiny_hf_model, prompts):
    import torch

    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    prompt = prompts[0]
    request = engine.make_request(prompt, GREEDY)
    engine.add(request)
    scheduled = engine.scheduler.schedule().scheduled
    logits, _ = engine.runner.run(scheduled)
    with torch.inference_mode():
        expected = tiny_hf_model(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt))).logits[0, -1]
    scale = expected.abs().max()
    assert ((logits[0] - expected).abs().max() / scale) < 1e-4
    engine.abort_request(request.request_id)
    assert_pool_drained(engine)
