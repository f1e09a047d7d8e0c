"""vLLM's token-level request fields: `allowed_token_ids`, `bad_words`, `truncate_prompt_tokens` (engine and
server) and `return_token_ids`, `return_tokens_as_token_ids` (server responses).

The oracle of the sampling fields is transformers on the same weights, with the field's rule written out
here as a mask on its logits (vLLM's definitions): kvserve's greedy tokens must equal it token for token.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.logits_processors import _ban_bad_words
from kvserve.engine.validation import bad_words_token_ids
from test_server_support import chat_model_dir, server  # noqa: F401

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def llm(chat_model_dir) -> LLM:  # noqa: F811
    return LLM(str(chat_model_dir), progress=False, num_blocks=256)


@pytest.fixture(scope="module")
def hf(chat_model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(chat_model_dir, torch_dtype=torch.float32).eval()


@torch.inference_mode()
def hf_masked_greedy(model, prompt_ids: list[int], steps: int, mask) -> list[int]:
    """Greedy continuation where `mask(logits, output)` edits each step's logits row first."""
    ids, output = list(prompt_ids), []
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits
        row = logits[0, -1].clone()
        mask(row, output)
        output.append(int(row.argmax()))
        ids.append(output[-1])
    return output


def greedy(llm: LLM, prompt, steps: int = 12, **fields):
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, **fields)
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_allowed_token_ids_equal_transformers_restricted(llm, hf):
    prompt_ids = llm.engine.tokenizer.encode(PROMPT)
    free = greedy(llm, PROMPT).outputs[0].token_ids
    allowed = sorted({free[1], free[3], 5, 17, 40})  # a few the model likes, a few it may not

    def keep_allowed(row, _output):
        kept = row[allowed].clone()
        row.fill_(float("-inf"))
        row[allowed] = kept

    out = greedy(llm, PROMPT, allowed_token_ids=allowed).outputs[0].token_ids
    assert set(out) <= set(allowed)
    assert out == hf_masked_greedy(hf, prompt_ids, 12, keep_allowed)
    assert out != free  # the restriction changed something


def test_bad_words_are_never_generated_and_equal_transformers(llm, hf):
    tokenizer = llm.engine.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    free = greedy(llm, PROMPT).outputs[0].token_ids
    # a one-token word and a two-token word, both taken from the unconstrained output
    single = tokenizer.decode([free[0]])
    pair = tokenizer.decode(free[2:4])
    words = [single, pair]
    variants = bad_words_token_ids(tokenizer, words)
    out = greedy(llm, PROMPT, bad_words=words).outputs[0].token_ids

    def ban(row, output):
        _vllm_bad_words(row, variants, output)

    assert out == hf_masked_greedy(hf, prompt_ids, 12, ban)
    for variant in variants:  # no variant appears in the output
        assert not any(out[i:i + len(variant)] == variant for i in range(len(out)))
    assert out != free


def _vllm_bad_words(row: torch.Tensor, variants: list[list[int]], output: list[int]) -> None:
    """vLLM v1's bad-words rule, written from its definition: a variant's last token is -inf when the
    output's last len(variant) - 1 tokens are the variant's others."""
    for variant in variants:
        if len(variant) - 1 > len(output):
            continue
        if len(variant) == 1 or output[len(output) - (len(variant) - 1):] == variant[:-1]:
            row[variant[-1]] = float("-inf")


def test_bad_words_tokenization_follows_vllm(llm):
    """Each word alone; its spaced spelling too when that starts differently with as many tokens."""
    tokenizer = llm.engine.tokenizer
    for word in ["fox", "quick brown", "  lazy"]:
        alone, spaced = tokenizer.encode(word.lstrip()), tokenizer.encode(" " + word.lstrip())
        expected = [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
        assert bad_words_token_ids(tokenizer, [word]) == expected


@pytest.mark.parametrize("output, banned", [
    ([], {7, 9}),  # a one-token word always; the two-token word's prefix (8) is not there
    ([8], {7, 9, 3}), ([1, 8], {7, 9, 3}), ([8, 1], {7, 9}),
    ([4, 5], {7, 9, 6}), ([5], {7, 9}),  # the three-token word needs both of its first tokens
])
def test_ban_rule_looks_at_the_output_tail(output, banned):
    row = torch.zeros(12)
    _ban_bad_words(row, [[7], [9], [8, 3], [4, 5, 6]], output)
    assert {i for i in range(12) if row[i] == float("-inf")} == banned


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, hf):
    prompt_ids = llm.engine.tokenizer.encode(PROMPT + " jumps over the lazy dog")
    out = greedy(llm, prompt_ids, truncate_prompt_tokens=5)
    assert out.prompt_token_ids == prompt_ids[-5:]
    assert out.outputs[0].token_ids == greedy(llm, prompt_ids[-5:]).outputs[0].token_ids
    assert out.outputs[0].token_ids == hf_masked_greedy(hf, prompt_ids[-5:], 12, lambda row, output: None)
    whole = greedy(llm, prompt_ids, truncate_prompt_tokens=-1)  # -1: up to max_model_len, here all of it
    assert whole.prompt_token_ids == prompt_ids


