"""prompt_logprobs (vLLM's SamplingParams field) against transformers' full-prompt forward.

Entry i of `RequestOutput.prompt_logprobs` is prompt token i's log-prob after tokens 0..i-1 (None for the
first), with its rank and the top N alternatives. Checked: equal to HF's log_softmax over one forward of
the whole prompt; the same under chunked prefill, preemption, a cached prefix (which such a request must not
reuse, while others still do), block sizes and parallel samples; generated tokens unchanged; every block back.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_pool_drained, random_prompts
from kvserve import LLM, SamplingParams

NUM_TOP = 3


@torch.inference_mode()
def hf_prompt_log_probs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the distribution of prompt token i + 1."""
    ids = torch.tensor([prompt])
    logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return logits[:-1].log_softmax(dim=-1)


def assert_matches_hf(output, model, prompt: list[int], num_top: int = NUM_TOP) -> None:
    expected = hf_prompt_log_probs(model, prompt)
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(output.prompt_logprobs[1:]):
        token = prompt[i + 1]
        row = expected[i]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        # rank: 1 + tokens rated higher (a near-tie within float32 summation error may go either way)
        assert int((row > row[token] + 1e-5).sum()) < entry[token].rank <= int((row > row[token] - 1e-5).sum()) + 1
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= num_top), key=lambda item: item[1].rank)
        assert len(top) >= num_top
        assert [lp.logprob for _, lp in top[:num_top]] == pytest.approx(row.topk(num_top).values.tolist(), abs=1e-4)
        assert [lp.logprob for _, lp in top] == pytest.approx([row[t].item() for t, _ in top], abs=1e-4)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(4, 9, 60, seed=11)


def params(**fields) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "prompt_logprobs": NUM_TOP,
                             **fields})


@pytest.mark.parametrize("config", [
    {}, {"max_num_batched_tokens": 7}, {"block_size": 1, "num_blocks": 4096}, {"prefix_cache": "hash"},
    {"kernels": "torch"},
], ids=["default", "chunked", "block1", "hash", "torch"])
def test_equal_to_transformers(tiny_model_dir, tiny_hf_model, prompts, config):
    llm = LLM(str(tiny_model_dir), progress=False, **{"num_blocks": 256, **config})
    outputs = llm.generate(prompts, params(), use_tqdm=False)
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for output, prompt in zip(outputs, prompts, strict=True):
        assert_matches_hf(output, tiny_hf_model, prompt)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]  # generation unchanged
    assert all(o.prompt_logprobs is None for o in plain)
    assert_pool_drained(llm.engine)


def test_a_cached_prompt_is_recomputed_for_its_scores_and_still_serves_others(tiny_model_dir, tiny_hf_model):
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=256)
    prompt = random_prompts(1, 70, 70, seed=3)[0]
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert llm.generate([prompt], plain, use_tqdm=False)[0].num_cached_tokens == 0
    scored = llm.generate([prompt], params(), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0  # its prefix was cached, but its logits were needed
    assert_matches_hf(scored, tiny_hf_model, prompt)
    assert llm.generate([prompt], plain, use_tqdm=False)[0].num_cached_tokens == 64  # still cached for others
    assert_pool_drained(llm.engine)


def test_preempted_requests_score_each_prompt_token_once(tiny_model_dir, tiny_hf_model):
    prompts = random_prompts(6, 30, 60, seed=5)
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=12, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, params(max_tokens=40), use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for output, prompt in zip(outputs, prompts, strict=True):
        assert_matches_hf(output, tiny_hf_model, prompt)
    assert_pool_drained(llm.engine)


def test_parallel_samples_share_one_scored_prompt(tiny_model_dir, tiny_hf_model, prompts):
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=256)
    output = llm.generate([prompts[0]], params(n=3, temperature=1.0, seed=7), use_tqdm=False)[0]
    assert len(output.outputs) == 3
    assert_matches_hf(output, tiny_hf_model, prompts[0])
    assert_pool_drained(llm.engine)


def test_zero_asks_for_the_prompt_tokens_only_and_one_token_prompts_have_none(tiny_model_dir, tiny_hf_model):
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=64)
    prompt = random_prompts(1, 12, 12, seed=2)[0]
    zero = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert all(len(entry) == 1 for entry in zero.prompt_logprobs[1:])  # the prompt token alone
    expected = hf_prompt_log_probs(tiny_hf_model, prompt)
    assert [entry[t].logprob for entry, t in zip(zero.prompt_logprobs[1:], prompt[1:], strict=True)] == \
        pytest.approx([expected[i, t].item() for i, t in enumerate(prompt[1:])], abs=1e-4)
    single = llm.generate([[prompt[0]]], SamplingParams(max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert single.prompt_logprobs == [None]


def test_blocks_on_the_disk_tier_are_not_loaded_for_a_scored_prompt(tiny_model_dir, tiny_hf_model, tmp_path):
    prompt = random_prompts(1, 41, 41, seed=11)[0]
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    settings = dict(progress=False, num_blocks=24, block_size=4, host_cache=0, disk_cache=str(tmp_path / "disk"))
    first = LLM(str(tiny_model_dir), **settings)
    first.generate([prompt], plain, use_tqdm=False)
    for other in random_prompts(3, 70, 80, seed=12):  # evicted from the pool: written to disk
        first.generate([other], plain, use_tqdm=False)
    first.engine.close()
    second = LLM(str(tiny_model_dir), **settings)  # a fresh pool: the prompt's blocks are on disk only
    scored = second.generate([prompt], params(), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0 and not any(scored.cached_tokens_by_source.values())
    assert_matches_hf(scored, tiny_hf_model, prompt)
    second.engine.close()
    third = LLM(str(tiny_model_dir), **settings)
    assert third.generate([prompt], plain, use_tqdm=False)[0].cached_tokens_by_source.get("disk", 0) == 40
    third.engine.close()
