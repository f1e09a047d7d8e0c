"""Input checks that run before anything is allocated (a salt's are with the namespace, prefix/namespace.py)."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.engine.params import SamplingParams
from kvserve.model.tokenizer import Tokenizer


def validate_prompt_ids(prompt_ids: Sequence[int], vocab_size: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("prompt is empty")
    for token_id in prompt_ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < vocab_size:
            raise ValueError(f"prompt token id {token_id!r} is outside the vocabulary [0, {vocab_size})")


def validate_token_params(params: SamplingParams, vocab_size: int, tokenizer: Tokenizer | None) -> None:
    """Token ids named by sampling params (logit_bias, stop_token_ids, allowed_token_ids) must be in the
    vocabulary; `bad_words` become token ids here (`params.bad_words_token_ids`), with this tokenizer."""
    named = (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids),
             ("allowed_token_ids", params.allowed_token_ids or []))
    for name, ids in named:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name}: token ids must be in [0, {vocab_size}), got {bad[0]}")
    if len(params.allowed_token_ids or ()) > vocab_size:
        raise ValueError(f"allowed_token_ids: at most the vocabulary's {vocab_size} ids")
    params.bad_words_token_ids = bad_words_token_ids(tokenizer, params.bad_words) if params.bad_words else None
    always_banned = {word[0] for word in params.bad_words_token_ids or [] if len(word) == 1}
    if params.allowed_token_ids is not None and set(params.allowed_token_ids) <= always_banned:
        raise ValueError("allowed_token_ids: every allowed token is a banned word (bad_words): nothing could be "
                         "generated")


def bad_words_token_ids(tokenizer: Tokenizer | None, words: Sequence[str]) -> list[list[int]]:
    """vLLM's tokenization of `bad_words`: each word (left-stripped) alone, and after a space when that
    spells it with a different first token but as many tokens (mid-sentence, as a BPE vocabulary writes
    it); a word's last token is banned wherever the output ends with the tokens before it."""
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer; this model has none")
    variants: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip())
        spaced = tokenizer.encode(" " + word.lstrip())
        variants.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            variants.append(spaced)
    return variants


def prompt_ids_of(tokenizer: Tokenizer | None, prompt: str | Sequence[int], params: object, vocab_size: int,
                  max_model_len: int) -> list[int]:
    """A prompt's token ids, left-truncated as `params.truncate_prompt_tokens` asks (-1: to max_model_len),
    each in the vocabulary."""
    prompt_ids = truncate_prompt(encode_prompt(tokenizer, prompt), getattr(params, "truncate_prompt_tokens", None),
                                 max_model_len)
    validate_prompt_ids(prompt_ids, vocab_size)
    return prompt_ids


def truncate_prompt(prompt_ids: list[int], truncate: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last N tokens (-1: the last max_model_len); all of it
    when None. A prompt that still does not fit is refused afterwards, as any other."""
    if truncate is None:
        return prompt_ids
    return prompt_ids[-(max_model_len if truncate == -1 else truncate):]


def encode_prompt(tokenizer: Tokenizer | None, prompt: str | Sequence[int]) -> list[int]:
    """A prompt's token ids: text through the tokenizer, ids as given."""
    if not isinstance(prompt, str):
        return list(prompt)
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass the prompt as token ids")
    if not prompt:
        raise ValueError("prompt is empty")
    return tokenizer.encode(prompt)


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int, num_blocks: int) -> None:
    """ValueError unless prompt + max_tokens fit the context and the whole pool could hold them."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"max_model_len ({max_model_len})"
        )
    num_blocks_needed = -(-total // block_size)
    if num_blocks_needed > num_blocks:
        raise ValueError(
            f"request needs {num_blocks_needed} KV blocks but the whole pool has "
            f"{num_blocks}; lower max_tokens or raise --kv-cache-memory"
        )


PRIORITY_RANGE = (-(2**31), 2**31 - 1)


def check_priority(priority: object, schedule_policy: str) -> int:
    """A request's `priority` (an int; lower runs first): any value under the priority policy, only 0
    otherwise (vLLM refuses it the same way rather than ignore it)."""
    low, high = PRIORITY_RANGE
    if not isinstance(priority, int) or isinstance(priority, bool) or not low <= priority <= high:
        raise ValueError(f"priority must be an integer from {low} to {high}, got {priority!r}")
    if priority and schedule_policy != "priority":
        raise ValueError(f"priority {priority} needs priority scheduling (schedule_policy='priority'; this engine "
                         f"runs {schedule_policy!r})")
    return priority
