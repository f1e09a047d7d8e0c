"""The prefix-cache namespace: the one type and the one constructor every entry point uses.

A namespace is a tuple of fields: `()` (no salt), `(cache_salt,)`, or on a server with API keys
`(tenant, cache_salt or "")`. Fields stay separate everywhere (never concatenated), so
`("ab", "c") != ("a", "bc")` and a salt can never spell another tenant's namespace.

A request under a LoRA adapter gets one more, last field `"lora/<adapter id>"` (`with_adapter`): the
same tokens under another adapter are other KV, so the adapter id goes into block 0's hash and picks a
separate radix root. It composes with tenant and salt; no salt can spell it (salts never hold "/").
"""

from __future__ import annotations

Namespace = tuple[str, ...]

MAX_CACHE_SALT_LENGTH = 128
ADAPTER_FIELD_PREFIX = "lora/"
_FORBIDDEN_SALT_CHARS = ("@", "/", "\\", "\x00")


def validate_cache_salt(cache_salt: str) -> None:
    """A salt is a non-empty string of at most 128 characters without ``@ / \\`` or NUL."""
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError("cache_salt must be a non-empty string")
    if len(cache_salt) > MAX_CACHE_SALT_LENGTH:
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_LENGTH} characters")
    if any(char in cache_salt for char in _FORBIDDEN_SALT_CHARS):
        raise ValueError("cache_salt must not contain '@', '/', '\\' or NUL")


def make_namespace(
    cache_salt: str | None = None, tenant: str | None = None, adapter_id: str | None = None
) -> Namespace:
    """The namespace of a request; ValueError (naming cache_salt) for a bad salt.

    Without a tenant: `()` or `(cache_salt,)`. With one: `(tenant, cache_salt or "")`. Under an adapter,
    `with_adapter` of that.
    """
    if cache_salt is not None:
        validate_cache_salt(cache_salt)
    if tenant is None:
        namespace: Namespace = () if cache_salt is None else (cache_salt,)
    else:
        namespace = (tenant, cache_salt or "")
    return namespace if adapter_id is None else with_adapter(namespace, adapter_id)


def with_adapter(namespace: Namespace, adapter_id: str) -> Namespace:
    """`namespace` plus the LoRA adapter field (the adapter's weight digest)."""
    if not adapter_id or "/" in adapter_id:
        raise ValueError(f"adapter id must be a non-empty string without '/', got {adapter_id!r}")
    return (*namespace, ADAPTER_FIELD_PREFIX + adapter_id)
