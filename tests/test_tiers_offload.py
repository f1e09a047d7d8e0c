"""OffloadPolicy: demotion down the tiers, contiguous lookup, background loads, promotion, isolation."""

from __future__ import annotations

import pytest
import torch

from kvserve.prefix.hashing import block_hashes
from kvserve.tiers.codec import BlockCodec
from kvserve.tiers.disk import DiskStore
from kvserve.tiers.host import HostStore
from kvserve.tiers.offload import OffloadPolicy
from kvserve.tiers.redis import RedisStore
from kvserve.tiers.store import model_fingerprint

BLOCK = 4
FP = model_fingerprint(kv_dtype="float32", block_size=BLOCK, config={"hidden": 64})


@pytest.fixture
def pool() -> torch.Tensor:
    return torch.randn(2, 2, 16, BLOCK, 2, 8)


def hashes(count: int, namespace: tuple[str, ...] = ()) -> list[bytes]:
    return block_hashes(list(range(count * BLOCK)), BLOCK, namespace)


def make_policy(pool, tmp_path, host_blocks=None, disk=False, redis_url=None, fingerprint=FP) -> OffloadPolicy:
    codec = BlockCodec.for_pool(pool)
    host = HostStore(host_blocks * codec.payload_bytes) if host_blocks is not None else None
    disk_store = DiskStore(tmp_path / "disk", 1 << 26) if disk else None
    remote = RedisStore(redis_url) if redis_url else None
    return OffloadPolicy(codec, fingerprint, host=host, disk=disk_store, remote=remote)


def same_blocks(loaded: list[torch.Tensor], pool: torch.Tensor, block_ids: list[int]) -> bool:
    return len(loaded) == len(block_ids) and all(
        torch.equal(block, pool[:, :, b]) for block, b in zip(loaded, block_ids, strict=True)
    )


def test_demotion_cascades_host_to_disk_and_loads_back_exact(pool, tmp_path):
    policy = make_policy(pool, tmp_path, host_blocks=3, disk=True)
    hs = hashes(6)
    policy.demote(hs, pool, list(range(6)))  # host keeps the 3 most recent, the rest go to disk
    policy.flush()
    found = policy.lookup(hs + hashes(8)[6:])
    assert found.num_blocks == 6 and found.sources == ["disk"] * 3 + ["host"] * 3
    result = policy.load(hs, found.sources).result(timeout=10)
    assert same_blocks(result.blocks, pool, list(range(6))) and result.sources == found.sources
    assert policy.lookup(hs[:3]).sources == ["host"] * 3  # promoted on load
    stats = policy.stats()
    assert stats["disk"]["load"]["blocks"] == 3 and stats["host"]["load"]["blocks"] == 3
    assert stats["policy"]["demoted_blocks"] == 6
    policy.check_invariants()
    policy.close()


def test_host_load_is_synchronous_and_stops_at_first_miss(pool, tmp_path):
    policy = make_policy(pool, tmp_path, host_blocks=8)
    hs = hashes(4)
    policy.demote([hs[0], hs[1], hs[3]], pool, [7, 8, 9])
    assert policy.lookup(hs).num_blocks == 2
    assert same_blocks(policy.load_host(hs), pool, [7, 8])
    assert policy.stats()["host"]["load"]["failed_blocks"] == 2
    policy.close()


def test_lookup_is_contiguous_across_tiers(pool, tmp_path):
    policy = make_policy(pool, tmp_path, host_blocks=8, disk=True)
    hs = hashes(5)
    policy.host.put_blocks(FP.keys([hs[0], hs[2]]), pool, [0, 2], policy.codec)
    policy.disk.put(list(zip(FP.keys([hs[1], hs[4]]), policy.codec.encode_blocks(pool, [1, 4]), strict=True)))
    found = policy.lookup(hs)
    assert found.sources == ["host", "disk", "host"]  # hs[3] is nowhere: hs[4] cannot be used
    policy.close()


def test_damaged_or_foreign_block_ends_the_load_there(pool, tmp_path):
    policy = make_policy(pool, tmp_path, disk=True)
    hs = hashes(4)
    payloads = policy.codec.encode_blocks(pool, [0, 1, 2, 3])
    foreign = BlockCodec(torch.bfloat16, policy.codec.shape).encode(pool[:, :, 2].to(torch.bfloat16))
    policy.disk.put(list(zip(FP.keys(hs), payloads[:2] + [foreign] + payloads[3:], strict=True)))
    result = policy.load(hs, ["disk"] * 4).result(timeout=10)
    assert same_blocks(result.blocks, pool, [0, 1])
    assert policy.lookup(hs).num_blocks == 2  # the foreign payload was deleted
    policy.close()


