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


def validate_token_params(params: SamplingParams, vocab_size: int) -> None:
    """Token ids named by sampling params (logit_bias, stop_token_ids) must be in the vocabulary."""
    for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name}: token ids must be in [0, {vocab_size}), got {bad[0]}")


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
