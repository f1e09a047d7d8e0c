"""The default model (smollm2-135m GGUF) against Hugging Face transformers on the same file, fp32.

Greedy tokens must be identical, token for token, for 8 varied prompts x 64 new tokens (EOS ignored):
one at a time (dense weights: 4 of them), batched, chunked prefill, under preemption, and with block sizes
1, 16 and 64.
Beam search (width 4, HF's default length_penalty 1.0 and early_stopping False) returns HF's hypotheses.

The kernel tests (first-step logits, one at a time, batched, the wide batch, beam search) run with the
native kernels on dense weights and on the GGUF's quantized weights as stored (`weights="native"`, fp32
activations); those on the shared `llm` also with the torch kernels. The scheduling tests (chunked prefill,
preemption, block sizes) run on the default configuration, quantized weights as stored: dense weights
change only the matmul kernel, which the kernel tests cover, and the tiny model's equivalence tests run
every scheduling path on dense weights (dense decode of this model reads 540 MB a token: ~40 s a test).
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_pool_drained, hf_greedy
from kvserve import LLM, SamplingParams
from test_beam_search import hf_beam_search

pytestmark = pytest.mark.model

MAX_NEW = 64
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three prime numbers greater than 100.",
]
RAW = [
    "def fibonacci(n):\n    ",
    "The quick brown fox",
    "東京は日本の首都です。大阪は",
    "Once upon a time, in a land far away, there lived a dragon who loved 🐉 emoji and",
]


VARIANTS = {
    "native": {"kernels": "native", "weights": "dense"},
    "native-weights": {"kernels": "native", "weights": "native"},
    "torch": {"kernels": "torch", "weights": "dense"},
}


@pytest.fixture(scope="module")
def base_llm() -> LLM:
    return LLM("smollm2-135m", progress=False, num_blocks=512, **VARIANTS["native"])


@pytest.fixture(scope="module", params=["native", "native-weights", "torch"])
def llm(request, base_llm) -> LLM:
    if request.param == "native":
        return base_llm
    return LLM("smollm2-135m", progress=False, num_blocks=512, **VARIANTS[request.param])


@pytest.fixture(scope="module", params=["native", "native-weights"])
def variant(request) -> dict[str, str]:
    return VARIANTS[request.param]


@pytest.fixture(scope="module")
def default_variant() -> dict[str, str]:
    """The scheduling tests' configuration: the default model's default (quantized weights as stored)."""
    return VARIANTS["native-weights"]


@pytest.fixture(scope="module")
def prompts(base_llm) -> list[list[int]]:
    chats = [base_llm.render_chat([{"role": "user", "content": text}]) for text in CHATS]
    return chats + [base_llm.tokenizer.encode(text) for text in RAW]


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):
    return smollm2_hf


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[list[int]]:
    return [hf_greedy(hf_model, prompt, MAX_NEW) for prompt in prompts]


def test_first_step_logits_match(llm, hf_model, prompts):
    engine = llm.engine
    for prompt in prompts[:3]:
        request = engine.make_request(prompt, GREEDY)
        engine.add(request)
        logits, _ = engine.runner.run(engine.scheduler.schedule().scheduled)
        engine.abort_request(request.request_id)
        with torch.inference_mode():
            mask = torch.ones(1, len(prompt), dtype=torch.long)
            expected = hf_model(torch.tensor([prompt]), attention_mask=mask).logits[0, -1]
        assert ((logits[0] - expected).abs().max() / expected.abs().max()).item() < 1e-4
    assert_pool_drained(engine)


# Dense weights one at a time: a chat, code, Japanese and the emoji prompt (each dense decode step streams 540 MB;
# the batched test still runs all eight prompts on dense weights, the quantized default runs all eight here too).
DENSE_ONE_AT_A_TIME = (0, 4, 6, 7)


def test_one_at_a_time(llm, prompts, reference, request):
    dense = request.node.callspec.params["llm"] != "native-weights"
    chosen = DENSE_ONE_AT_A_TIME if dense else range(len(prompts))
    for i in chosen:
        assert llm.generate([prompts[i]], GREEDY)[0].token_ids == reference[i]
    assert_pool_drained(llm.engine)


def test_batched(llm, prompts, reference):
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert_pool_drained(llm.engine)


def test_wide_batch(prompts, reference, variant):
    """32 sequences at once: decode steps of 32 rows, past the layer loop (quantized weights: csrc/qgemm.h)."""
    wide = LLM("smollm2-135m", progress=False, num_blocks=512, max_num_seqs=32, **variant)
    assert [o.token_ids for o in wide.generate(prompts * 4, GREEDY)] == reference * 4
    assert_pool_drained(wide.engine)


def test_chunked_prefill(prompts, reference, default_variant):
    chunked = LLM("smollm2-135m", progress=False, num_blocks=512, max_num_batched_tokens=24,
                  prefix_cache="off", **default_variant)
    assert [o.token_ids for o in chunked.generate(prompts, GREEDY)] == reference
    assert_pool_drained(chunked.engine)


@pytest.mark.parametrize("prefix_cache", ["radix", "off"])
def test_preemption(prompts, reference, prefix_cache, default_variant):
    # 10 blocks of 16: enough for the longest request alone, far too few for all eight at once.
    small = LLM("smollm2-135m", progress=False, num_blocks=10, prefix_cache=prefix_cache, **default_variant)
    assert [o.token_ids for o in small.generate(prompts, GREEDY)] == reference
    assert small.stats()["num_preemptions"] > 0
    assert_pool_drained(small.engine)


@pytest.mark.parametrize("block_size", [1, 64])
def test_block_sizes(prompts, reference, block_size, default_variant):
    other = LLM("smollm2-135m", progress=False, block_size=block_size, num_blocks=8192 // block_size, **default_variant)
    assert [o.token_ids for o in other.generate(prompts, GREEDY)] == reference
    assert_pool_drained(other.engine)


def test_beam_search_equals_hf(llm, hf_model, prompts):
    eos_token_ids = sorted(llm.engine.eos_token_ids)  # <|endoftext|> and <|im_end|>: K = 3 x width
    for prompt in prompts[:2]:  # the first answer ends on EOS, the second runs to max_tokens
        output = llm.beam_search(prompt, 4, 16)[0]
        with torch.inference_mode():
            sequences, scores = hf_beam_search(hf_model, prompt, 4, 16, eos_token_ids=eos_token_ids)
        assert [c.token_ids for c in output.outputs] == sequences
        assert [c.score for c in output.outputs] == pytest.approx(scores, abs=1e-3)
    assert_pool_drained(llm.engine)


def test_prompt_logprobs_match_hf(llm, hf_model, prompts):
    """Every prompt token's log-prob after the tokens before it, as transformers' one forward gives it."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    for prompt, output in zip(prompts[:3], llm.generate(prompts[:3], params), strict=True):
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            expected = hf_model(ids, attention_mask=torch.ones_like(ids)).logits[0, :-1].log_softmax(-1)
        got = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:], strict=True)]
        want = [expected[i, token].item() for i, token in enumerate(prompt[1:])]
        assert output.prompt_logprobs[0] is None
        assert got == pytest.approx(want, abs=2e-4)  # measured: 4.6e-5 at most over 1,024 tokens
    assert_pool_drained(llm.engine)


def test_speculative_decoding(prompts, reference, default_variant):
    """Prompt-lookup drafts checked row by row: the same tokens as transformers, with drafts accepted
    (the raw prompts repeat themselves: the dragon one, fibonacci's code) and rejected."""
    config = {"method": "ngram", "disable_by_batch_size": 8}  # drafts in the batch of 8 too
    spec = LLM("smollm2-135m", progress=False, num_blocks=512, speculative_config=config, **default_variant)
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == reference
    stats = spec.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert_pool_drained(spec.engine)
