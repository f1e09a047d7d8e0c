"""Feed a publisher from the engine's block manager: BlockStored when full blocks enter the prefix
cache (`BlockManager.on_stored`), BlockRemoved when the cache evicts or resets them (`on_evict`).

Both callbacks run on the engine thread; `KVEventPublisher.publish` only queues, so a step never
waits on the network. A listener already on `on_evict` (the tiered cache) keeps being called first.
"""

from __future__ import annotations

from typing import Any

from kvserve.events.format import BlockRemoved, BlockStored
from kvserve.events.publisher import KVEventPublisher
from kvserve.prefix.base import NoPrefixCache


def attach_kv_events(block_manager: Any, publisher: KVEventPublisher) -> None:
    """Publish `block_manager`'s cache changes on `publisher` from now on (nothing with
    `--prefix-cache off`: no block is ever cached, so none is announced)."""
    block_size = block_manager.block_size
    cache = block_manager.prefix_cache
    if isinstance(cache, NoPrefixCache):
        return
    previous = cache.on_evict

    def stored(hashes: list[bytes], parent: bytes | None, token_ids: list[int]) -> None:
        publisher.publish([BlockStored(list(hashes), parent, list(token_ids), block_size)])

    def evicted(pairs: list[tuple[int, bytes]]) -> None:
        if previous is not None:
            previous(pairs)
        publisher.publish([BlockRemoved([block_hash for _, block_hash in pairs])])

    block_manager.on_stored = stored
    cache.on_evict = evicted
