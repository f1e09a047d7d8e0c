"""vLLM's offline examples, written as a vLLM user writes them; only the import (and the model) differ.

The examples come from vLLM's `examples/offline_inference/` (basic, chat, n-best, beam search,
logprobs, prefix caching). They run on the tiny chat model (random weights, a real tokenizer): the
assertions check the shapes and invariants vLLM documents, not the text. The prefix-caching example
runs on the real model too (`@pytest.mark.model`), where the texts must match.
"""

from __future__ import annotations

import math

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.params import BeamSearchParams
from kvserve.engine.request import CompletionOutput, Logprob, RequestOutput
from test_server_support import chat_model_dir  # noqa: F401

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


@pytest.fixture(scope="module")
def llm(chat_model_dir) -> LLM:  # noqa: F811
    # vLLM engine-argument names, as a vLLM user passes them.
    return LLM(model=str(chat_model_dir), num_gpu_blocks_override=512, max_num_seqs=16, seed=0,
               enable_prefix_caching=True, dtype="auto")


def test_basic(llm):
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(PROMPTS, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    assert [o.prompt for o in outputs] == PROMPTS
    for output in outputs:
        assert isinstance(output, RequestOutput) and len(output.outputs) == 1
        completion = output.outputs[0]
        assert isinstance(completion, CompletionOutput) and completion.index == 0
        assert len(completion.token_ids) == 16 or completion.finish_reason == "stop"
        assert completion.text == output.text  # kvserve's top-level fields mirror outputs[0]
        assert completion.finish_reason in ("stop", "length") and output.finished


def test_prompt_kinds(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(PROMPTS[2])
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = llm.generate([PROMPTS[2], {"prompt": PROMPTS[2]}, {"prompt_token_ids": ids}, ids],
                           sampling_params=greedy, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert [o.prompt_token_ids for o in outputs] == [ids] * 4
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, greedy)


def test_chat(llm):
    sampling_params = SamplingParams(temperature=0.5)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    conversations = [conversation for _ in range(3)]
    batch = llm.chat(conversations, sampling_params, use_tqdm=True)
    assert len(outputs) == 1 and len(batch) == 3
    assert all(len(o.outputs) == 1 and o.outputs[0].token_ids for o in outputs + batch)
    # The prompt is the chat template's rendering; a custom template replaces it.
    rendered = llm.get_tokenizer().apply_chat_template(conversation, add_generation_prompt=True)
    assert outputs[0].prompt_token_ids == llm.get_tokenizer().encode(rendered)
    plain = llm.chat(conversation, SamplingParams(max_tokens=2), use_tqdm=False,
                     chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
                     add_generation_prompt=False, chat_template_kwargs={"unused": 1})
    assert plain[0].prompt_token_ids == llm.get_tokenizer().encode(
        "".join(m["content"] + "\n" for m in conversation))


def test_n_best(llm):
    sampling_params = SamplingParams(n=4, best_of=6, temperature=1.0, seed=3, max_tokens=8, logprobs=0)
    outputs = llm.generate(PROMPTS[:2], sampling_params)
    for output in outputs:
        assert [c.index for c in output.outputs] == [0, 1, 2, 3]
        cumulative = [c.cumulative_logprob for c in output.outputs]
        assert cumulative == sorted(cumulative, reverse=True)  # best_of keeps the n best
        for completion in output.outputs:
            assert math.isclose(sum(p[t].logprob for p, t in zip(completion.logprobs, completion.token_ids,
                                                                 strict=True)),
                                completion.cumulative_logprob, rel_tol=1e-4, abs_tol=1e-4)


def test_beam_search(llm):
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    outputs = llm.beam_search([{"prompt": p} for p in PROMPTS[:2]], params)
    for output in outputs:
        sequences = output.sequences
        assert len(sequences) == 3
        scores = [s.cum_logprob / len(s.tokens) for s in sequences]
        assert scores == sorted(scores, reverse=True)
        assert all(isinstance(s.text, str) for s in sequences)
    # kvserve's older positional form gives the same beams.
    older = llm.beam_search([{"prompt": p} for p in PROMPTS[:2]], 3, 6)
    assert [[s.tokens for s in o.sequences] for o in older] == [[s.tokens for s in o.sequences] for o in outputs]
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)


def test_logprobs(llm):
    sampling_params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    output = llm.generate(PROMPTS[0], sampling_params)[0]
    completion = output.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 5
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in position and all(isinstance(p, Logprob) for p in position.values())
        ranked = sorted((p for p in position.values()), key=lambda p: p.rank)
        assert [p.rank for p in ranked][:3] == [1, 2, 3]
        assert position[token_id].rank == 1  # greedy picks the top token
        assert [p.logprob for p in ranked] == sorted((p.logprob for p in ranked), reverse=True)
        assert position[token_id].decoded_token == llm.get_tokenizer().decode([token_id], False)
    assert len(output.logprobs) == 5  # kvserve's own records stay on the top level


def test_prefix_caching(llm):
    prefix = ("You are an expert school principal, skilled in effectively managing faculty and staff. "
              "Draft 10-15 questions for a potential first grade Head Teacher for my K-12, all-girls', "
              "independent school that emphasizes community, joy in learning, and diversity. ")
    prompts = ["Hello, my name is", "The president of the United States is"]
    generating_prompts = [prefix + prompt for prompt in prompts]
    sampling_params = SamplingParams(temperature=0.0)
    regular_llm = LLM(model=llm.engine.config.model, num_gpu_blocks_override=256, enable_prefix_caching=False)
    outputs = regular_llm.generate(generating_prompts, sampling_params)
    regular_generated_texts = [output.outputs[0].text for output in outputs]
    prefix_cached_llm = llm
    prefix_cached_llm.generate(generating_prompts[0], sampling_params)  # warm up
    outputs = prefix_cached_llm.generate(generating_prompts, sampling_params)
    cached_generated_texts = [output.outputs[0].text for output in outputs]
    assert regular_generated_texts == cached_generated_texts
    assert all(output.num_cached_tokens > 0 for output in outputs)
    assert regular_llm.stats()["prefix_cache_hits"] == 0


def test_unknown_engine_argument_is_refused(chat_model_dir):  # noqa: F811
    with pytest.raises(TypeError, match="gpu_memory_utilization"):
        LLM(model=str(chat_model_dir), gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model=str(chat_model_dir), tensor_parallel_size=2)


@pytest.mark.model
def test_prefix_caching_real_model():
    prefix = ("You are an expert school principal, skilled in effectively managing faculty and staff. "
              "Draft 10-15 questions for a potential first grade Head Teacher for my K-12, all-girls', "
              "independent school that emphasizes community, joy in learning, and diversity. ")
    prompts = [prefix + "Hello, my name is", prefix + "The capital of France is"]
    sampling_params = SamplingParams(temperature=0.0, max_tokens=12)
    regular_llm = LLM(model="smollm2-135m", enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20)
    cached_llm = LLM(model="smollm2-135m", enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20)
    regular = [o.outputs[0].text for o in regular_llm.generate(prompts, sampling_params)]
    cached_llm.generate(prompts[0], sampling_params)
    outputs = cached_llm.generate(prompts, sampling_params)
    assert [o.outputs[0].text for o in outputs] == regular
    assert outputs[1].num_cached_tokens > 0 and all(text.strip() for text in regular)
