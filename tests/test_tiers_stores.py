"""Every tier store against the BlockStore contract: exact round trip, prefix queries, LRU budget."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from kvserve.prefix.hashing import block_hashes
from kvserve.tiers.codec import BlockCodec, BlockFormatError
from kvserve.tiers.disk import DiskStore
from kvserve.tiers.host import HostStore
from kvserve.tiers.redis import RedisStore
from kvserve.tiers.store import ModelFingerprint, model_fingerprint

FP = model_fingerprint(kv_dtype="float32", block_size=4, config={"hidden": 64})


def keys(count: int, salt: str = "") -> list[bytes]:
    tokens = list(range(count * 4))
    return FP.keys(block_hashes(tokens, 4, (salt,) if salt else ()))


def payload(index: int, size: int = 1000) -> bytes:
    return os.urandom(8) + bytes([index % 256]) * (size - 8)


@pytest.fixture(params=["host", "disk", "remote"])
def store(request, tmp_path):
    if request.param == "host":
        made = HostStore(1 << 20)
    elif request.param == "disk":
        made = DiskStore(tmp_path / "disk", 1 << 20)
    else:
        made = RedisStore(request.getfixturevalue("redis_url"))
    yield made
    made.close()


def test_round_trip_is_bit_exact(store):
    items = [(k, payload(i)) for i, k in enumerate(keys(6))]
    store.put(items)
    assert store.get([k for k, _ in items]) == [p for _, p in items]
    store.check_invariants()
    assert store.stats().hits == 6


def test_codec_blocks_round_trip_through_every_store(store):
    pool = torch.randn(3, 2, 5, 4, 2, 8, dtype=torch.float32)
    pool[0, 0, 1, 0, 0, 0] = float("nan")  # bit patterns, not values, must survive
    codec = BlockCodec.for_pool(pool)
    store.put(list(zip(keys(5), codec.encode_blocks(pool, [4, 1, 0, 3, 2]), strict=True)))
    decoded = [codec.decode(p) for p in store.get(keys(5))]
    for block, block_id in zip(decoded, [4, 1, 0, 3, 2], strict=True):
        assert torch.equal(block.view(torch.int32), pool[:, :, block_id].contiguous().view(torch.int32))


def test_partial_prefix_and_missing_keys(store):
    ks = keys(8)
    store.put([(k, payload(i)) for i, k in enumerate(ks[:5])])
    assert store.longest_prefix(ks) == 5
    store.delete([ks[2]])
    assert store.longest_prefix(ks) == 2
    assert store.longest_prefix(ks[3:]) == 2
    got = store.get(ks[:4])
    assert got[2] is None and all(g is not None for g in got[:2] + got[3:])
    assert store.longest_prefix([]) == 0


def test_same_tokens_other_namespace_or_model_never_hit(store):
    store.put([(k, payload(i)) for i, k in enumerate(keys(4, salt="tenant-a"))])
    assert store.longest_prefix(keys(4, salt="tenant-a")) == 4
    assert store.longest_prefix(keys(4, salt="tenant-b")) == 0
    other_model = model_fingerprint(kv_dtype="bfloat16", block_size=4, config={"hidden": 64})
    assert store.longest_prefix(other_model.keys(block_hashes(list(range(16)), 4, ("tenant-a",)))) == 0


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_lru_eviction_stays_within_budget(kind, tmp_path):
    size = 1000
    per_block = size if kind == "host" else size + 14 + len(keys(1)[0])  # disk adds its file header
    budget = 3 * per_block
    store = HostStore(budget) if kind == "host" else DiskStore(tmp_path, budget)
    ks = keys(5)
    store.put([(k, payload(i, size)) for i, k in enumerate(ks[:3])])
    store.get([ks[0]])  # ks[1] is now least recently used
    store.put([(ks[3], payload(3, size))])
    assert store.longest_prefix([ks[1]]) == 0
    assert [store.longest_prefix([k]) for k in (ks[0], ks[2], ks[3])] == [1, 1, 1]
    store.put([(ks[4], payload(4, size))])
    assert store.longest_prefix([ks[2]]) == 0
    stats = store.stats()
    assert stats.bytes <= budget and stats.blocks == 3 and stats.evictions == 2
    store.check_invariants()


def test_host_evictions_are_handed_on():
    handed: list[bytes] = []
    store = HostStore(2000, on_evict=lambda items: handed.extend(k for k, _ in items))
    ks = keys(3)
    store.put([(k, payload(i)) for i, k in enumerate(ks)])
    assert handed == [ks[0]]


def test_oversized_payload_is_not_stored(tmp_path):
    for store in (HostStore(100), DiskStore(tmp_path, 100)):
        store.put([(keys(1)[0], payload(0, 500))])
        assert store.longest_prefix(keys(1)) == 0
        store.check_invariants()


def test_host_tensor_path_matches_pool_blocks():
    pool = torch.randn(2, 2, 6, 4, 2, 8).to(torch.bfloat16)
    codec = BlockCodec.for_pool(pool)
    store = HostStore(1 << 20, pin_memory=False)
    store.put_blocks(keys(3), pool, [5, 0, 2], codec)
    assert store.get(keys(3)) == codec.encode_blocks(pool, [5, 0, 2])
    loaded = store.get_blocks(keys(3), codec)
    assert all(torch.equal(b, pool[:, :, i]) for b, i in zip(loaded, [5, 0, 2], strict=True))
    other = BlockCodec(torch.float32, codec.shape)
    assert store.get_blocks(keys(1), other) == [None]


def test_codec_refuses_another_layout():
    codec = BlockCodec(torch.float32, (2, 2, 4, 2, 8))
    data = codec.encode(torch.zeros(codec.shape))
    for other in (BlockCodec(torch.bfloat16, (2, 2, 4, 2, 8)), BlockCodec(torch.float32, (2, 2, 4, 4, 4))):
        with pytest.raises(BlockFormatError):
            other.decode(data)
    with pytest.raises(BlockFormatError):
        codec.decode(data[:-1])
    wrong_version = bytearray(data)
    wrong_version[3] += 1
    with pytest.raises(BlockFormatError):
        codec.decode(bytes(wrong_version))


def test_fingerprint_covers_every_field():
    base = dict(kv_dtype="float32", block_size=16, config={"layers": 2}, tensor_shapes={"w": (2, 3)})
    variants = [
        dict(base, kv_dtype="bfloat16"), dict(base, block_size=32), dict(base, config={"layers": 3}),
        dict(base, tensor_shapes={"w": (3, 2)}), dict(base, layout_version=2), dict(base, weights_digest="ab"),
        dict(base, adapter_digest="cd"),
    ]
    digests = {model_fingerprint(**base).digest} | {model_fingerprint(**v).digest for v in variants}
    assert len(digests) == len(variants) + 1
    assert model_fingerprint(**base) == model_fingerprint(**base)
    with pytest.raises(ValueError):
        model_fingerprint(kv_dtype="float32", block_size=16)
    with pytest.raises(ValueError):
        ModelFingerprint(b"short")


class KeyMirror:
    """A strict consumer of `on_change`: each call is a net change against what it has heard so far.
    `delay_s` holds each call a random moment, so a call made outside the store's lock would be overtaken."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.keys: set[bytes] = set()
        self.calls = 0
        self.delay_s = delay_s

    def __call__(self, added: list[bytes], removed: list[bytes]) -> None:
        if self.delay_s:
            time.sleep(random.random() * self.delay_s)
        assert (added or removed) and not set(added) & self.keys and set(removed) <= self.keys
        self.keys = (self.keys | set(added)) - set(removed)
        self.calls += 1


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_change_listener_mirrors_concurrent_writers(kind, tmp_path):
    """Calls come under the store's lock, so even with several threads putting and deleting at once the
    mirror never hears a change out of order and ends equal to the store."""
    store = HostStore(8 * 1000) if kind == "host" else DiskStore(tmp_path, 8 * 1100, fsync=False)
    mirror = KeyMirror(delay_s=0.001)
    store.on_change = mirror
    ks = keys(16)

    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                if rng.random() < 0.7:
                    store.put([(rng.choice(ks), payload(seed)) for _ in range(rng.randint(1, 3))])
                else:
                    store.delete(rng.sample(ks, 2))
        except AssertionError as err:  # the mirror heard a change out of order
            errors.append(err)

    threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and mirror.keys == set(store.keys_lru_first()) and mirror.calls > 0
    store.check_invariants()


