"""The one interface every KV tier implements, the keys it is addressed by, and the model fingerprint.

A tier (host RAM, local disk, Redis) stores opaque block payloads (see `codec.py`) under a `BlockKey`:

    BlockKey = fingerprint (16 bytes) ‖ chained block hash (16 or 32 bytes)

The chained hash (`prefix/hashing.py`) already names the block's tokens, every token before it, and the
namespace (tenant, cache_salt) folded into block 0. The fingerprint names everything else a payload
depends on: the weights, the KV dtype, the block size and the pool layout. So a payload written by one
model, dtype, block size, layout or tenant can never be read back into another: the key differs.
Tiers know keys and bytes, never requests (`design.md`, "The second round").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

# Bump when the byte layout of a stored block changes (pool axis order, header format): old payloads
# then have other keys and are never read back.
KV_LAYOUT_VERSION = 1
FINGERPRINT_BYTES = 16

BlockKey = bytes
"""fingerprint ‖ chained block hash; build one with `ModelFingerprint.key`."""

ChangeListener = Callable[[list[BlockKey], list[BlockKey]], None]
"""`(added, removed)`: keys that became present in a store and keys that left it (evicted, deleted,
found gone): the net change of one store operation (the lists are disjoint, and not both empty).

A store calls it while holding its lock, so calls arrive in the order the changes happened and a
consumer can mirror the store's key set exactly (KV events for the host and disk tiers,
`events/engine_hook.attach_tier_events`). Hence it must be cheap (queue, never do I/O), must not raise,
and must never call back into the store (its lock is held: that would deadlock)."""


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """The 16-byte prefix of every key a model's engine reads or writes."""

    digest: bytes

    def __post_init__(self) -> None:
        if len(self.digest) != FINGERPRINT_BYTES:
            raise ValueError(f"a fingerprint is {FINGERPRINT_BYTES} bytes, got {len(self.digest)}")

    def key(self, block_hash: bytes) -> BlockKey:
        return self.digest + block_hash

    def keys(self, block_hashes: Sequence[bytes]) -> list[BlockKey]:
        return [self.digest + h for h in block_hashes]

    def hex(self) -> str:
        return self.digest.hex()


def model_fingerprint(
    *,
    kv_dtype: str,
    block_size: int,
    weights_digest: str | None = None,
    config: Mapping[str, Any] | None = None,
    tensor_shapes: Mapping[str, Sequence[int]] | None = None,
    layout_version: int = KV_LAYOUT_VERSION,
    adapter_digest: str | None = None,
) -> ModelFingerprint:
    """Digest of what a KV block's bytes depend on besides its tokens.

    Give `weights_digest` (see `file_digest`) when the weights file is at hand and hashing it is
    affordable, else `config` + `tensor_shapes` (the architecture; two checkpoints with equal config and
    shapes but other weights would collide, so prefer the digest for fine-tuned variants).
    """
    if weights_digest is None and config is None:
        raise ValueError("model_fingerprint needs weights_digest or config (+ tensor_shapes)")
    document = {
        "layout_version": layout_version,
        "kv_dtype": str(kv_dtype),
        "block_size": int(block_size),
        "weights_digest": weights_digest,
        "config": dict(config) if config is not None else None,
        "tensor_shapes": {k: list(v) for k, v in sorted((tensor_shapes or {}).items())},
        "adapter_digest": adapter_digest,
    }
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), default=str).encode()
    return ModelFingerprint(hashlib.sha256(canonical).digest()[:FINGERPRINT_BYTES])


def file_digest(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    """SHA-256 of a file's bytes, hex (streamed; a 270 MB GGUF takes about a second)."""
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            sha.update(chunk)
    return sha.hexdigest()


@dataclass(slots=True)
class ChangeSet:
    """The net key changes of one store operation, for its `ChangeListener`: a key added then evicted by
    the same operation was never visible outside the lock, so it is reported in neither list."""

    added: dict[BlockKey, None] = field(default_factory=dict)  # dicts: ordered sets
    removed: dict[BlockKey, None] = field(default_factory=dict)

    def add(self, key: BlockKey) -> None:
        """`key` became present (the caller knows it was absent just before)."""
        if key in self.removed:  # gone and back within the operation: no change
            del self.removed[key]
        else:
            self.added[key] = None

    def remove(self, key: BlockKey) -> None:
        """`key`, present just before, is gone."""
        if key in self.added:  # added and evicted within the operation: never seen
            del self.added[key]
        else:
            self.removed[key] = None

    def report(self, listener: ChangeListener | None) -> None:
        """Call `listener` with the net change, unless there is none (call it under the store's lock)."""
        if listener is not None and (self.added or self.removed):
            listener(list(self.added), list(self.removed))


@dataclass(slots=True)
class TierStats:
    """Counters of one tier; `blocks`/`bytes` are what it holds now, the rest count since start."""

    name: str
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int | None = None  # None: the tier manages its own memory (Redis maxmemory)
    hits: int = 0  # blocks returned by get
    misses: int = 0  # keys asked for by get and not returned
    puts: int = 0  # blocks stored
    evictions: int = 0  # blocks dropped to stay within the budget
    errors: int = 0  # failed operations, corrupt or unreadable blocks
    extra: dict[str, Any] = field(default_factory=dict)  # tier-specific (breaker state, drops...)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class BlockStore(Protocol):
    """A key → payload store of KV blocks. Batched: every call takes a list of keys.

    Safety rule: a store returns either the exact bytes that were `put` under a key or nothing; a
    damaged or unreadable entry is dropped and reported as missing, never returned.
    Every method is thread-safe (the offload policy calls stores from its background threads).
    """

    name: str

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading `keys` are present (stops at the first missing one)."""
        ...

    def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """The payload of each key, None where missing or damaged. Counts as an access for LRU."""
        ...

    def put(self, items: Sequence[tuple[BlockKey, bytes]]) -> None:
        """Store each (key, payload), replacing an existing one; may evict others to stay in budget."""
        ...

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Drop each key present; missing keys are ignored."""
        ...

    def stats(self) -> TierStats: ...

    def check_invariants(self) -> None:
        """Raise AssertionError when internal accounting is inconsistent (tests and debug runs)."""
        ...

    def close(self) -> None: ...
