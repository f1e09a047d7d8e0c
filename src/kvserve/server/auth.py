"""API keys → tenants, and the prefix-cache namespace each request runs in.

Key file (`--api-keys FILE`, TOML or JSON), one entry per key: a tenant name, or a table with
`tenant` and `admin`:

    [keys]
    "sk-alice-1" = "alice"
    "sk-alice-2" = "alice"
    "sk-bob" = "bob"
    "sk-ops" = { tenant = "ops", admin = true }

JSON: `{"keys": {"sk-alice-1": "alice", "sk-ops": {"tenant": "ops", "admin": true}}}`.

Namespaces: with keys, every request of tenant T runs in `(T, cache_salt or "")` -- two separate
fields (the block hash length-prefixes each), so no choice of salt can spell another tenant's
namespace. Without keys (single tenant, as vLLM): `(cache_salt,)` or `()`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.prefix.namespace import Namespace, make_namespace

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: JSON key files only
    tomllib = None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who sent a request: a tenant (None in single-tenant mode) and whether it may administer."""

    tenant: str | None
    is_admin: bool


SINGLE_TENANT = Principal(tenant=None, is_admin=True)  # no keys configured: everyone is trusted


class AuthError(Exception):
    """Missing or unknown API key (401) or a non-admin calling an admin route (403)."""

    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.status = status


class ApiKeys:
    """Key → principal. Keys are stored as SHA-256 digests and looked up by digest, so the lookup
    time does not depend on how many leading characters of a guess are right."""

    def __init__(self, entries: dict[str, Principal]) -> None:
        if not entries:
            raise ValueError("the API key file defines no keys")
        self._by_digest = {_digest(key): principal for key, principal in entries.items()}

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, key: str) -> Principal | None:
        return self._by_digest.get(_digest(key))


OPERATOR = SINGLE_TENANT  # `--api-key`: full access, single-tenant namespace


def add_operator_keys(api_keys: ApiKeys | None, keys: Sequence[str]) -> ApiKeys | None:
    """`api_keys` plus vLLM-style `--api-key` keys (each an OPERATOR); ValueError for a key in both."""
    if not keys:
        return api_keys
    extra = ApiKeys({_checked_key(key, "--api-key"): OPERATOR for key in keys})
    if api_keys is None:
        return extra
    if set(extra._by_digest) & set(api_keys._by_digest):
        raise ValueError("--api-key: a key is also in the --api-keys file; give each key once")
    extra._by_digest.update(api_keys._by_digest)
    return extra


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def load_api_keys(path: str | Path) -> ApiKeys:
    """Read a TOML or JSON key file (by extension; otherwise JSON, then TOML); ValueError if malformed."""
    return ApiKeys(read_key_entries(path))


def read_key_entries(path: str | Path) -> dict[str, Principal]:
    """A key file's entries, key → Principal (the router needs an admin key from it to poll workers)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"cannot read API key file {path}: {err}") from err
    return parse_key_entries(_parse_document(text, path), source=str(path))


def _parse_document(text: str, path: Path) -> Any:
    toml = (tomllib.loads,) if tomllib is not None else ()
    parsers = {".json": (json.loads,), ".toml": toml}.get(path.suffix, (json.loads, *toml))
    last_error: Exception | None = None
    for parse in parsers:
        try:
            return parse(text)
        except ValueError as err:  # JSONDecodeError and TOMLDecodeError are both ValueErrors
            last_error = err
    raise ValueError(f"API key file {path} is neither valid JSON nor TOML: {last_error}")


def parse_key_entries(document: Any, source: str = "API key file") -> dict[str, Principal]:
    """The `keys` table of a parsed key file as key → Principal."""
    keys = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(keys, dict):
        raise ValueError(f"{source}: expected a 'keys' table mapping each key to a tenant")
    return {_checked_key(key, source): _principal_of(key, value, source) for key, value in keys.items()}


def _checked_key(key: str, source: str) -> str:
    if not key or key != key.strip() or any(char.isspace() for char in key):
        raise ValueError(f"{source}: API keys must be non-empty and contain no whitespace")
    return key


def _principal_of(key: str, value: Any, source: str) -> Principal:
    hint = f"{source}: key {key[:4]}…"  # never echo a whole secret into logs
    if isinstance(value, str):
        tenant, admin = value, False
    elif isinstance(value, dict):
        tenant, admin = value.get("tenant"), value.get("admin", False)
        unknown = set(value) - {"tenant", "admin"}
        if unknown:
            raise ValueError(f"{hint}: unknown fields {sorted(unknown)}")
    else:
        raise ValueError(f"{hint}: expected a tenant name or {{tenant = ..., admin = ...}}")
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"{hint}: tenant must be a non-empty string")
    if not isinstance(admin, bool):
        raise ValueError(f"{hint}: admin must be true or false")
    return Principal(tenant=tenant, is_admin=admin)


def authenticate(authorization: str | None, api_keys: ApiKeys | None) -> Principal:
    """The principal behind an `Authorization: Bearer KEY` header; AuthError (401) if none matches."""
    if api_keys is None:
        return SINGLE_TENANT
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise AuthError("missing API key: send 'Authorization: Bearer KEY'")
    principal = api_keys.lookup(key.strip())
    if principal is None:
        raise AuthError("invalid API key")
    return principal


def require_admin(principal: Principal) -> None:
    if not principal.is_admin:
        raise AuthError("this endpoint needs an admin API key", status=403)


def cache_namespace(principal: Principal, cache_salt: str | None) -> Namespace:
    """The prefix-cache namespace of a request; ValueError (naming cache_salt) for a bad salt."""
    return make_namespace(cache_salt, principal.tenant)