def test_host_change_listener_hears_net_changes_only():
    store = HostStore(2000)
    heard: list[tuple[list[bytes], list[bytes]]] = []
    store.on_change = lambda added, removed: heard.append((added, removed))
    ks = keys(4)
    store.put([(ks[0], payload(0)), (ks[1], payload(1)), (ks[2], payload(2))])  # ks[0] in and out: never seen
    store.put([(ks[1], payload(5))])  # a replacement: no change
    store.delete([ks[3], ks[2]])  # ks[3] was never there
    store.close()  # the process is going away: not reported
    assert heard == [([ks[1], ks[2]], []), ([], [ks[2]])]


def test_disk_change_listener_hears_a_vanished_file_and_not_the_old_index(tmp_path):
    DiskStore(tmp_path, 1 << 20).put([(k, payload(i)) for i, k in enumerate(keys(2))])
    store = DiskStore(tmp_path, 1 << 20)  # the index rebuilt at start is not a change
    heard: list[tuple[list[bytes], list[bytes]]] = []
    store.on_change = lambda added, removed: heard.append((added, removed))
    ks = keys(3)
    store.path_of(ks[0]).unlink()  # removed behind the store's back: found gone by the next read
    assert store.get([ks[0]]) == [None]
    store.put([(ks[1], payload(7)), (ks[2], payload(8))])  # ks[1] rewritten: no change
    assert heard == [([], [ks[0]]), ([ks[2]], [])]
    store.watch(mirror := KeyMirror())  # a late subscriber hears what is there, then every change
    assert mirror.keys == set(ks[1:])
