"""Property tests: random request histories against a reference model, and radix vs hash.

Tokens are drawn as whole blocks from a tiny pool (two of which share their first tokens) so
prefixes collide often and radix nodes split inside edges; namespaces come from three choices.
The model machine runs under every eviction policy (belady with a made-up future): which blocks a
policy evicts may differ, what must hold after every step may not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvserve.kv.block_allocator import BlockAllocator
from kvserve.prefix.base import Namespace
from kvserve.prefix.hashed import HashCache
from kvserve.prefix.hashing import block_hashes
from kvserve.prefix.policies import EVICTION_POLICIES, make_policy
from kvserve.prefix.radix import RadixCache

BS = 4
BLOCK_POOL = [(0, 0, 0, 0), (0, 0, 1, 1), (1, 1, 1, 1)]
NAMESPACES: list[Namespace] = [(), ("t1",), ("t1", "s")]
SETTINGS = settings(max_examples=100, stateful_step_count=30, deadline=None)

prompts = (
    st.tuples(
        st.lists(st.sampled_from(BLOCK_POOL), min_size=0, max_size=6),
        st.lists(st.integers(0, 1), min_size=0, max_size=BS - 1),
    )
    .map(lambda parts: [t for block in parts[0] for t in block] + parts[1])
    .filter(bool)
)
namespaces = st.sampled_from(NAMESPACES)

Cache = RadixCache | HashCache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def made_up_future(block_hash: bytes) -> float:
    """A deterministic stand-in for the trace's future, for Belady outside a replay."""
    return float(int.from_bytes(block_hash[:4], "little") % 97)


def make_cache(kind: str, num_blocks: int, policy: str = "lru") -> Cache:
    alloc = BlockAllocator(num_blocks)
    evict = make_policy(policy, made_up_future if policy == "belady" else None)
    if kind == "radix":
        return RadixCache(alloc, BS, clock=Clock(), policy=evict)
    return HashCache(alloc, BS, clock=Clock(), policy=evict)


@dataclass
class Admission:
    """What one new request did to a cache."""

    blocks: list[int]
    matched: int = 0  # blocks hit at admission (capped match)
    present: int = 0  # leading blocks insert found already cached
    evicted: list[int] = field(default_factory=list)


