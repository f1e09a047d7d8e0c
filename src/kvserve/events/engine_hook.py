"""Feed a publisher from the engine's block manager: BlockStored when full blocks enter the prefix
cache (`BlockManager.on_stored`), BlockRemoved when the cache evicts or resets them (`on_evict`); and,
with `attach_tier_events`, the same for the host (medium CPU) and disk (medium DISK) tiers, as vLLM's
CPU offloading connector does: a device eviction demotes a block to host RAM, where the worker can
load it back with a memcpy, so a router that heard only the GPU BlockRemoved would think it gone.

The device callbacks run on the engine thread, the tiers' under their store's lock (from the engine
thread or a tier's writer / loader thread); `KVEventPublisher.publish` only queues, so neither a step
nor a store ever waits on the network. A listener already on `on_evict` (the tiered cache) keeps
being called, after the GPU BlockRemoved is queued: the demotion it causes is then reported after the
device copy's removal, so even a consumer that drops a block on any BlockRemoved ends up with the tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvserve.events.format import MEDIUM_CPU, MEDIUM_DISK, BlockRemoved, BlockStored, KVEvent
from kvserve.events.publisher import KVEventPublisher
from kvserve.prefix.base import NoPrefixCache
from kvserve.tiers.store import BlockKey, ChangeListener

if TYPE_CHECKING:
    from kvserve.tiers.offload import OffloadPolicy  # the type only: the hook needs its stores, not its code

MAX_HASHES_PER_BATCH = 1024  # block hashes in one tier-event message


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
        publisher.publish([BlockRemoved([block_hash for _, block_hash in pairs])])
        if previous is not None:
            previous(pairs)

    block_manager.on_stored = stored
    cache.on_evict = evicted


def attach_tier_events(policy: OffloadPolicy, publisher: KVEventPublisher, block_size: int) -> None:
    """Publish the host (CPU) and disk (DISK) tiers' key changes for this policy's model on `publisher`
    from now on, as vLLM's offloading connector does (BlockStored without parent or tokens). The disk
    blocks already there (a disk tier survives restarts) are announced first."""
    digest = policy.fingerprint.digest
    if policy.host is not None:
        policy.host.on_change = _tier_listener(publisher, digest, block_size, MEDIUM_CPU)
    if policy.disk is not None:
        policy.disk.watch(_tier_listener(publisher, digest, block_size, MEDIUM_DISK))


def _tier_listener(publisher: KVEventPublisher, digest: bytes, block_size: int, medium: str) -> ChangeListener:
    """A store's `on_change` publishing its keys of model `digest`, stripped to the chained hashes that
    GPU events carry (another model's keys in a shared disk directory are not this worker's blocks)."""

    def changed(added: list[BlockKey], removed: list[BlockKey]) -> None:
        events: list[BlockStored | BlockRemoved] = []
        for hashes in _chunks(_strip(added, digest)):
            events.append(BlockStored(hashes, None, [], block_size, medium=medium))
        for hashes in _chunks(_strip(removed, digest)):
            events.append(BlockRemoved(hashes, medium=medium))
        for batch in _batches(events):
            publisher.publish(batch)

    return changed


def _strip(keys: Sequence[BlockKey], digest: bytes) -> list[bytes]:
    return [key[len(digest) :] for key in keys if key.startswith(digest)]


def _chunks(hashes: list[bytes]) -> list[list[bytes]]:
    return [hashes[i : i + MAX_HASHES_PER_BATCH] for i in range(0, len(hashes), MAX_HASHES_PER_BATCH)]


def _batches(events: list[BlockStored | BlockRemoved]) -> list[list[KVEvent]]:
    """Events grouped into batches of at most `MAX_HASHES_PER_BATCH` hashes (one message each, in order):
    a disk tier announced at start may hold 10^5 blocks, which would make one message of megabytes."""
    batches: list[list[KVEvent]] = []
    size = MAX_HASHES_PER_BATCH
    for event in events:
        if size + len(event.block_hashes) > MAX_HASHES_PER_BATCH:
            batches.append([])
            size = 0
        batches[-1].append(event)
        size += len(event.block_hashes)
    return batches
