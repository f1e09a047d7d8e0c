"""Chained block hashes: the cross-process key of a block of KV.

A block hash names one full block of tokens *together with everything before it*:

    h_{-1} = SEED[algo]
    h_i    = H(h_{i-1}, tokens of block i, extra_i)

`extra_0` holds the namespace fields (tenant salt, request `cache_salt`); `extra_i` is empty for
i > 0 (a slot for later per-block keys). Because of the chaining, equal h_i means equal tokens 0..i and
equal namespace (up to collisions of H). The host/disk/remote tiers and the router recompute these
hashes in other processes, so the byte encoding below is a contract: change it only together with
`SEED_LABEL` (a new version suffix), never silently.

Canonical input of H for one block (all integers unsigned little-endian):

    parent       digest_size bytes   h_{i-1}; the seed for block 0
    num_tokens   4 bytes (u32)
    tokens       4 bytes (u32) each
    num_extra    4 bytes (u32)
    per extra field:
      length     4 bytes (u32)       length of the UTF-8 bytes
      utf8       `length` bytes

Fields are length-prefixed, never concatenated, so ("ab", "c") and ("a", "bc") differ, and so do
() and ("",).

Algorithms:
- "sha256" (default): H = SHA-256 of the encoding, 32-byte digests; SEED = sha256(SEED_LABEL).
- "xxhash": H = XXH3-128 (seed 0) of the same encoding, 16-byte digests (big-endian canonical form,
  `xxh3_128_digest`); SEED = xxh3_128(SEED_LABEL). Faster, not cryptographic.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from enum import StrEnum

import xxhash

from kvserve.prefix.base import Namespace

SEED_LABEL = b"kvserve-block-hash-v1"

_U32 = struct.Struct("<I")


class HashFunction(StrEnum):
    """Which H to chain; the string values are what the config and CLI accept."""

    SHA256 = "sha256"
    XXHASH = "xxhash"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_DIGESTS: dict[HashFunction, Callable[[bytes], bytes]] = {
    HashFunction.SHA256: _sha256,
    HashFunction.XXHASH: xxhash.xxh3_128_digest,
}
_SEEDS: dict[HashFunction, bytes] = {algo: digest(SEED_LABEL) for algo, digest in _DIGESTS.items()}


def digest_size(algo: HashFunction | str = HashFunction.SHA256) -> int:
    """Length in bytes of every hash (and of the seed) for `algo`."""
    return len(_SEEDS[HashFunction(algo)])


def seed_hash(algo: HashFunction | str = HashFunction.SHA256) -> bytes:
    """h_{-1}: the parent of block 0."""
    return _SEEDS[HashFunction(algo)]


def encode_block(parent: bytes, token_ids: Sequence[int], extra: tuple[str, ...] = ()) -> bytes:
    """The canonical byte string that H digests (see the module docstring)."""
    parts = [parent, _U32.pack(len(token_ids)), struct.pack(f"<{len(token_ids)}I", *token_ids)]
    parts.append(_U32.pack(len(extra)))
    for field in extra:
        data = field.encode("utf-8")
        parts.append(_U32.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def hash_block(
    parent: bytes | None,
    token_ids: Sequence[int],
    extra: tuple[str, ...] = (),
    algo: HashFunction | str = HashFunction.SHA256,
) -> bytes:
    """h_i from h_{i-1} (`parent`; None for block 0, meaning the seed), block i's tokens and extra."""
    algo = HashFunction(algo)
    if parent is None:
        parent = _SEEDS[algo]
    elif len(parent) != len(_SEEDS[algo]):
        raise ValueError(f"parent hash must be {len(_SEEDS[algo])} bytes for {algo.value}, got {len(parent)}")
    return _DIGESTS[algo](encode_block(parent, token_ids, extra))


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    namespace: Namespace,
    algo: HashFunction | str = HashFunction.SHA256,
) -> None:
    """Append to `hashes` the hash of every full block of `token_ids` it does not cover yet.

    Incremental: `hashes` is a request's running list; call again as its tokens grow and only the
    newly completed blocks are hashed. A trailing partial block is never hashed.
    """
    algo = HashFunction(algo)
    digest = _DIGESTS[algo]
    start, num_full = len(hashes), len(token_ids) // block_size
    if start == 0 and num_full > 0:
        hashes.append(hash_block(None, token_ids[:block_size], tuple(namespace), algo))
        start = 1
    # Blocks after the first have no extra fields: the fixed parts of their encoding are hoisted out
    # of the loop (same bytes as `encode_block`, fewer Python calls per block).
    count, pack, no_extra = _U32.pack(block_size), struct.Struct(f"<{block_size}I").pack, _U32.pack(0)
    for i in range(start, num_full):
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(digest(b"".join((hashes[i - 1], count, pack(*tokens), no_extra))))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    namespace: Namespace,
    algo: HashFunction | str = HashFunction.SHA256,
) -> list[bytes]:
    """Hashes of all full blocks of `token_ids` at once."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size, namespace, algo)
    return hashes
