"""Narrow KV caches (`--kv-cache-dtype bfloat16 | fp8`): the engine's outputs against their oracle, per dtype.

The oracle is transformers with a cache that rounds every key and value as the pool stores it (torch's
`.to(dtype)`: nearest even; e4m3fn also saturating at +-448), and attention reads those rounded values whether
they were computed in this step, cached by an earlier request or loaded from a tier. The torch kernels run the
oracle's arithmetic: their greedy tokens equal it, batched, chunked, cached. The native kernels' checks (the
pool's bits, the widening, log-probabilities against the twin) are per dtype: tests/test_kv_bf16.py and
tests/test_kv_fp8.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import assert_pool_drained, hf_greedy, random_prompts
from kvserve import LLM, SamplingParams

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
TIMES_FLOAT32 = {"bfloat16": 2, "fp8": 4}  # blocks the same memory holds, against a float32 pool
WIDER = {"bfloat16": "float32", "fp8": "bfloat16"}  # another engine's dtype whose disk blocks must stay apart


class RoundingCache(DynamicCache):
    """transformers' cache, storing (and returning to attention) keys and values rounded to `round_to`."""

    def __init__(self, round_to: torch.dtype) -> None:
        super().__init__()
        self.round_to = round_to

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rounded = (state.to(self.round_to).to(state.dtype) for state in (key_states, value_states))
        return super().update(*rounded, layer_idx, *args, **kwargs)


def hf_greedy_rounded(model, prompt_ids: list[int], kv_dtype: str, max_new_tokens: int = MAX_NEW) -> list[int]:
    return hf_greedy(model, prompt_ids, max_new_tokens, cache=RoundingCache(DTYPES[kv_dtype]))


@pytest.fixture(scope="module", params=list(DTYPES))
def kv_dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(8, 3, 90, seed=1)


@pytest.fixture(scope="module")
def reference(tiny_hf_model, prompts, kv_dtype) -> list[list[int]]:
    return [hf_greedy_rounded(tiny_hf_model, p, kv_dtype) for p in prompts]


def make_llm(model_dir, kv_dtype: str, **engine_args) -> LLM:
    engine_args.setdefault("num_blocks", 256)
    return LLM(str(model_dir), progress=False, kv_cache_dtype=kv_dtype, **engine_args)


def test_oracle_tells_the_rounding_from_float32(tiny_hf_model, prompts, reference):
    """The rounding matters on this model (else the tests below could not tell the cache from float32)."""
    assert any(hf_greedy(tiny_hf_model, p, MAX_NEW) != expected for p, expected in zip(prompts, reference, strict=True))


@pytest.mark.parametrize("prefix_cache", ["radix", "hash", "off"])
def test_batched_greedy_equals_transformers_with_a_rounding_cache(tiny_model_dir, prompts, reference, kv_dtype,
                                                                  prefix_cache):
    llm = make_llm(tiny_model_dir, kv_dtype, kernels="torch", prefix_cache=prefix_cache)
    assert llm.engine.kv_pool.tensor.dtype == DTYPES[kv_dtype]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize(("budget", "block_size"), [(5, 16), (33, 1), (16, 4)])
def test_chunked_prefill_and_block_sizes(tiny_model_dir, prompts, reference, kv_dtype, budget, block_size):
    llm = make_llm(tiny_model_dir, kv_dtype, kernels="torch", max_num_batched_tokens=budget, block_size=block_size,
                   num_blocks=2048 // block_size)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference


@pytest.mark.parametrize("kernels_name", ["torch", "native"])
def test_cache_hits_do_not_change_outputs(tiny_model_dir, tiny_hf_model, kv_dtype, kernels_name):
    """Prompts sharing a cached prefix (and the same prompt again) read the cached narrow blocks: the same
    tokens as computing everything fresh (the oracle, for the twin; the native kernels' own fresh run, for
    them)."""
    shared = random_prompts(1, 40, 40, seed=5)[0]
    prompts = [shared + tail for tail in random_prompts(3, 5, 9, seed=6)]
    llm = make_llm(tiny_model_dir, kv_dtype, kernels=kernels_name)
    fresh = make_llm(tiny_model_dir, kv_dtype, kernels=kernels_name, prefix_cache="off")
    for prompt in prompts + prompts[:1]:
        expected = (hf_greedy_rounded(tiny_hf_model, prompt, kv_dtype) if kernels_name == "torch"
                    else fresh.generate([prompt], GREEDY)[0].token_ids)
        assert llm.generate([prompt], GREEDY)[0].token_ids == expected
    assert llm.stats()["prefix_cache_hits_device"] >= 3 * 32


def test_the_same_memory_holds_more_blocks(tiny_model_dir, kv_dtype):
    fp32 = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="4MiB")
    narrow = make_llm(tiny_model_dir, kv_dtype, num_blocks=None, kv_cache_memory="4MiB")
    assert fp32.engine.kv_pool.tensor.dtype == torch.float32
    assert narrow.engine.kv_pool.num_blocks // TIMES_FLOAT32[kv_dtype] == fp32.engine.kv_pool.num_blocks
    assert narrow.engine.kv_pool.nbytes() <= 4 * 2**20


