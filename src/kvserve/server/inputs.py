"""OpenAI request → engine inputs: token-id prompts and the params of one engine request per prompt.

Everything a caller can get wrong is checked here, before anything reaches the engine, so each
problem is a 400 naming its field: empty or over-long prompts, token ids outside the vocabulary,
a max_tokens that does not fit the context, unsupported options or combinations of them.

`check_chat_size` / `check_completion_size` refuse an obviously over-long input by its size alone
(UTF-8 bytes, or token count) on the event loop; `chat_prompt_ids` / `completion_prompt_ids` do the
heavy part (templating, tokenizing) and are called on the server's worker pool. Tokenizing goes
through the `tokenizers` batch call, which releases the GIL while it works.

A prompt's n choices are one engine request: `SamplingParams(n=..., best_of=...)` (the prompt is
prefilled once and its blocks shared; choice i samples with seed + i) or, with `use_beam_search`,
`BeamSearchParams(num_return_sequences=n)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2

from kvserve.engine.params import BeamSearchParams, SamplingParams
from kvserve.engine.validation import truncate_prompt
from kvserve.server.constraints import ConstraintError, structured_of
from kvserve.server.errors import ApiError, bad_request, from_engine_value_error
from kvserve.server.limits import MAX_BYTES_PER_TOKEN, max_prompt_bytes
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from kvserve.serving.async_engine import EngineInfo

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SEQUENCES = 64  # prompts × max(n, best_of, beam_width) per HTTP request
_SEED_MODULUS = 2**63  # the engine's member seeds: (seed + i) % 2**63


def chat_prompt_ids(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    """Render the conversation with the chat template (the request's `chat_template`, else the model's)
    and tokenize it (specials stay special). Tools and `chat_template_kwargs` are template variables."""
    template = body.chat_template or getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not template:
        raise bad_request("this model has no chat template: use /v1/completions", "messages")
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    variables = dict(body.chat_template_kwargs or {})
    if body.tools:  # OpenAI shows the model its tools whatever tool_choice says
        variables["tools"] = [tool.model_dump() for tool in body.tools]
    messages = body.template_messages()
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                             chat_template=body.chat_template, **variables)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as err:
        # Templates reject some conversations themselves (e.g. roles that do not alternate).
        raise bad_request(f"messages cannot be rendered by the chat template: {err}", "messages") from err
    if body.continue_final_message:  # end inside the last message, as transformers does
        last = messages[-1]["content"]
        if not last or last not in text:
            raise bad_request("continue_final_message needs a last message with text", "continue_final_message")
        text = text[: text.rindex(last) + len(last)]
    return _encode(tokenizer, text)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    return tokenizer.encode(text, add_special_tokens)  # releases the GIL while it works (see Tokenizer.encode)


def prompt_token_limit(info: EngineInfo) -> int:
    """Tokens a prompt may have at most: the context, or the whole KV pool if that is smaller."""
    return min(info.max_model_len, info.num_blocks * info.block_size)


def check_chat_size(messages: Sequence[ChatMessage], info: EngineInfo) -> None:
    """400 before templating when the messages' text alone could not fit the context."""
    size = sum(_utf8_size(m.text()) + _utf8_size(m.name or "") for m in messages)
    _check_bytes(size, info, "messages")