def test_write_through_reaches_another_replica(pool, tmp_path, redis_url):
    replica_a = make_policy(pool, tmp_path / "a", host_blocks=4, redis_url=redis_url)
    hs = hashes(3)
    replica_a.write_through(hs, pool, [3, 4, 5])
    replica_a.flush()
    replica_b = make_policy(torch.zeros_like(pool), tmp_path / "b", host_blocks=4, redis_url=redis_url)
    found = replica_b.lookup(hs)
    assert found.sources == ["remote"] * 3
    result = replica_b.load(hs, found.sources).result(timeout=10)
    assert same_blocks(result.blocks, pool, [3, 4, 5])
    assert replica_b.stats()["remote"]["hits"] == 3
    other_model = model_fingerprint(kv_dtype="float32", block_size=BLOCK, config={"hidden": 65})
    replica_c = make_policy(pool, tmp_path / "c", redis_url=redis_url, fingerprint=other_model)
    assert replica_c.lookup(hs).num_blocks == 0
    for policy in (replica_a, replica_b, replica_c):
        policy.close()


@pytest.mark.parametrize("tier", ["host", "disk", "remote"])
def test_tenants_never_hit_each_other_on_any_tier(pool, tmp_path, tier, request):
    """Paired: the same tokens under tenant A are found for A and never for B (the control hits)."""
    redis_url = request.getfixturevalue("redis_url") if tier == "remote" else None
    policy = make_policy(pool, tmp_path, host_blocks=8 if tier == "host" else None, disk=tier == "disk",
                         redis_url=redis_url)
    tenant_a, tenant_b = hashes(4, ("tenant-a",)), hashes(4, ("tenant-b",))
    if tier == "remote":
        policy.write_through(tenant_a, pool, [0, 1, 2, 3])
    else:
        policy.demote(tenant_a, pool, [0, 1, 2, 3])
    policy.flush()
    assert policy.lookup(tenant_a).sources == [tier] * 4
    assert policy.lookup(tenant_b).num_blocks == 0
    assert policy.load(tenant_b, [tier] * 4).result(timeout=10).blocks == []
    policy.close()


def test_remote_probe_runs_in_the_load_job_after_local_blocks(pool, tmp_path, redis_url):
    policy = make_policy(pool, tmp_path, host_blocks=8, redis_url=redis_url)
    hs = hashes(5)
    policy.demote(hs[:2], pool, [0, 1])
    policy.write_through(hs[2:4], pool, [2, 3])
    policy.flush()
    local = policy.lookup(hs, local_only=True)
    assert local.sources == ["host", "host"]  # no network on this path
    assert policy.lookup(hs).sources == ["host", "host", "remote", "remote"]
    result = policy.load(hs, local.sources, probe_remote=True).result(timeout=10)
    assert result.sources == ["host", "host", "remote", "remote"]
    assert same_blocks(result.blocks, pool, [0, 1, 2, 3])
    policy.close()


def test_clear_local_empties_host_and_disk_of_this_model_only(pool, tmp_path, redis_url):
    policy = make_policy(pool, tmp_path, host_blocks=2, disk=True, redis_url=redis_url)
    other = model_fingerprint(kv_dtype="float32", block_size=BLOCK, config={"hidden": 32})
    hs = hashes(5)
    policy.demote(hs, pool, list(range(5)))  # 2 stay in host, 3 are queued for disk
    policy.write_through(hs[:1], pool, [0])
    theirs = list(zip(other.keys(hs[:2]), policy.codec.encode_blocks(pool, [0, 1]), strict=True))
    policy.disk.put(theirs)  # another model's blocks in the same directory
    policy.host.put(theirs[:1])
    assert policy.clear_local() == 5  # the queued disk writes landed first, then went too
    assert policy.lookup(hs, local_only=True).num_blocks == 0
    assert set(policy.disk.keys_lru_first()) == {key for key, _ in theirs}
    assert policy.host.keys_lru_first() == [theirs[0][0]]
    policy.flush()
    assert policy.remote.longest_prefix(FP.keys(hs[:1])) == 1  # shared by the replicas: kept
    policy.check_invariants()
    policy.close()