def admit(cache: Cache, tokens: list[int], namespace: Namespace) -> Admission | None:
    """The engine's path: capped match, acquire, allocate (evicting if needed), insert, swap
    duplicates. None when the pool cannot hold the request even after evicting."""
    hashes = block_hashes(tokens, BS, namespace)
    matched = cache.match(tokens[: (len(tokens) - 1) // BS * BS], hashes, namespace)
    cache.acquire(matched)
    need = -(-len(tokens) // BS) - len(matched)
    if cache.allocator.num_free + cache.num_evictable_blocks < need:
        cache.release(matched[::-1])  # the engine would keep it waiting; here it is dropped
        return None
    evicted = [] if cache.allocator.can_allocate(need) else cache.evict(need - cache.allocator.num_free)
    blocks = matched + cache.allocator.allocate(need)  # raises if evict could not reach enough blocks
    present = cache.insert(tokens, hashes, blocks, namespace)
    for i, block_id in enumerate(cache.match(tokens, hashes, namespace)[:present]):
        if blocks[i] != block_id:  # our recomputed duplicate: hold the cached block instead
            cache.acquire([block_id])
            cache.release([blocks[i]])
            blocks[i] = block_id
    return Admission(blocks, len(matched), present, evicted)


class Model:
    """Reference: namespace -> set of cached token prefixes (each a whole number of blocks)."""

    def __init__(self) -> None:
        self.prefixes: dict[Namespace, set[tuple[int, ...]]] = {}
        self.prefix_of: dict[int, tuple[Namespace, tuple[int, ...]]] = {}

    def match_blocks(self, tokens: Sequence[int], namespace: Namespace) -> int:
        cached, k = self.prefixes.get(namespace, set()), 0
        while (k + 1) * BS <= len(tokens) and tuple(tokens[: (k + 1) * BS]) in cached:
            k += 1
        return k

    def add(self, tokens: Sequence[int], namespace: Namespace, blocks: Sequence[int], start: int) -> None:
        cached = self.prefixes.setdefault(namespace, set())
        for i in range(start, len(tokens) // BS):
            prefix = tuple(tokens[: (i + 1) * BS])
            assert prefix not in cached
            cached.add(prefix)
            self.prefix_of[blocks[i]] = (namespace, prefix)

    def remove(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            namespace, prefix = self.prefix_of.pop(block_id)
            self.prefixes[namespace].remove(prefix)

    def clear(self) -> None:
        self.prefixes.clear()
        self.prefix_of.clear()


def check_accounting(cache: Cache) -> None:
    cache.check_invariants()
    alloc = cache.allocator
    assert min(alloc.ref_counts) >= 0
    assert alloc.num_free + cache.num_evictable_blocks + alloc.num_referenced() == alloc.num_blocks


def drain(cache: Cache, live: list[tuple[list[int], Namespace, list[int]]]) -> None:
    """Release every live request, evict everything: every block must be free again."""
    for _, _, blocks in live:
        cache.release(blocks[::-1])
    live.clear()
    cache.evict(cache.allocator.num_blocks)
    check_accounting(cache)
    assert cache.num_cached_blocks == 0 and cache.allocator.num_free == cache.allocator.num_blocks


@SETTINGS
class ModelMachine(RuleBasedStateMachine):
    """One cache against the reference model, in a pool small enough to evict often."""

    KIND = "radix"
    POLICY = "lru"
    NUM_BLOCKS = 24

    def __init__(self) -> None:
        super().__init__()
        self.cache = make_cache(self.KIND, self.NUM_BLOCKS, self.POLICY)
        self.model = Model()
        self.live: list[tuple[list[int], Namespace, list[int]]] = []  # (tokens, namespace, blocks)

    @rule(tokens=prompts, namespace=namespaces)
    def new_request(self, tokens: list[int], namespace: Namespace) -> None:
        capped = tokens[: (len(tokens) - 1) // BS * BS]
        expected_match = self.model.match_blocks(capped, namespace)
        result = admit(self.cache, tokens, namespace)
        if result is None:
            return
        assert result.matched == expected_match
        self.model.remove(result.evicted)
        assert result.present == self.model.match_blocks(tokens, namespace)
        self.model.add(tokens, namespace, result.blocks, result.present)
        self.live.append((tokens, namespace, result.blocks))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        _, _, blocks = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.cache.release(blocks[::-1])

    @rule(num_blocks=st.integers(0, 8))
    def evict(self, num_blocks: int) -> None:
        evictable = self.cache.num_evictable_blocks
        freed = self.cache.evict(num_blocks)
        assert len(freed) == min(num_blocks, evictable)  # every unreferenced block is reachable
        assert all(self.cache.allocator.is_free(b) for b in freed)
        self.model.remove(freed)

    @rule()
    def reset(self) -> None:
        holds_cached = any(b in self.model.prefix_of for _, _, blocks in self.live for b in blocks)
        assert self.cache.reset() is not holds_cached
        if not holds_cached:
            self.model.clear()

    @rule(tokens=prompts, namespace=namespaces)
    def lookup(self, tokens: list[int], namespace: Namespace) -> None:
        got = self.cache.match(tokens, block_hashes(tokens, BS, namespace), namespace)
        assert len(got) == self.model.match_blocks(tokens, namespace)
        assert all(self.model.prefix_of[b][1] == tuple(tokens[: (i + 1) * BS]) for i, b in enumerate(got))

    @invariant()
    def accounting_holds(self) -> None:
        check_accounting(self.cache)

    def teardown(self) -> None:
        drain(self.cache, self.live)


class HashModelMachine(ModelMachine):
    KIND = "hash"


@SETTINGS
class DifferentialMachine(RuleBasedStateMachine):
    """The same history on radix and hash must give the same match lengths. The pool is big enough
    that admission never evicts; the only eviction op evicts everything unreferenced, after which both
    caches hold exactly the referenced blocks, so their eviction choices coincide by construction."""

    NUM_BLOCKS = 512

    def __init__(self) -> None:
        super().__init__()
        self.caches = [make_cache("radix", self.NUM_BLOCKS), make_cache("hash", self.NUM_BLOCKS)]
        self.live: list[list[tuple[list[int], Namespace, list[int]]]] = [[], []]

    @rule(tokens=prompts, namespace=namespaces)
    def new_request(self, tokens: list[int], namespace: Namespace) -> None:
        results = [admit(cache, tokens, namespace) for cache in self.caches]
        radix, hashed = results
        assert radix is not None and hashed is not None and not radix.evicted and not hashed.evicted
        assert (radix.matched, radix.present) == (hashed.matched, hashed.present)
        for live, result in zip(self.live, results, strict=True):
            assert result is not None
            live.append((tokens, namespace, result.blocks))

    @precondition(lambda self: self.live[0])
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.live[0]) - 1))
        for cache, live in zip(self.caches, self.live, strict=True):
            cache.release(live.pop(index)[2][::-1])

    @rule(tokens=prompts, namespace=namespaces)
    def lookup(self, tokens: list[int], namespace: Namespace) -> None:
        hashes = block_hashes(tokens, BS, namespace)
        radix, hashed = (len(cache.match(tokens, hashes, namespace)) for cache in self.caches)
        assert radix == hashed

    @rule()
    def evict_all_unreferenced(self) -> None:
        radix, hashed = (len(cache.evict(self.NUM_BLOCKS)) for cache in self.caches)
        assert radix == hashed

    @rule()
    def reset(self) -> None:
        radix, hashed = (cache.reset() for cache in self.caches)
        assert radix == hashed

    @invariant()
    def same_sizes_and_accounting(self) -> None:
        radix, hashed = self.caches
        assert radix.num_cached_blocks == hashed.num_cached_blocks
        assert radix.num_evictable_blocks == hashed.num_evictable_blocks
        for cache in self.caches:
            check_accounting(cache)

    def teardown(self) -> None:
        for cache, live in zip(self.caches, self.live, strict=True):
            drain(cache, live)


TestRadixAgainstModel = ModelMachine.TestCase
TestHashAgainstModel = HashModelMachine.TestCase
TestRadixHashDifferential = DifferentialMachine.TestCase


@pytest.mark.parametrize("kind", ["radix", "hash"])
@pytest.mark.parametrize("policy", [p for p in EVICTION_POLICIES if p != "lru"])
def test_model_under_every_policy(kind: str, policy: str) -> None:
    machine = type(f"{kind}_{policy}_machine", (ModelMachine,), {"KIND": kind, "POLICY": policy})
    run_state_machine_as_test(machine, settings=settings(max_examples=30, stateful_step_count=30, deadline=None))