def test_host_and_disk_tiers_round_trip_the_blocks(tiny_model_dir, tiny_hf_model, tmp_path, kv_dtype):
    """Blocks evicted to the host and disk tiers come back bit for bit: outputs unchanged, hits from there."""
    llm = make_llm(tiny_model_dir, kv_dtype, kernels="torch", num_blocks=24, block_size=4, host_cache="4KiB",
                   disk_cache=str(tmp_path / "d"))
    sources: dict[str, int] = {}
    for _ in range(2):
        for prompt in random_prompts(3, 30, 34, seed=9):
            llm.engine.tiers.policy.flush()
            output = llm.generate([prompt], GREEDY)[0]
            assert output.token_ids == hf_greedy_rounded(tiny_hf_model, prompt, kv_dtype)
            for source, tokens in output.cached_tokens_by_source.items():
                sources[source] = sources.get(source, 0) + tokens
    assert sources.get("host", 0) + sources.get("disk", 0) > 0, sources
    llm.engine.close()


def test_disk_blocks_not_shared_across_kv_dtypes(tiny_model_dir, tmp_path, kv_dtype):
    """A wider-cache engine's disk blocks are never loaded by this one (the tiers' fingerprint has the KV
    dtype): the codec would refuse them anyway, and the rounding differs."""
    prompt = random_prompts(1, 41, 41, seed=11)[0]
    first = make_llm(tiny_model_dir, WIDER[kv_dtype], num_blocks=24, block_size=4, disk_cache=str(tmp_path / "d"))
    first.generate([prompt], GREEDY)
    first.engine.tiers.policy.flush()
    first.engine.close()
    second = make_llm(tiny_model_dir, kv_dtype, num_blocks=24, block_size=4, disk_cache=str(tmp_path / "d"))
    assert not second.generate([prompt], GREEDY)[0].cached_tokens_by_source.get("disk")
    second.engine.close()


def test_lora_steps_over_a_narrow_pool(tiny_model_dir, tmp_path, kv_dtype):
    """Steps with an adapter (the Python loop, its torch pool writes through `reference.store_slots`) read and
    write the narrow pool as the other steps do: the native kernels give the twin's tokens, with the adapter and
    without, and the adapter changes the answer."""
    from kvserve import LoRARequest
    from lora_util import make_peft_adapter

    make_peft_adapter(tiny_model_dir, tmp_path / "adapter", seed=3)
    adapter = LoRARequest("a", 1, str(tmp_path / "adapter"))
    prompt = [[5, 6, 7, 8, 9] * 10]
    runs = {}
    for kernels_name in ("torch", "native"):
        llm = make_llm(tiny_model_dir, kv_dtype, kernels=kernels_name, enable_lora=True)
        runs[kernels_name] = [llm.generate(prompt, GREEDY, lora_request=lora)[0].token_ids for lora in (adapter, None)]
    assert runs["torch"][0] != runs["torch"][1]
    assert runs["native"] == runs["torch"]


def test_speculative_decoding_over_a_narrow_pool(tiny_model_dir, kv_dtype):
    """Prompt-lookup drafts verified over a narrow pool: the same tokens as plain decoding (the drafts' keys and
    values are written and read back rounded, as every other token's)."""
    from test_speculative import repeating_prompts

    prompts = repeating_prompts(16, seed=3)
    plain = [o.token_ids for o in make_llm(tiny_model_dir, kv_dtype, kernels="torch").generate(prompts, GREEDY)]
    spec = make_llm(tiny_model_dir, kv_dtype, kernels="torch",
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 64})
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == plain
    assert spec.stats()["spec_accepted_tokens"] > 0