@pytest.mark.parametrize("fields, message", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"allowed_token_ids": [5] * 5000}, "allowed_token_ids: at most"),  # longer than the vocabulary
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": "fox"}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
])
def test_bad_values_are_refused_naming_the_field(llm, fields, message):
    with pytest.raises(ValueError, match=message):
        greedy(llm, PROMPT, **fields)
    assert llm.engine.stats()["used_blocks"] == 0


# --- server -------------------------------------------------------------------------------------------------


def _post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny-chat", "max_tokens": 8, "temperature": 0, **body}, timeout=60)


def _stream(url: str, path: str, **body) -> list[dict]:
    with httpx.stream("POST", url + path, json={"model": "tiny-chat", "max_tokens": 8, "temperature": 0,
                                                "stream": True, **body}, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _same_text(decoded: str, text: str) -> bool:
    """The ids spell the text (a random model's output may end inside a UTF-8 character, which the text
    leaves out and a plain decode writes as U+FFFD)."""
    return decoded.rstrip("\ufffd") == text.rstrip("\ufffd")


def test_completions_return_token_ids(server, llm):  # noqa: F811
    prompt_ids = llm.engine.tokenizer.encode(PROMPT)
    body = _post(server.url, "/v1/completions", prompt=PROMPT, n=2, return_token_ids=True).json()
    expected = greedy(llm, PROMPT, steps=8).outputs[0].token_ids
    for choice in body["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids
        assert choice["token_ids"] == expected
        assert _same_text(llm.engine.tokenizer.decode(choice["token_ids"]), choice["text"])
    chunks = _stream(server.url, "/v1/completions", prompt=PROMPT, return_token_ids=True)
    with_prompt = [c for c in chunks if c["choices"] and "prompt_token_ids" in c["choices"][0]]
    assert len(with_prompt) == 1 and with_prompt[0] is chunks[0]  # in the first chunk only
    assert with_prompt[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == expected
    plain = _post(server.url, "/v1/completions", prompt=PROMPT).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_chat_return_token_ids(server, llm):  # noqa: F811
    messages = [{"role": "user", "content": PROMPT}]
    body = _post(server.url, "/v1/chat/completions", messages=messages, return_token_ids=True).json()
    tokenized = httpx.post(server.url + "/tokenize", json={"model": "tiny-chat", "messages": messages},
                           timeout=30).json()["tokens"]
    assert body["prompt_token_ids"] == tokenized
    token_ids = body["choices"][0]["token_ids"]
    assert len(token_ids) == body["usage"]["completion_tokens"]
    assert _same_text(llm.engine.tokenizer.decode(token_ids), body["choices"][0]["message"]["content"])
    chunks = _stream(server.url, "/v1/chat/completions", messages=messages, return_token_ids=True)
    assert chunks[0]["prompt_token_ids"] == tokenized
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == token_ids


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server):  # noqa: F811
    body = _post(server.url, "/v1/completions", prompt=PROMPT, logprobs=2, return_token_ids=True,
                 return_tokens_as_token_ids=True).json()["choices"][0]
    assert body["logprobs"]["tokens"] == [f"token_id:{t}" for t in body["token_ids"]]
    assert all(key.startswith("token_id:") for top in body["logprobs"]["top_logprobs"] for key in top)
    chat = _post(server.url, "/v1/chat/completions", messages=[{"role": "user", "content": PROMPT}], logprobs=True,
                 top_logprobs=1, return_token_ids=True, return_tokens_as_token_ids=True).json()["choices"][0]
    assert [e["token"] for e in chat["logprobs"]["content"]] == [f"token_id:{t}" for t in chat["token_ids"]]


def test_server_sampling_fields(server, llm):  # noqa: F811
    prompt_ids = llm.engine.tokenizer.encode(PROMPT + " jumps over the lazy dog")
    truncated = _post(server.url, "/v1/completions", prompt=prompt_ids, truncate_prompt_tokens=4,
                      return_token_ids=True).json()
    assert truncated["usage"]["prompt_tokens"] == 4
    assert truncated["choices"][0]["prompt_token_ids"] == prompt_ids[-4:]
    assert truncated["choices"][0]["token_ids"] == greedy(llm, prompt_ids[-4:], steps=8).outputs[0].token_ids
    allowed = _post(server.url, "/v1/completions", prompt=PROMPT, allowed_token_ids=[5, 6, 7],
                    return_token_ids=True).json()
    assert set(allowed["choices"][0]["token_ids"]) <= {5, 6, 7}
    free = _post(server.url, "/v1/completions", prompt=PROMPT, return_token_ids=True).json()["choices"][0]
    word = llm.engine.tokenizer.decode(free["token_ids"][:1])
    banned = _post(server.url, "/v1/completions", prompt=PROMPT, bad_words=[word], return_token_ids=True).json()
    assert free["token_ids"][0] not in banned["choices"][0]["token_ids"]


@pytest.mark.parametrize("fields, param", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"use_beam_search": True, "bad_words": ["fox"]}, "bad_words"),
])
def test_server_refuses_bad_values_naming_the_field(server, fields, param):  # noqa: F811
    response = _post(server.url, "/v1/completions", prompt=PROMPT, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_router_keys_a_truncated_prompt_as_the_worker_keeps_it(llm):
    """cache_aware / kv_events match what the worker will cache: the prompt's last N tokens."""
    from kvserve.router.keys import RequestKeyer

    keyer = RequestKeyer(llm.engine.tokenizer, None)
    ids = llm.engine.tokenizer.encode(PROMPT + " jumps over the lazy dog")
    whole = keyer.key("/v1/completions", {"model": "m", "prompt": PROMPT + " jumps over the lazy dog"}, None)
    cut = keyer.key("/v1/completions", {"model": "m", "prompt": ids, "truncate_prompt_tokens": 3}, None)
    assert whole.tokens == tuple(ids) and cut.tokens == tuple(ids[-3:])
    kept = keyer.key("/v1/completions", {"model": "m", "prompt": ids, "truncate_prompt_tokens": -1}, None)
    assert kept.tokens == tuple(ids)  # -1 keeps up to the worker's context, which the router does not know


def test_masks_that_leave_no_token_fail_that_request_alone(llm):
    """An all -inf row must not sample token 0: a conflict found up front is a ValueError; one found while
    generating (here min_tokens masks the only allowed token, EOS) fails that request with its reason."""
    tokenizer = llm.engine.tokenizer
    single = next(t for t in range(100, 300) if tokenizer.encode(tokenizer.decode([t]).lstrip()) == [t])
    with pytest.raises(ValueError, match="allowed_token_ids: every allowed token is a banned word"):
        greedy(llm, PROMPT, allowed_token_ids=[single], bad_words=[tokenizer.decode([single])])
    eos = min(llm.engine.eos_token_ids)
    stuck, fine = llm.generate([PROMPT, PROMPT], [
        SamplingParams(max_tokens=4, temperature=0.0, allowed_token_ids=[eos], min_tokens=2),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)], use_tqdm=False)
    assert stuck.finish_reason == "error" and "every token is masked" in stuck.error
    assert fine.outputs[0].token_ids == greedy(llm, PROMPT, steps=4).outputs[0].token_ids
    assert llm.engine.stats()["used_blocks"] == 0


