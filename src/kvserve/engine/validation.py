"""Input checks that run before anything is allocated."""

from __future__ import annotations

from collections.abc import Sequence

MAX_CACHE_SALT_LENGTH = 128
_FORBIDDEN_SALT_CHARS = ("@", "/", "\\", "\x00")


def validate_cache_salt(cache_salt: str) -> None:
    """A salt is a non-empty string of at most 128 characters without ``@ / \\`` or NUL."""
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError("cache_salt must be a non-empty string")
    if len(cache_salt) > MAX_CACHE_SALT_LENGTH:
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_LENGTH} characters")
    if any(char in cache_salt for char in _FORBIDDEN_SALT_CHARS):
        raise ValueError("cache_salt must not contain '@', '/', '\\' or NUL")


def namespace_for(cache_salt: str | None) -> tuple[str, ...]:
    """The prefix-cache namespace of a Python-API request: () without salt, (salt,) with one."""
    if cache_salt is None:
        return ()
    validate_cache_salt(cache_salt)
    return (cache_salt,)


def validate_prompt_ids(prompt_ids: Sequence[int], vocab_size: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("prompt is empty")
    for token_id in prompt_ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < vocab_size:
            raise ValueError(f"prompt token id {token_id!r} is outside the vocabulary [0, {vocab_size})")
