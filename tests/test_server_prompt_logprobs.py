"""Scoring prompts over HTTP: /v1/completions `echo` (with `logprobs`, `max_tokens` 0: how lm-evaluation-harness
asks an OpenAI-compatible server for log-likelihoods) and vLLM's `prompt_logprobs`, against transformers'
forward of the same tiny chat model; the refusals name their field; every block comes back."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from test_server_support import wait_until_drained

MODEL = "tiny-chat"
PROMPT_IDS = [17, 250, 33, 91, 120, 7, 64, 199, 45, 12, 88, 230]


@pytest.fixture(scope="module")
def served(vllm_chat_server):
    return vllm_chat_server


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0].base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(served):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = served[1]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def hf_log_probs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        tensor = torch.tensor([ids])
        return model(tensor, attention_mask=torch.ones_like(tensor)).logits[0, :-1].float().log_softmax(-1)


def test_echo_with_max_tokens_0_scores_the_prompt_as_lm_eval_asks(client, hf):
    model, tokenizer = hf
    response = client.completions.create(model=MODEL, prompt=PROMPT_IDS, echo=True, logprobs=2, max_tokens=0,
                                         temperature=0)
    choice = response.choices[0]
    expected = hf_log_probs(model, PROMPT_IDS)
    assert choice.text == tokenizer.decode(PROMPT_IDS) and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(PROMPT_IDS)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(PROMPT_IDS) and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(
        [expected[i, t].item() for i, t in enumerate(PROMPT_IDS[1:])], abs=1e-4)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])  # two alternatives (texts may collide)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_echo_puts_the_prompt_before_an_unchanged_answer(client):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=4, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0]
    echoed = client.completions.create(echo=True, **kwargs)
    choice = echoed.choices[0]
    prompt_tokens = echoed.usage.prompt_tokens
    assert choice.text == "The quick brown fox" + plain.text
    assert echoed.usage.completion_tokens == 4
    assert len(choice.logprobs.tokens) == prompt_tokens + 4
    assert choice.logprobs.token_logprobs[prompt_tokens:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert choice.logprobs.tokens[prompt_tokens:] == plain.logprobs.tokens


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_streams_what_it_answers_whole(client, max_tokens):
    kwargs = dict(model=MODEL, prompt=["One two three", "Four five"], n=2, max_tokens=max_tokens, temperature=0,
                  logprobs=1, echo=True, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    for choice in whole.choices:
        parts = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(p.text for p in parts) == choice.text
        assert [t for p in parts if p.logprobs for t in p.logprobs.tokens] == choice.logprobs.tokens
        scores = [v for p in parts if p.logprobs for v in p.logprobs.token_logprobs]
        assert scores[0] is None and scores[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)
        assert parts[-1].finish_reason == choice.finish_reason == "length"


def test_prompt_logprobs_in_vllms_shape_on_both_endpoints(served, hf):
    model, tokenizer = hf
    url = served[0].url
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 2, "prompt_logprobs": 3}
    choice = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    expected = hf_log_probs(model, PROMPT_IDS)
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT_IDS)
    for i, (entry, token) in enumerate(zip(entries[1:], PROMPT_IDS[1:], strict=True)):
        assert entry[str(token)]["logprob"] == pytest.approx(expected[i, token].item(), abs=1e-4)
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
        assert sorted(e["rank"] for e in entry.values())[:3] == [1, 2, 3]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2,
            "prompt_logprobs": 0}
    answer = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]
    assert answer["prompt_logprobs"][0] is None and all(len(e) == 1 for e in answer["prompt_logprobs"][1:])
    plain = httpx.post(url + "/v1/completions", json={**body, "prompt_logprobs": None}, timeout=60).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    wait_until_drained(url)


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"echo": True, "use_beam_search": True, "n": 2, "temperature": 0}, "echo"),
])
def test_what_cannot_be_combined_is_a_400_naming_it(served, fields, param):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **fields}
    response = httpx.post(served[0].url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
