"""OpenAI request → engine inputs: token-id prompts and one SamplingParams per choice.

Everything a caller can get wrong is checked here, before anything reaches the engine, so each
problem is a 400 naming its field: empty or over-long prompts, token ids outside the vocabulary,
a max_tokens that does not fit the context, unsupported options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jinja2

from kvserve.engine.async_engine import EngineInfo
from kvserve.engine.params import SamplingParams
from kvserve.server.errors import ApiError, bad_request, from_engine_value_error
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 64  # prompts × n per HTTP request
_SEED_MODULUS = 2**63


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """Render the conversation with the model's chat template and tokenize it (specials stay special)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template: use /v1/completions", "messages")
    conversation = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as err:
        # Templates reject some conversations themselves (e.g. roles that do not alternate).
        raise bad_request(f"messages cannot be rendered by the chat template: {err}", "messages") from err
    return tokenizer.encode(text)


def completion_prompt_ids(tokenizer: Any, prompt: Any, vocab_size: int) -> list[list[int]]:
    """`prompt` as a list of token-id prompts: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(token, int) for token in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt is empty", "prompt")
    return [_prompt_ids(tokenizer, p, vocab_size) for p in prompts]


def _prompt_ids(tokenizer: Any, prompt: str | list[int], vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
        return tokenizer.encode(prompt)
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    for token_id in prompt:
        if not 0 <= token_id < vocab_size:
            message = f"prompt token id {token_id} is outside the vocabulary [0, {vocab_size})"
            raise bad_request(message, "prompt")
    return prompt


def check_choice_count(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise bad_request(f"{num_prompts} prompts × n={n} exceeds {MAX_CHOICES} choices per request", "n")


def resolve_max_tokens(
    requested: int | None, prompt_lens: Sequence[int], info: EngineInfo, default: int | None,
    prompt_param: str,
) -> int:
    """The max_tokens to use; 400 when a prompt (or prompt + max_tokens) exceeds the context.

    With no request value and no default, take what is left of the context (as vLLM does), capped at
    what the KV pool can hold, so an unset max_tokens never makes a request unrunnable.
    """
    limit = min(info.max_model_len, info.num_blocks * info.block_size)
    longest = max(prompt_lens)
    if longest >= limit:
        raise ApiError(400, f"the prompt has {longest} tokens, but this model's context allows {limit - 1} "
                       "(the rest is for the completion)", prompt_param, "context_length_exceeded")
    max_tokens = requested if requested is not None else default if default is not None else limit - longest
    if longest + max_tokens > info.max_model_len:
        raise ApiError(400, f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                       f"({info.max_model_len})", "max_tokens", "context_length_exceeded")
    return max_tokens


def reject_unsupported(body: SamplingFields) -> None:
    """Options we do not implement are refused rather than silently ignored."""
    if body.presence_penalty:
        raise bad_request("presence_penalty is not supported", "presence_penalty")
    if body.frequency_penalty:
        raise bad_request("frequency_penalty is not supported", "frequency_penalty")
    if isinstance(body, CompletionRequest) and body.echo:
        raise bad_request("echo is not supported", "echo")
    if isinstance(body, CompletionRequest) and body.suffix:
        raise bad_request("suffix is not supported", "suffix")


def choice_params(body: SamplingFields, max_tokens: int, logprobs: int | None) -> list[SamplingParams]:
    """SamplingParams for each of the n choices; choice i samples with seed + i (reproducible, distinct)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        base = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k in (None, 0) else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=body.seed, stop=stop, ignore_eos=body.ignore_eos, logprobs=logprobs,
        )
    except ValueError as err:
        raise from_engine_value_error(err) from err
    if body.seed is None:
        return [dataclasses.replace(base, stop=list(stop)) for _ in range(body.n)]
    seeds = [(body.seed + i) % _SEED_MODULUS for i in range(body.n)]
    return [dataclasses.replace(base, stop=list(stop), seed=seed) for seed in seeds]


def chat_logprobs(body: ChatCompletionRequest) -> int | None:
    """Engine logprobs setting: None (off), or how many alternatives besides the sampled token."""
    if not body.logprobs:
        if body.top_logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        return None
    return body.top_logprobs or 0