def _prompt_list(prompt: Any) -> list:
    """A completion's `prompt` as a list of prompts (a text, or a list of token ids, is one prompt)."""
    return [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt


def check_completion_size(body: CompletionRequest, info: EngineInfo) -> None:
    """400 before tokenizing when there are too many prompts × choices, or when a text prompt's bytes
    (or a token-id prompt's length) cannot fit the context."""
    prompts = _prompt_list(body.prompt)
    check_choice_count(max(1, len(prompts)), body)
    limit = prompt_token_limit(info)
    for one in prompts:
        if isinstance(one, str):
            _check_bytes(_utf8_size(one), info, "prompt")
        elif len(truncated(one, body.truncate_prompt_tokens, info)) >= limit:
            raise _too_long(f"the prompt has {len(one)} tokens", limit, "prompt")


def truncated(prompt_ids: list[int], truncate: int | None, info: EngineInfo) -> list[int]:
    """The engine's `truncate_prompt`, here so the server's length checks see what the engine will keep."""
    return truncate_prompt(prompt_ids, truncate, info.max_model_len)


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _check_bytes(size: int, info: EngineInfo, param: str) -> None:
    limit = prompt_token_limit(info)
    if size > max_prompt_bytes(limit):
        raise _too_long(f"the prompt is {size} bytes (more than {MAX_BYTES_PER_TOKEN} per token)", limit, param)


def _too_long(what: str, limit: int, param: str) -> ApiError:
    return ApiError(400, f"{what}, but this model's context allows {limit - 1} tokens (the rest is for the "
                    "completion)", param, "context_length_exceeded")


def completion_prompt_ids(tokenizer: Any, prompt: Any, vocab_size: int, add_special_tokens: bool = False
                          ) -> list[list[int]]:
    """`prompt` as a list of token-id prompts: a string, strings, token ids, or lists of token ids; text with
    the tokenizer's own special tokens (e.g. a BOS) when `add_special_tokens` (vLLM's field)."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(token, int) for token in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt is empty", "prompt")
    return [_prompt_ids(tokenizer, p, vocab_size, add_special_tokens) for p in prompts]


def echo_texts(tokenizer: Any, prompt: Any, prompts_ids: list[list[int]]) -> list[str]:
    """Each prompt's text as echo returns it: a string as sent, token ids decoded (special tokens kept)."""
    sent = prompt if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt) else None
    if isinstance(prompt, str):
        sent = [prompt]
    if sent is not None:
        return list(sent)
    if tokenizer is None:
        return ["".join(f"token_id:{token}" for token in ids) for ids in prompts_ids]
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts_ids]


def _prompt_ids(tokenizer: Any, prompt: str | list[int], vocab_size: int, add_special_tokens: bool) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
        return _encode(tokenizer, prompt, add_special_tokens)
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    for token_id in prompt:
        if not 0 <= token_id < vocab_size:
            message = f"prompt token id {token_id} is outside the vocabulary [0, {vocab_size})"
            raise bad_request(message, "prompt")
    return prompt


def check_choice_count(num_prompts: int, body: SamplingFields) -> None:
    """Bound the sequences one HTTP request runs at once: prompts × the widest of n, best_of, beam_width."""
    width, param = body.n, "n"
    if body.best_of is not None and body.best_of > width:
        width, param = body.best_of, "best_of"
    if isinstance(body, CompletionRequest) and body.use_beam_search and beam_width_of(body) > width:
        width, param = beam_width_of(body), "beam_width"
    if num_prompts * width > MAX_SEQUENCES:
        message = f"{num_prompts} prompts × {param}={width} exceeds {MAX_SEQUENCES} sequences per request"
        raise bad_request(message, param)


def beam_width_of(body: CompletionRequest) -> int:
    """The beams to run: `beam_width`, or n when unset."""
    return body.beam_width if body.beam_width is not None else body.n


def check_group_options(body: SamplingFields) -> None:
    """n / best_of / beam-search combinations the engine cannot run; a 400 naming the field."""
    _check_prompt_scoring(body)
    if isinstance(body, CompletionRequest) and body.use_beam_search:
        _check_beam_search(body)
        return
    if isinstance(body, CompletionRequest):
        for name, default in (("beam_width", None), ("length_penalty", 1.0), ("early_stopping", False)):
            if getattr(body, name) != default:
                raise bad_request(f"{name} needs use_beam_search=true", name)
    if body.best_of is not None and body.best_of < body.n:
        raise bad_request(f"best_of ({body.best_of}) must be >= n ({body.n})", "best_of")
    if body.stream and body.best_of is not None and body.best_of > body.n:
        raise bad_request("best_of > n cannot be streamed: which samples are returned is known only at the "
                          "end", "best_of")


def _check_prompt_scoring(body: SamplingFields) -> None:
    """echo, max_tokens 0 and prompt_logprobs: what they can be combined with."""
    echo = isinstance(body, CompletionRequest) and body.echo
    if body.max_tokens == 0 and not echo:
        raise bad_request("max_tokens 0 needs echo=true (the prompt, scored, is then the whole answer)", "max_tokens")
    for name, asked in (("echo", echo), ("prompt_logprobs", body.prompt_logprobs is not None)):
        if asked and isinstance(body, CompletionRequest) and body.use_beam_search:
            raise bad_request(f"{name} is not supported with use_beam_search", name)
    if body.prompt_logprobs is not None and body.stream:  # as vLLM
        raise bad_request("prompt_logprobs is not supported with stream=true", "prompt_logprobs")


