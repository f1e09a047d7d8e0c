"""Unit tests of both prefix caches, driven the way the engine drives them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from kvserve.kv.block_allocator import BlockAllocator
from kvserve.prefix.base import Namespace, NoPrefixCache
from kvserve.prefix.factory import make_prefix_cache
from kvserve.prefix.hashed import HashCache
from kvserve.prefix.hashing import block_hashes
from kvserve.prefix.policies import make_policy
from kvserve.prefix.radix import RadixCache

BS = 16
KINDS = ["radix", "hash"]


class Clock:
    """Deterministic clock: every read is one tick later."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def make(kind: str, num_blocks: int = 64) -> tuple[BlockAllocator, RadixCache | HashCache]:
    alloc = BlockAllocator(num_blocks)
    cache = RadixCache(alloc, BS, clock=Clock()) if kind == "radix" else HashCache(alloc, BS, clock=Clock())
    return alloc, cache


@dataclass
class Seq:
    """A request as the engine holds it: its tokens, block table and block hashes."""

    tokens: list[int]
    namespace: Namespace
    blocks: list[int]
    hashes: list[bytes]
    num_cached_tokens: int = 0


def admit(cache: RadixCache | HashCache, tokens: Sequence[int], namespace: Namespace = ()) -> Seq:
    """Match (capped so one prompt token is computed), acquire, allocate the rest (evicting if needed)."""
    hashes = block_hashes(tokens, BS, namespace)
    capped = list(tokens[: (len(tokens) - 1) // BS * BS])
    matched = cache.match(capped, hashes, namespace)
    cache.acquire(matched)
    need = -(-len(tokens) // BS) - len(matched)
    if not cache.allocator.can_allocate(need):
        cache.evict(need - cache.allocator.num_free)
    blocks = matched + cache.allocator.allocate(need)
    return Seq(list(tokens), namespace, blocks, hashes, len(matched) * BS)


def publish(cache: RadixCache | HashCache, seq: Seq) -> int:
    """Insert the full blocks, then swap our duplicates for the cached ids."""
    present = cache.insert(seq.tokens, seq.hashes, seq.blocks, seq.namespace)
    cached = cache.match(seq.tokens, seq.hashes, seq.namespace)[:present]
    for i, block_id in enumerate(cached):
        if seq.blocks[i] != block_id:
            cache.acquire([block_id])
            cache.release([seq.blocks[i]])
            seq.blocks[i] = block_id
    return present


def run(cache: RadixCache | HashCache, tokens: Sequence[int], namespace: Namespace = ()) -> Seq:
    seq = admit(cache, tokens, namespace)
    publish(cache, seq)
    cache.check_invariants()
    return seq


def finish(cache: RadixCache | HashCache, seq: Seq) -> None:
    cache.release(seq.blocks[::-1])  # tail first: the last blocks are evicted first
    cache.check_invariants()


def match_tokens(cache: RadixCache | HashCache, tokens: Sequence[int], namespace: Namespace = ()) -> int:
    return len(cache.match(tokens, block_hashes(tokens, BS, namespace), namespace)) * BS


def seq_tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize("kind", KINDS)
def test_55_then_53_tokens_sharing_48_hits_3_blocks(kind: str) -> None:
    alloc, cache = make(kind)
    a = seq_tokens(0, 55)
    finish(cache, run(cache, a))
    assert cache.num_cached_blocks == 3  # the 7-token tail block is never cached
    assert alloc.num_free == alloc.num_blocks - 3
    b = a[:48] + [9000, 9001, 9002, 9003, 9004]
    seq = admit(cache, b)
    assert seq.num_cached_tokens == 48
    assert cache.match(b[:48], seq.hashes, ()) == seq.blocks[:3]
    publish(cache, seq)
    cache.check_invariants()
    finish(cache, seq)
    assert cache.num_cached_blocks == 3


@pytest.mark.parametrize("kind", KINDS)
def test_cap_leaves_one_token_and_duplicate_is_swapped(kind: str) -> None:
    """A 48-token prompt whose 3 blocks are all cached matches only 2 (cap); its recomputed third block
    is a duplicate that insert reports as present and does not register."""
    alloc, cache = make(kind)
    tokens = seq_tokens(0, 48)
    first = run(cache, tokens)
    finish(cache, first)
    seq = admit(cache, tokens)
    assert seq.num_cached_tokens == 32
    duplicate = seq.blocks[2]
    assert publish(cache, seq) == 3
    assert seq.blocks == first.blocks and alloc.is_free(duplicate)
    assert cache.num_cached_blocks == 3
    cache.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_namespaces_never_share(kind: str) -> None:
    _, cache = make(kind)
    tokens = seq_tokens(0, 64)
    finish(cache, run(cache, tokens, ("t1",)))
    assert match_tokens(cache, tokens, ("t1",)) == 64
    for other in [("t2",), (), ("t1", "x"), ("t", "1")]:
        assert match_tokens(cache, tokens, other) == 0
    finish(cache, run(cache, tokens, ("t2",)))  # the other half: t2 gets its own blocks and hits
    assert match_tokens(cache, tokens, ("t2",)) == 64
    assert match_tokens(cache, tokens, ("t1",)) == 64
    assert cache.num_cached_blocks == 8


@pytest.mark.parametrize("kind", KINDS)
def test_split_fields_are_different_namespaces(kind: str) -> None:
    _, cache = make(kind)
    tokens = seq_tokens(0, 32)
    finish(cache, run(cache, tokens, ("ab", "c")))
    assert match_tokens(cache, tokens, ("a", "bc")) == 0
    assert match_tokens(cache, tokens, ("ab", "c")) == 32


def _two_branches(cache: RadixCache | HashCache) -> tuple[Seq, Seq]:
    """P (2 blocks) shared by X = P + x and Y = P + y (2 blocks each); X runs and finishes, then Y."""
    prefix = seq_tokens(0, 32)
    x = run(cache, prefix + seq_tokens(1000, 32) + [1])
    finish(cache, x)
    y = run(cache, prefix + seq_tokens(2000, 32) + [1])
    assert y.num_cached_tokens == 32
    finish(cache, y)
    return x, y


def test_radix_evicts_lru_leaf_first_and_prefix_survives() -> None:
    _, cache = make("radix")
    x, y = _two_branches(cache)
    assert cache.evict(1) == x.blocks[3:4]  # X is the older leaf: trimmed from its tail
    assert sorted(cache.evict(1)) == sorted(x.blocks[2:3])  # then the rest of it
    assert cache.match(y.tokens, y.hashes, ()) == y.blocks[:4]  # Y and the shared prefix stay
    assert sorted(cache.evict(2)) == sorted(y.blocks[2:4])
    assert cache.match(y.tokens, y.hashes, ()) == y.blocks[:2]  # prefix outlived both leaves
    assert sorted(cache.evict(5)) == sorted(y.blocks[:2])  # now a leaf itself; 2 is all there is
    assert cache.num_cached_blocks == 0 and cache.num_evictions == 6
    cache.check_invariants()


def test_radix_match_refreshes_recency() -> None:
    _, cache = make("radix")
    x, y = _two_branches(cache)
    cache.match(x.tokens, x.hashes, ())  # X is now the most recently used leaf
    assert sorted(cache.evict(2)) == sorted(y.blocks[2:4])
    cache.check_invariants()


def test_hash_evicts_lru_leaves_first() -> None:
    _, cache = make("hash")
    x, y = _two_branches(cache)
    # X's leaf chain is the oldest; then Y's; the shared prefix becomes a leaf only after both.
    order = [x.blocks[3], x.blocks[2], y.blocks[3], y.blocks[2], y.blocks[1], y.blocks[0]]
    assert cache.evict(1) == order[:1]
    assert cache.evict(3) == order[1:4]
    assert cache.match(y.tokens, y.hashes, ()) == y.blocks[:2]  # the shared prefix went last
    assert cache.evict(10) == order[4:]
    assert cache.num_cached_blocks == 0 and cache.num_evictions == 6
    cache.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_evict_never_takes_referenced_blocks(kind: str) -> None:
    alloc, cache = make(kind)
    live = run(cache, seq_tokens(0, 64) + [1])
    done = run(cache, seq_tokens(0, 32) + seq_tokens(500, 32) + [1])
    finish(cache, done)
    freed = cache.evict(100)
    assert sorted(freed) == sorted(done.blocks[2:4])
    assert not set(freed) & set(live.blocks)
    assert all(alloc.ref_counts[b] == 1 for b in live.blocks)
    assert cache.match(live.tokens, live.hashes, ()) == live.blocks[:4]
    assert cache.num_evictable_blocks == 0 and cache.num_protected_blocks == 4
    cache.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_duplicate_insert_reports_present_and_registers_nothing(kind: str) -> None:
    alloc, cache = make(kind)
    tokens = seq_tokens(0, 50)
    a, b = admit(cache, tokens), admit(cache, tokens + seq_tokens(100, 20))  # admitted in one step
    assert cache.insert(a.tokens, a.hashes, a.blocks, ()) == 0
    assert cache.insert(b.tokens, b.hashes, b.blocks, ()) == 3  # b's 4th block is new
    assert cache.num_cached_blocks == 4
    assert cache.match(b.tokens, b.hashes, ()) == a.blocks[:3] + b.blocks[3:4]
    duplicates = b.blocks[:3]
    cache.check_invariants()
    cache.release(b.blocks[::-1])
    assert all(alloc.is_free(block_id) for block_id in duplicates)  # never registered: freed at once
    assert cache.insert(a.tokens, a.hashes, a.blocks, ()) == 3  # re-inserting is a no-op
    cache.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_insert_rejects_a_block_registered_elsewhere(kind: str) -> None:
    _, cache = make(kind)
    seq = run(cache, seq_tokens(0, 32))
    other = seq_tokens(900, 32)
    with pytest.raises(ValueError):
        cache.insert(other, block_hashes(other, BS, ()), seq.blocks, ())


def test_radix_split_when_match_ends_inside_a_node() -> None:
    _, cache = make("radix")
    assert isinstance(cache, RadixCache)
    seq = run(cache, seq_tokens(0, 64))  # one node of 4 blocks
    finish(cache, seq)
    root = cache._roots[()]
    assert [len(n.blocks) for n in root.children.values()] == [4]
    query = seq_tokens(0, 32) + seq_tokens(700, 32)
    matched = cache.match(query, [], ())
    assert matched == seq.blocks[:2]
    (upper,) = root.children.values()
    (lower,) = upper.children.values()
    assert upper.blocks == seq.blocks[:2] and lower.blocks == seq.blocks[2:]
    cache.check_invariants()
    cache.acquire(matched)  # a request holds the whole upper node
    assert sorted(cache.evict(10)) == sorted(seq.blocks[2:])
    assert cache.match(seq.tokens, [], ()) == seq.blocks[:2]
    cache.check_invariants()


def test_radix_insert_splits_and_branches() -> None:
    _, cache = make("radix")
    a = run(cache, seq_tokens(0, 64))
    b = run(cache, seq_tokens(0, 16) + seq_tokens(300, 48))
    assert b.blocks[0] == a.blocks[0]
    assert match_tokens(cache, a.tokens) == 64 and match_tokens(cache, b.tokens) == 64
    assert match_tokens(cache, seq_tokens(0, 16) + seq_tokens(5000, 16)) == 16
    cache.check_invariants()


def test_hash_collision_with_different_tokens_is_a_miss() -> None:
    _, cache = make("hash")
    fake = [b"same"] * 4  # every block collides
    p, q, x, y = (seq_tokens(s, BS) for s in (0, 100, 200, 300))
    blocks = cache.allocator.allocate(4)
    cache.insert(p + x, fake, blocks[:2], ())
    assert cache.match(q + x, fake, ()) == []  # block 0 collides, tokens differ
    assert cache.match(p + y, fake, ()) == blocks[:1]  # block 1 collides, tokens differ
    assert cache.match(p + x, fake, ("other",)) == []  # same tokens, other namespace
    # Chain collision: with q cached, q + x must not reach p + x's second block (its KV follows p).
    cache.insert(q + y, fake, blocks[2:], ())
    assert cache.match(q + x, fake, ()) == blocks[2:3]
    assert cache.match(p + x, fake, ()) == blocks[:2] and cache.match(q + y, fake, ()) == blocks[2:]
    cache.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_reset_refuses_while_a_block_is_referenced(kind: str) -> None:
    alloc, cache = make(kind)
    seq = run(cache, seq_tokens(0, 40))
    assert cache.reset() is False
    assert cache.num_cached_blocks == 2 and match_tokens(cache, seq.tokens) == 32
    finish(cache, seq)
    assert cache.reset() is True
    assert cache.num_cached_blocks == 0 and cache.num_evictable_blocks == 0
    assert alloc.num_free == alloc.num_blocks and match_tokens(cache, seq.tokens) == 0
    cache.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_allocation_evicts_when_the_pool_is_full(kind: str) -> None:
    alloc, cache = make(kind, num_blocks=6)
    finish(cache, run(cache, seq_tokens(0, 64)))  # 4 blocks cached, 2 free
    seq = run(cache, seq_tokens(1000, 64))  # needs 4: evicts 2+
    assert cache.num_evictions >= 2 and alloc.num_free + cache.num_evictable_blocks == 2
    finish(cache, seq)
    cache.evict(alloc.num_blocks)
    assert alloc.num_free == alloc.num_blocks


def test_factory() -> None:
    alloc = BlockAllocator(8)
    assert isinstance(make_prefix_cache("radix", alloc, BS), RadixCache)
    hashed = make_prefix_cache("hash", alloc, BS, hash_algo="xxhash")
    assert isinstance(hashed, HashCache) and hashed.hash_algo.value == "xxhash"
    assert isinstance(make_prefix_cache("off", alloc, BS), NoPrefixCache)
    with pytest.raises(ValueError):
        make_prefix_cache("lru", alloc, BS)
    with pytest.raises(ValueError):
        make_prefix_cache("hash", alloc, BS, hash_algo="md5")


@pytest.mark.parametrize("kind", KINDS)
def test_on_evict_reports_block_and_hash_before_the_free_list(kind: str) -> None:
    """evict() and reset() hand every dropped (block_id, block_hash) to `on_evict` while the blocks are
    still off the free list; hashes stay with their blocks across a radix split."""
    alloc, cache = make(kind, num_blocks=16)
    seen: list[tuple[int, bytes]] = []

    def listener(pairs: list[tuple[int, bytes]]) -> None:
        assert all(not alloc.is_free(block_id) for block_id, _ in pairs)
        seen.extend(pairs)

    cache.on_evict = listener
    a = run(cache, seq_tokens(0, 64))
    finish(cache, a)
    b = run(cache, seq_tokens(0, 32) + seq_tokens(500, 32))  # splits a's radix node after 2 blocks
    finish(cache, b)
    expected = dict(zip(a.blocks, a.hashes, strict=True)) | dict(zip(b.blocks, b.hashes, strict=True))
    freed = cache.evict(2)
    assert freed and {block_id for block_id, _ in seen} == set(freed)
    assert all(expected[block_id] == block_hash for block_id, block_hash in seen)
    seen.clear()
    assert cache.reset() is True
    assert len(seen) == len(expected) - len(freed)
    assert all(expected[block_id] == block_hash for block_id, block_hash in seen)
    assert alloc.num_free == alloc.num_blocks


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", ["lru", "glru", "alru"])
def test_glru_keeps_a_recomputed_run_over_a_newer_one_off(kind: str, policy: str) -> None:
    """glru's ghosts: a run that was evicted and then recomputed has proven reuse, so it outranks a newer
    prompt used once (LRU takes the older one)."""
    alloc = BlockAllocator(8)
    evict = make_policy(policy)
    cache = (RadixCache(alloc, BS, clock=Clock(), policy=evict) if kind == "radix"
             else HashCache(alloc, BS, clock=Clock(), policy=evict))
    again = seq_tokens(0, 32) + [1]  # two full blocks and a partial one
    finish(cache, run(cache, again))
    finish(cache, run(cache, seq_tokens(100, 32) + [1]))
    assert len(cache.evict(8)) == 4  # both gone: the pool forgets them, glru's ghosts do not
    back = run(cache, again)  # a miss: recomputed
    assert back.num_cached_tokens == 0
    finish(cache, back)
    newer = run(cache, seq_tokens(200, 32) + [1])
    finish(cache, newer)
    expected = back.blocks[:2] if policy == "lru" else newer.blocks[:2]
    assert sorted(cache.evict(2)) == sorted(expected)
    cache.check_invariants()


def test_belady_takes_only_the_farthest_tail_of_a_leaf() -> None:
    """A leaf's head can be used much sooner than its tail: Belady evicts the dead tail, then ranks the
    head against the other leaves (evicting the whole leaf made Belady lose to LRU on the trace)."""
    future: dict[bytes, float] = {}
    alloc = BlockAllocator(16)
    cache = RadixCache(alloc, BS, clock=Clock(), policy=make_policy("belady", lambda h: future.get(h, math.inf)))
    a = run(cache, seq_tokens(0, 64) + [1])  # one 4-block leaf
    b = run(cache, seq_tokens(500, 32) + [1])  # one 2-block leaf
    future.update({a.hashes[0]: 5, a.hashes[1]: 5, b.hashes[0]: 10, b.hashes[1]: 10})  # a[2:] never again
    finish(cache, a)
    finish(cache, b)
    assert sorted(cache.evict(3)) == sorted([a.blocks[2], a.blocks[3], b.blocks[1]])
    assert cache.match(a.tokens, a.hashes, ()) == a.blocks[:2]
