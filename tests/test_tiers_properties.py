"""Hypothesis state machines: HostStore and DiskStore behave like a dict + LRU within a byte budget, and
their `on_change` listener mirrors their key set exactly (what KV events for the tiers rely on)."""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvserve.tiers.disk import DiskStore
from kvserve.tiers.host import HostStore

KEYS = [bytes([i]) * 32 for i in range(8)]
BUDGET = 6000
DISK_OVERHEAD = 14 + 32  # file header + key


class LruModel:
    """The reference: an ordered dict of key -> payload, least recent first, evicting to the budget."""

    def __init__(self, overhead: int) -> None:
        self.entries: OrderedDict[bytes, bytes] = OrderedDict()
        self.overhead = overhead

    def size(self, payload: bytes) -> int:
        return len(payload) + self.overhead

    def put(self, key: bytes, payload: bytes) -> None:
        if self.size(payload) > BUDGET:
            return
        self.entries.pop(key, None)
        self.entries[key] = payload
        while sum(self.size(p) for p in self.entries.values()) > BUDGET:
            self.entries.popitem(last=False)

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        out = []
        for key in keys:
            if key in self.entries:
                self.entries.move_to_end(key)
            out.append(self.entries.get(key))
        return out

    def longest_prefix(self, keys: list[bytes]) -> int:
        return next((i for i, k in enumerate(keys) if k not in self.entries), len(keys))


payloads = st.builds(lambda n, b: bytes([b]) * n, st.integers(1, 2500), st.integers(0, 255))
key_lists = st.lists(st.sampled_from(KEYS), max_size=6)


class Mirror:
    """A consumer of a store's changes, as KV events are: only a key it lacks may be added, only one it
    holds removed (a net change per call)."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def __call__(self, added: list[bytes], removed: list[bytes]) -> None:
        assert added or removed, "a call without a change"
        assert not set(added) & set(removed), "one call both adds and removes a key"
        assert not set(added) & self.keys, "a key already present reported added"
        assert set(removed) <= self.keys, "a key not present reported removed"
        self.keys |= set(added)
        self.keys -= set(removed)


class StoreMachine(RuleBasedStateMachine):
    overhead = 0

    def __init__(self) -> None:
        super().__init__()
        self.model = LruModel(self.overhead)
        self.store = self.make_store()
        self.mirror = Mirror()
        self.store.on_change = self.mirror

    def make_store(self):
        raise NotImplementedError

    @rule(items=st.lists(st.tuples(st.sampled_from(KEYS), payloads), min_size=1, max_size=3))
    def put(self, items):
        self.store.put(items)
        for key, payload in items:
            self.model.put(key, payload)

    @rule(items=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(2000, 2500)), min_size=3, max_size=3))
    def put_overflowing(self, items):
        """A batch bigger than the budget: it evicts what it has just added (a net change reports neither)."""
        self.put([(key, bytes([size % 256]) * size) for key, size in items])

    @rule(keys=key_lists)
    def get(self, keys):
        assert self.store.get(keys) == self.model.get(keys)

    @rule(keys=key_lists)
    def longest_prefix(self, keys):
        assert self.store.longest_prefix(keys) == self.model.longest_prefix(keys)

    @rule(keys=key_lists)
    def delete(self, keys):
        self.store.delete(keys)
        for key in keys:
            self.model.entries.pop(key, None)

    @invariant()
    def same_contents_and_order_within_budget(self):
        self.store.check_invariants()
        assert self.store.keys_lru_first() == list(self.model.entries)
        stats = self.store.stats()
        assert stats.bytes == sum(self.model.size(p) for p in self.model.entries.values()) <= BUDGET
        assert stats.blocks == len(self.model.entries)
        assert self.mirror.keys == set(self.store.keys_lru_first())


class HostMachine(StoreMachine):
    def make_store(self):
        return HostStore(BUDGET, pin_memory=False)


class DiskMachine(StoreMachine):
    overhead = DISK_OVERHEAD

    def make_store(self):
        self.root = tempfile.mkdtemp(prefix="kvserve-disk-sm-")
        return DiskStore(self.root, BUDGET, fsync=False)

    @rule()
    def restart(self):
        """A new process on the same directory: same blocks; the LRU order comes back from mtimes,
        which the file system may record with ties, so the model adopts the store's order."""
        self.store = DiskStore(self.root, BUDGET, fsync=False)
        self.mirror = Mirror()
        self.store.watch(self.mirror)  # a new subscriber hears of the blocks already there
        assert set(self.store.keys_lru_first()) == set(self.model.entries)
        self.model.entries = OrderedDict((k, self.model.entries[k]) for k in self.store.keys_lru_first())

    def teardown(self):
        shutil.rmtree(self.root, ignore_errors=True)


TestHostStoreMachine = HostMachine.TestCase
TestHostStoreMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestDiskStoreMachine = DiskMachine.TestCase
TestDiskStoreMachine.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