def prompt_logprobs_of(body: SamplingFields) -> int | None:
    """How many alternatives each prompt token's score carries (None: no scores): prompt_logprobs, else
    logprobs when an echoed prompt comes back with log-probs (as vLLM)."""
    if body.prompt_logprobs is not None:
        return body.prompt_logprobs
    if isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None:
        return body.logprobs
    return None


def _check_beam_search(body: CompletionRequest) -> None:
    width = beam_width_of(body)
    if body.n > width:
        raise bad_request(f"n ({body.n}) must be <= beam_width ({width}) with use_beam_search", "n")
    if body.best_of is not None:
        raise bad_request("best_of cannot be combined with use_beam_search (beam_width sets the beams)",
                          "best_of")
    if body.stop:
        raise bad_request("stop strings are not supported with use_beam_search (beams end at EOS or "
                          "max_tokens)", "stop")
    if body.ignore_eos:
        raise bad_request("ignore_eos is not supported with use_beam_search", "ignore_eos")
    if body.logprobs is not None:
        raise bad_request("logprobs is not supported with use_beam_search", "logprobs")
    # Beams are chosen by log-probability, never sampled: sampling settings would be ignored.
    for name, neutral in (("temperature", (None, 0)), ("top_p", (None, 1)), ("top_k", (None, 0, -1)),
                          ("min_p", (None, 0))):
        if getattr(body, name) not in neutral:
            raise bad_request(f"{name} has no effect with use_beam_search (beam search does not sample)",
                              name)
    for name in ("allowed_token_ids", "bad_words"):
        if getattr(body, name) is not None:
            raise bad_request(f"{name} is not supported with use_beam_search", name)


def resolve_max_tokens(
    requested: int | None, prompt_lens: Sequence[int], info: EngineInfo, default: int | None,
    prompt_param: str,
) -> int:
    """The max_tokens to use; 400 when a prompt (or prompt + max_tokens) exceeds the context.

    With no request value and no default, take what is left of the context (as vLLM does), capped at
    what the KV pool can hold, so an unset max_tokens never makes a request unrunnable.
    """
    limit = prompt_token_limit(info)
    longest = max(prompt_lens)
    if longest >= limit:
        raise _too_long(f"the prompt has {longest} tokens", limit, prompt_param)
    max_tokens = requested if requested is not None else default if default is not None else limit - longest
    if longest + max_tokens > info.max_model_len:
        raise ApiError(400, f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                       f"({info.max_model_len})", "max_tokens", "context_length_exceeded")
    return max_tokens


def engine_params(
    body: SamplingFields, max_tokens: int, logprobs: int | None, template: str | None = None
) -> SamplingParams | BeamSearchParams:
    """The params of each prompt's engine request: its n choices (best_of samples, or beams) together.

    Call `check_group_options` first. Choice i of a sampled prompt draws with seed `(seed + i) % 2**63`
    (reproducible, distinct), as separate requests with those seeds would.
    """
    try:
        structured = structured_of(body, template)
    except ConstraintError as err:
        raise bad_request(str(err), err.param) from err
    try:
        if isinstance(body, CompletionRequest) and body.use_beam_search:
            if structured is not None:
                raise bad_request("structured output is not supported with use_beam_search", "use_beam_search")
            return BeamSearchParams(
                beam_width=beam_width_of(body), max_tokens=max_tokens, length_penalty=body.length_penalty,
                early_stopping=body.early_stopping, num_return_sequences=body.n,
            )
        return SamplingParams(
            max_tokens=max(max_tokens, 1),  # 0 (echo): one token is generated and not returned
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k in (None, 0) else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=None if body.seed is None else body.seed % _SEED_MODULUS,
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
            ignore_eos=body.ignore_eos, logprobs=logprobs, n=body.n, best_of=body.best_of,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            min_tokens=body.min_tokens, logit_bias=_logit_bias(body.logit_bias),
            stop_token_ids=list(body.stop_token_ids or []),
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens, structured_outputs=structured,
            prompt_logprobs=prompt_logprobs_of(body), allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words, truncate_prompt_tokens=body.truncate_prompt_tokens,
        )
    except ValueError as err:
        raise from_engine_value_error(err) from err


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's string token ids as ints; 400 naming logit_bias for a key that is not one."""
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None


def chat_logprobs(body: ChatCompletionRequest) -> int | None:
    """Engine logprobs setting: None (off), or how many alternatives besides the sampled token."""
    if not body.logprobs:
        if body.top_logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        return None
    return body.top_logprobs or 0
