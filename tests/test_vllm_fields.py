"""No silent ignores: every request field of OpenAI's chat and completions APIs and vLLM's extra fields
is either implemented (a field of the request model, answered 200) or refused (a 400 whose `param`
names it). The lists are written from OpenAI's API reference and vLLM's `protocol.py`.
"""

from __future__ import annotations

import httpx
import pytest

from kvserve.server import request_fields
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

OPENAI_CHAT = [
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
]
OPENAI_COMPLETIONS = [
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
]
VLLM_COMMON = [
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "bad_words", "add_special_tokens", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
    "vllm_xargs", "response_format", "best_of",
]
VLLM_CHAT = VLLM_COMMON + [
    "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "include_reasoning",
]
VLLM_COMPLETIONS = VLLM_COMMON + ["prompt_embeds", "beam_width", "early_stopping"]

TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}}}
# A value other than "absent" for each field, with the companions it needs to be valid on its own.
SAMPLES = {
    "audio": {"audio": {"voice": "alloy", "format": "mp3"}}, "frequency_penalty": {"frequency_penalty": 0.5},
    "function_call": {"function_call": "auto"}, "functions": {"functions": [TOOL["function"]]},
    "logit_bias": {"logit_bias": {"5": 2}}, "logprobs": None, "max_completion_tokens": {"max_completion_tokens": 2},
    "max_tokens": {"max_tokens": 2}, "metadata": {"metadata": {"k": "v"}}, "modalities": {"modalities": ["audio"]},
    "n": {"n": 2}, "parallel_tool_calls": {"parallel_tool_calls": False},
    "prediction": {"prediction": {"type": "content", "content": "x"}}, "presence_penalty": {"presence_penalty": 0.5},
    "prompt_cache_key": {"prompt_cache_key": "k"}, "reasoning_effort": {"reasoning_effort": "low"},
    "response_format": {"response_format": {"type": "json_object"}}, "safety_identifier": {"safety_identifier": "u"},
    "seed": {"seed": 3}, "service_tier": {"service_tier": "flex"}, "stop": {"stop": ["\n"]}, "store": {"store": True},
    "stream": {"stream": True}, "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "temperature": {"temperature": 0.5}, "tool_choice": {"tools": [TOOL], "tool_choice": "required"},
    "tools": {"tools": [TOOL], "tool_choice": "required"}, "top_logprobs": None, "top_p": {"top_p": 0.5},
    "user": {"user": "u-1"}, "verbosity": {"verbosity": "low"},
    "web_search_options": {"web_search_options": {}}, "best_of": {"best_of": 2},
    "echo": {"echo": True}, "suffix": {"suffix": "end"}, "use_beam_search": {"use_beam_search": True},
    "top_k": {"top_k": 5}, "min_p": {"min_p": 0.1}, "repetition_penalty": {"repetition_penalty": 1.2},
    "length_penalty": {"length_penalty": 0.5}, "stop_token_ids": {"stop_token_ids": [5]},
    "include_stop_str_in_output": {"include_stop_str_in_output": True}, "ignore_eos": {"ignore_eos": True},
    "min_tokens": {"min_tokens": 1}, "skip_special_tokens": {"skip_special_tokens": False},
    "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 4}, "prompt_logprobs": {"prompt_logprobs": 1},
    "allowed_token_ids": {"allowed_token_ids": [5, 6]}, "bad_words": {"bad_words": ["x"]},
    "add_special_tokens": {"add_special_tokens": True},
    "structured_outputs": {"structured_outputs": {"choice": ["a", "b"]}}, "guided_json": {"guided_json": {"enum": [1]}},
    "guided_regex": {"guided_regex": "[ab]"}, "guided_choice": {"guided_choice": ["a"]},
    "guided_grammar": {"guided_grammar": 'root ::= "a"'}, "guided_decoding_backend": {"guided_decoding_backend": "x"},
    "guided_whitespace_pattern": {"guided_whitespace_pattern": " "}, "priority": {"priority": 1},
    "request_id": {"request_id": "r-1"}, "logits_processors": {"logits_processors": ["x"]},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True}, "return_token_ids": {"return_token_ids": True},
    "cache_salt": {"cache_salt": "salt"}, "kv_transfer_params": {"kv_transfer_params": {}},
    "vllm_xargs": {"vllm_xargs": {"a": 1}}, "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {"continue_final_message": True, "add_generation_prompt": False,
                               "messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "Hello"}]},
    "documents": {"documents": [{"text": "d"}]}, "chat_template": {"chat_template": "{{ messages[0]['content'] }}"},
    "chat_template_kwargs": {"chat_template_kwargs": {"x": 1}}, "mm_processor_kwargs": {"mm_processor_kwargs": {}},
    "include_reasoning": {"include_reasoning": False}, "prompt_embeds": {"prompt_embeds": "AAAA"},
    "beam_width": {"use_beam_search": True, "beam_width": 2}, "early_stopping": {"use_beam_search": True,
                                                                                  "early_stopping": True},
}
CHAT_SAMPLES = {**SAMPLES, "logprobs": {"logprobs": True}, "top_logprobs": {"logprobs": True, "top_logprobs": 2}}
COMPLETION_SAMPLES = {**SAMPLES, "logprobs": {"logprobs": 2},
                      "length_penalty": {"use_beam_search": True, "length_penalty": 0.5}}
