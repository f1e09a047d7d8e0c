"""KV events for the lower tiers (`attach_tier_events`): host RAM as medium CPU, local disk as DISK,
hashes stripped of the model fingerprint, as vLLM's CPU offloading connector publishes them."""

from __future__ import annotations

import torch

from kvserve.events.engine_hook import MAX_HASHES_PER_BATCH, attach_tier_events
from kvserve.events.format import MEDIUM_CPU, MEDIUM_DISK, BlockRemoved, BlockStored, KVEvent
from kvserve.prefix.hashing import block_hashes
from kvserve.tiers.codec import BlockCodec
from kvserve.tiers.disk import DiskStore
from kvserve.tiers.host import HostStore
from kvserve.tiers.offload import OffloadPolicy
from kvserve.tiers.store import model_fingerprint

BLOCK = 4
FP = model_fingerprint(kv_dtype="float32", block_size=BLOCK, config={"hidden": 64})
OTHER = model_fingerprint(kv_dtype="float32", block_size=BLOCK, config={"hidden": 32})


class FakePublisher:
    """Collects what would be queued for the wire, batch by batch."""

    def __init__(self) -> None:
        self.batches: list[list[KVEvent]] = []

    def publish(self, events: list[KVEvent]) -> None:
        self.batches.append(list(events))

    @property
    def events(self) -> list[KVEvent]:
        return [event for batch in self.batches for event in batch]

    def hashes(self, kind: type, medium: str) -> list[bytes]:
        return [h for e in self.events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]


def hashes(count: int) -> list[bytes]:
    return block_hashes(list(range(count * BLOCK)), BLOCK, ())


def attached(tmp_path, host_blocks: int | None, disk: bool) -> tuple[OffloadPolicy, torch.Tensor, FakePublisher]:
    """`make_policy` with its tiers' events going to a fresh `FakePublisher`."""
    policy, pool = make_policy(tmp_path, host_blocks, disk)
    publisher = FakePublisher()
    attach_tier_events(policy, publisher, BLOCK)
    return policy, pool, publisher


def make_policy(tmp_path, host_blocks: int | None, disk: bool) -> tuple[OffloadPolicy, torch.Tensor]:
    pool = torch.randn(2, 2, 16, BLOCK, 2, 8)
    codec = BlockCodec.for_pool(pool)
    host = HostStore(host_blocks * codec.payload_bytes, pin_memory=False) if host_blocks is not None else None
    disk_store = DiskStore(tmp_path / "disk", 1 << 26, fsync=False) if disk else None
    return OffloadPolicy(codec, FP, host=host, disk=disk_store), pool


def test_host_demotion_and_eviction_are_cpu_events(tmp_path):
    policy, pool, publisher = attached(tmp_path, host_blocks=3, disk=False)
    hs = hashes(5)
    policy.demote(hs[:3], pool, [0, 1, 2])
    assert publisher.events == [BlockStored(hs[:3], None, [], BLOCK, medium=MEDIUM_CPU)]
    policy.demote(hs[3:], pool, [3, 4])  # the host holds 3: the 2 least recent leave it
    assert publisher.events[1:] == [BlockStored(hs[3:], None, [], BLOCK, medium=MEDIUM_CPU),
                                    BlockRemoved(hs[:2], medium=MEDIUM_CPU)]
    policy.close()


def test_host_evictions_reaching_disk_are_disk_events(tmp_path):
    policy, pool, publisher = attached(tmp_path, host_blocks=2, disk=True)
    hs = hashes(4)
    policy.demote(hs, pool, [0, 1, 2, 3])
    policy.flush()  # the disk writer is a background thread
    assert publisher.hashes(BlockStored, MEDIUM_CPU) == hs[2:]  # hs[:2] came and went within the put
    assert publisher.hashes(BlockRemoved, MEDIUM_CPU) == []
    assert publisher.hashes(BlockStored, MEDIUM_DISK) == hs[:2]
    assert all(e.parent_block_hash is None and e.token_ids == [] for e in publisher.events)
    policy.close()


def test_disk_blocks_already_there_are_announced_at_attach_in_bounded_batches(tmp_path):
    count = MAX_HASHES_PER_BATCH + 5
    first, pool = make_policy(tmp_path, host_blocks=None, disk=True)
    hs = hashes(count)
    payload = first.codec.encode_blocks(pool, [0])[0]
    first.disk.put([(key, payload) for key in FP.keys(hs)] + [(OTHER.key(hs[0]), payload)])
    first.close()
    policy, _, publisher = attached(tmp_path, host_blocks=None, disk=True)  # a restart on the same directory
    assert sorted(publisher.hashes(BlockStored, MEDIUM_DISK)) == sorted(hs)  # another model's block is not ours
    assert max(sum(len(e.block_hashes) for e in batch) for batch in publisher.batches) <= MAX_HASHES_PER_BATCH
    assert len(publisher.batches) == 2
    policy.close()


def test_clearing_the_tiers_publishes_their_removals(tmp_path):
    policy, pool, publisher = attached(tmp_path, host_blocks=2, disk=True)
    hs = hashes(3)
    policy.demote(hs, pool, [0, 1, 2])
    policy.flush()
    assert policy.clear_local() == 3
    assert publisher.hashes(BlockRemoved, MEDIUM_CPU) == hs[1:]
    assert publisher.hashes(BlockRemoved, MEDIUM_DISK) == hs[:1]
    policy.close()
