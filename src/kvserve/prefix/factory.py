"""`--prefix-cache radix|hash|off` -> a PrefixCache; the one list of cache kinds and hash kinds.

`off` is NoPrefixCache: the only switch (the block manager and scheduler never ask whether caching is on).
"""

from __future__ import annotations

from kvserve.kv.block_allocator import BlockAllocator
from kvserve.prefix.base import NoPrefixCache, PrefixCache
from kvserve.prefix.hashed import HashCache
from kvserve.prefix.hashing import HashFunction
from kvserve.prefix.policies import DEFAULT_EVICTION, make_policy
from kvserve.prefix.radix import RadixCache

PREFIX_CACHE_KINDS = ("radix", "hash", "off")
PREFIX_HASH_KINDS = tuple(algo.value for algo in HashFunction)


def make_prefix_cache(
    kind: str, allocator: BlockAllocator, block_size: int, hash_algo: HashFunction | str = "sha256",
    eviction: str = DEFAULT_EVICTION,
) -> PrefixCache:
    """Build the prefix cache named `kind` evicting by `eviction`; ValueError for an unknown kind,
    hash algorithm or policy."""
    algo = HashFunction(hash_algo)  # validated for every kind: the engine hashes prompts regardless
    policy = make_policy(eviction)
    if kind == "radix":
        return RadixCache(allocator, block_size, policy=policy)
    if kind == "hash":
        return HashCache(allocator, block_size, algo, policy=policy)
    if kind == "off":
        return NoPrefixCache(allocator, block_size)
    raise ValueError(f"unknown prefix cache {kind!r}; expected one of {', '.join(PREFIX_CACHE_KINDS)}")