NEEDS_SERVER_FLAG = {"priority": "needs priority scheduling"}  # the shared server runs fcfs
CHAT_BASE = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION_BASE = {"model": "tiny-chat", "prompt": "hi", "max_tokens": 2}
CASES = (
    [("/v1/chat/completions", name, ChatCompletionRequest, request_fields.CHAT)
     for name in dict.fromkeys(OPENAI_CHAT + VLLM_CHAT)]
    + [("/v1/completions", name, CompletionRequest, request_fields.COMPLETION)
       for name in dict.fromkeys(OPENAI_COMPLETIONS + VLLM_COMPLETIONS)]
)


@pytest.fixture(scope="module")
def server(vllm_chat_server):
    return vllm_chat_server[0]


@pytest.mark.parametrize("path, name, model, refused", CASES,
                         ids=[f"{c[0].removeprefix('/v1/')}:{c[1]}" for c in CASES])
def test_each_field_is_implemented_or_refused(server, path, name, model, refused):
    implemented = name in model.model_fields or any(f.alias == name for f in model.model_fields.values())
    assert implemented != (name in refused), f"{name}: implemented={implemented}, refused={name in refused}"
    if name in ("model", "messages", "prompt"):
        return
    base = CHAT_BASE if path.endswith("chat/completions") else COMPLETION_BASE
    samples = CHAT_SAMPLES if path.endswith("chat/completions") else COMPLETION_SAMPLES
    response = httpx.post(server.url + path, json={**base, **samples[name]}, timeout=60)
    if name in NEEDS_SERVER_FLAG:  # implemented, and refused naming itself on a server without the flag
        assert response.status_code == 400 and response.json()["error"]["param"] == name, response.text
        assert NEEDS_SERVER_FLAG[name] in response.json()["error"]["message"]
    elif implemented:
        assert response.status_code == 200, (name, response.text)
    else:
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["param"] == name
        assert "not supported" in response.json()["error"]["message"]


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT_BASE), ("/v1/completions", COMPLETION_BASE)])
def test_unknown_fields_are_refused(server, path, base):
    response = httpx.post(server.url + path, json={**base, "frobnicate": 1}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "frobnicate"
    neutral = httpx.post(server.url + path, json={**base, "priority": 0, "store": False}, timeout=30)
    assert neutral.status_code == 200, neutral.text  # a refused field at its neutral value is fine


def test_request_bodies_are_in_the_openapi_schema(server):
    schema = httpx.get(server.url + "/openapi.json", timeout=10).json()
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["title"] == model
        assert {"model", "max_tokens", "logit_bias", "structured_outputs", "response_format"} <= set(body["properties"])
        assert "$ref" not in str(body)
