"""Input checks that run before anything is allocated (a salt's are with the namespace, prefix/namespace.py)."""

from __future__ import annotations

from collections.abc import Sequence


def validate_prompt_ids(prompt_ids: Sequence[int], vocab_size: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("prompt is empty")
    for token_id in prompt_ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < vocab_size:
            raise ValueError(f"prompt token id {token_id!r} is outside the vocabulary [0, {vocab_size})")