def test_server_answers_a_400_when_the_masks_leave_no_token(server, llm):  # noqa: F811
    eos = min(llm.engine.eos_token_ids)
    body = {"prompt": PROMPT, "allowed_token_ids": [eos], "min_tokens": 2}
    response = _post(server.url, "/v1/completions", **body)
    assert response.status_code == 400, response.text
    assert "every token is masked" in response.json()["error"]["message"]
    chunks = _stream(server.url, "/v1/completions", **body)
    assert "every token is masked" in chunks[-1]["error"]["message"]
    assert _post(server.url, "/v1/completions", prompt=PROMPT).status_code == 200  # everyone else goes on


def test_add_special_tokens_puts_the_tokenizers_bos_first():
    """vLLM's completions field: text prompts get the tokenizer's own special tokens (here a post-processor
    that writes `<|im_start|>` first, as a BOS); token-id prompts are taken as sent; the router keys alike."""
    from tokenizers import processors

    from kvserve.model.tokenizer import Tokenizer
    from kvserve.router.keys import RequestKeyer
    from kvserve.server.inputs import completion_prompt_ids
    from test_server_support import make_chat_tokenizer

    backend = make_chat_tokenizer()
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                           special_tokens=[("<|im_start|>", 1)])
    tokenizer = Tokenizer(backend)
    plain = completion_prompt_ids(tokenizer, "the quick fox", 384)[0]
    special = completion_prompt_ids(tokenizer, "the quick fox", 384, add_special_tokens=True)[0]
    assert special == [1, *plain] and plain[0] != 1
    assert completion_prompt_ids(tokenizer, [5, 6], 384, add_special_tokens=True) == [[5, 6]]
    keyer = RequestKeyer(tokenizer, None)
    body = {"model": "m", "prompt": "the quick fox"}
    assert keyer.key("/v1/completions", {**body, "add_special_tokens": True}, None).tokens == tuple(special)
    assert keyer.key("/v1/completions", body, None).tokens == tuple(plain)
