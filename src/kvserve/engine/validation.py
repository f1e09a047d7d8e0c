"""Input checks that run before anything is allocated (a salt's are with the namespace, prefix/namespace.py)."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.engine.params import SamplingParams


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
