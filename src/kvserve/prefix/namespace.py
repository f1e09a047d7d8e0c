"""The prefix-cache namespace: the one type and the one constructor every entry point uses.

A namespace is a tuple of fields: `()` (no salt), `(cache_salt,)`, or on a server with API keys
`(tenant, cache_salt or "")`. Fields stay separate everywhere (never concatenated), so
`("ab", "c") != ("a", "bc")` and a salt can never spell another tenant's namespace.
"""

from __future__ import annotations

Namespace = tuple[str, ...]

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


def make_namespace(cache_salt: str | None = None, tenant: str | None = None) -> Namespace:
    """The namespace of a request; ValueError (naming cache_salt) for a bad salt.

    Without a tenant: `()` or `(cache_salt,)`. With one: `(tenant, cache_salt or "")`.
    """
    if cache_salt is not None:
        validate_cache_salt(cache_salt)
    if tenant is None:
        return () if cache_salt is None else (cache_salt,)
    return (tenant, cache_salt or "")
