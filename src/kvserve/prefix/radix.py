"""RadixCache: SGLang's RadixAttention over whole token blocks.

One tree per namespace. Every non-root node holds an edge: the tokens of a run of whole blocks
(`key`, a flat tuple of len(blocks) * block_size ids), the block ids caching them and their chained
block hashes (`hashes`, split with the node; the tiers and KV events name a block by its hash).
Children are keyed by the tuple of their first block's tokens, so two children of one node never
share a first block. A match that ends inside a node splits it, so a request always holds whole nodes.

Eviction is leaf-first: candidates are leaves whose blocks are all unreferenced; a parent becomes a
candidate only when its last child is gone, so a shared prefix outlives the branches built on it.
Which candidate goes first is the `EvictionPolicy`'s choice (prefix/eviction.py; LRU by default); it
keeps candidates in a heap with lazy invalidation, so eviction never scans the tree. A victim bigger
than what is needed is trimmed from its tail (its head, which more requests share, stays cached).

Counters (`num_cached_blocks`, `num_evictable_blocks`, per-node referenced counts) are maintained
incrementally in acquire/release/insert/evict; `check_invariants` recounts them for tests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.kv.block_allocator import BlockAllocator
from kvserve.prefix.base import Namespace, check_accounting
from kvserve.prefix.eviction import EvictionPolicy


@dataclass(slots=True, eq=False)
class RadixNode:
    """One edge of the tree: whole blocks of tokens and the block ids caching them."""

    key: tuple[int, ...]
    blocks: list[int]
    hashes: list[bytes]  # chained block hash of each block, parallel to `blocks`
    parent: RadixNode | None
    depth: int  # blocks from the root through this node's last block
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    num_referenced: int = 0  # blocks of this node with ref count > 0
    removed: bool = False
    last_access: float = 0.0  # eviction-policy state (see prefix/eviction.py)
    hits: int = 0
    hit_time: float = 0.0
    gap: float = math.inf
    priority: float = 0.0
    heap_stamp: float | None = None
    namespace: Namespace | None = None  # set on roots only

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def tail_hash(self) -> bytes:
        return self.hashes[-1]

    @property
    def head_hash(self) -> bytes:
        return self.hashes[0]


class RadixCache:
    """Prefix cache as a radix tree of whole blocks; see the module docstring."""

    def __init__(
        self, allocator: BlockAllocator, block_size: int, clock: Callable[[], float] = time.monotonic,
        policy: EvictionPolicy | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self.num_evictions = 0
        self._clock = clock
        self._roots: dict[Namespace, RadixNode] = {}
        self._node_of: dict[int, RadixNode] = {}  # registered block id -> its node
        self._num_evictable = 0
        self.policy = policy if policy is not None else EvictionPolicy()
        self.policy.attach(allocator.num_blocks)
        # Called with (block_id, block_hash) pairs before evicted (or reset) blocks are freed.
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None

    # ---- sizes -----------------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, referenced or not."""
        return len(self._node_of)

    @property
    def num_evictable_blocks(self) -> int:
        """Registered blocks with ref count 0."""
        return self._num_evictable

    @property
    def num_protected_blocks(self) -> int:
        """Registered blocks some request references."""
        return len(self._node_of) - self._num_evictable

    # ---- lookup ----------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], block_hashes: Sequence[bytes], namespace: Namespace) -> list[int]:
        """Blocks caching the longest run of whole leading blocks of `tokens` (hashes unused).

        Touches the matched nodes' recency and splits the last one when the match ends inside it.
        """
        root = self._roots.get(namespace)
        if root is None:
            return []
        tokens = tokens if isinstance(tokens, tuple) else tuple(tokens)
        blocks: list[int] = []
        self._walk(root, tokens, len(tokens) // self.block_size * self.block_size, blocks)
        return blocks

    def _walk(
        self, root: RadixNode, tokens: tuple[int, ...], limit: int, blocks: list[int] | None = None
    ) -> tuple[RadixNode, int]:
        """Follow `tokens[:limit]` (whole blocks) down from `root`; returns the deepest node reached and
        the number of tokens it covers, appending the path's block ids to `blocks` if given. Splits a
        partially matched node and touches the path."""
        bs, now, touch = self.block_size, self._clock(), self.policy.touch
        node, pos = root, 0
        while pos < limit:
            child = node.children.get(tokens[pos : pos + bs])
            if child is None:
                break
            end = pos + len(child.key)
            # Common case first: the whole edge matches (one C-level tuple comparison).
            if end > limit or tokens[pos:end] != child.key:
                # The match ends inside this edge: split it so the request holds whole nodes. The
                # next lookup (in the upper node's only child) then misses and ends the walk.
                child = self._split(child, self._common_blocks(child.key, tokens, pos, limit))
                end = pos + len(child.key)
            touch(child, now)
            if blocks is not None:
                blocks.extend(child.blocks)
            node, pos = child, end
        return node, pos

    def _common_blocks(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int, limit: int) -> int:
        """How many whole leading blocks of `key` equal `tokens[pos:limit]` (>= 1 by the child lookup).

        Prefix equality is monotone in length, so binary search over whole-block lengths."""
        bs = self.block_size
        lo, hi = 1, min(len(key), limit - pos) // bs
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tokens[pos : pos + mid * bs] == key[: mid * bs]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut `node` after `num_blocks` blocks; returns the new upper node. `node` keeps the lower
        part, its children and its heap entry (still valid: the lower part is the same leaf)."""
        cut = num_blocks * self.block_size
        parent = node.parent
        assert parent is not None
        depth = node.depth - len(node.blocks) + num_blocks
        upper = RadixNode(node.key[:cut], node.blocks[:num_blocks], node.hashes[:num_blocks], parent, depth)
        upper.last_access, upper.hits, upper.hit_time, upper.gap = node.last_access, node.hits, node.hit_time, node.gap
        refs = self.allocator.ref_counts
        upper.num_referenced = sum(1 for b in upper.blocks if refs[b] > 0)
        for block_id in upper.blocks:
            self._node_of[block_id] = upper
        parent.children[node.key[: self.block_size]] = upper
        node.key, node.blocks, node.hashes = node.key[cut:], node.blocks[num_blocks:], node.hashes[num_blocks:]
        node.num_referenced -= upper.num_referenced
        node.parent = upper
        upper.children[node.key[: self.block_size]] = node
        self.policy.reshaped(upper)
        return upper

    # ---- registration ----------------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        block_hashes: Sequence[bytes],
        blocks: Sequence[int],
        namespace: Namespace,
    ) -> int:
        """Register `blocks` (block i holds tokens[i*bs:(i+1)*bs]); returns how many leading blocks
        were already present. Those keep their cached ids; the caller's duplicates are not registered
        (the caller swaps them for `match`'s ids). The rest becomes one new leaf, with its hashes."""
        num_blocks = min(len(blocks), len(tokens) // self.block_size)
        if num_blocks == 0:
            return 0
        if len(block_hashes) < num_blocks:
            raise ValueError(f"insert of {num_blocks} blocks needs as many block hashes, got {len(block_hashes)}")
        tokens = tuple(tokens[: num_blocks * self.block_size])
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = RadixNode((), [], [], None, 0, namespace=namespace)
        node, pos = self._walk(root, tokens, len(tokens))
        present = pos // self.block_size
        if present < num_blocks:
            self._add_leaf(node, tokens[pos:], list(blocks[present:num_blocks]), list(block_hashes[present:num_blocks]))
        return present

    def _add_leaf(self, parent: RadixNode, key: tuple[int, ...], blocks: list[int], hashes: list[bytes]) -> None:
        node_of = self._node_of
        if not node_of.keys().isdisjoint(blocks):
            raise ValueError(f"block {next(b for b in blocks if b in node_of)} is already registered")
        leaf = RadixNode(key, blocks, hashes, parent, parent.depth + len(blocks))
        self.policy.inserted(leaf, self._clock())
        refs = self.allocator.ref_counts
        leaf.num_referenced = len(blocks) - [refs[b] for b in blocks].count(0)
        node_of.update(dict.fromkeys(blocks, leaf))
        parent.children[key[: self.block_size]] = leaf
        self._num_evictable += len(blocks) - leaf.num_referenced
        if self._is_evictable_leaf(leaf):
            self.policy.push(leaf)

    # ---- references ------------------------------------------------------------------------------

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more reference to each block; a registered block stops being evictable. Each node
        taken counts one hit for the eviction policy."""
        node_of, incref, last = self._node_of, self.allocator.incref, None
        for block_id in blocks:
            node = node_of.get(block_id)
            if node is not None and node is not last:
                self.policy.hit(node)
                last = node
            if incref(block_id) == 1 and node is not None:
                node.num_referenced += 1
                self._num_evictable -= 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; at 0 a registered block becomes evictable, an
        unregistered one goes back to the free list."""
        decref, free, node_of, push = self.allocator.decref, self.allocator.free, self._node_of, self.policy.push
        for block_id in blocks:
            if decref(block_id) != 0:
                continue
            node = node_of.get(block_id)
            if node is None:
                free(block_id)
                continue
            node.num_referenced -= 1
            self._num_evictable += 1
            if node.num_referenced == 0 and not node.children:
                push(node)

    # ---- eviction --------------------------------------------------------------------------------

    @staticmethod
    def _is_evictable_leaf(node: RadixNode) -> bool:
        return not node.children and node.num_referenced == 0 and node.parent is not None

    def evict(self, num_blocks: int) -> list[int]:
        """Free `num_blocks` blocks, or every evictable one if fewer; returns the freed ids. Leaves go
        in the policy's order, trimmed from the tail to free no more than asked or than the policy
        takes at once (`EvictionPolicy.take`: Belady ranks a leaf's head apart from its tail)."""
        freed: list[int] = []
        while len(freed) < num_blocks:
            node = self.policy.pop()
            if node is None:
                break
            if node.removed or not self._is_evictable_leaf(node):
                continue  # stale: the node is pushed again when it becomes a candidate
            need = self.policy.take(node.hashes, num_blocks - len(freed))
            self.policy.evicted(node, node.hashes[-need] if need < len(node.blocks) else node.hashes[0])
            if need < len(node.blocks):
                freed.extend(self._trim_leaf(node, need))
            else:
                freed.extend(node.blocks)
                self._remove_leaf(node)
        self.num_evictions += len(freed)
        return freed

    def _trim_leaf(self, node: RadixNode, num_blocks: int) -> list[int]:
        """Evict the last `num_blocks` blocks of a candidate leaf; it stays a (shorter) candidate."""
        keep = len(node.blocks) - num_blocks
        dropped = node.blocks[keep:]
        if self.on_evict is not None:
            self.on_evict(list(zip(dropped, node.hashes[keep:], strict=True)))
        node.key, node.blocks, node.hashes = node.key[: keep * self.block_size], node.blocks[:keep], node.hashes[:keep]
        node.depth -= num_blocks
        self._free_blocks(dropped)
        self.policy.reshaped(node)
        self.policy.push(node)
        return dropped

    def _free_blocks(self, blocks: list[int]) -> None:
        node_of, free = self._node_of, self.allocator.free
        for block_id in blocks:
            del node_of[block_id]
            free(block_id)
        self._num_evictable -= len(blocks)

    def _remove_leaf(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None
        if self.on_evict is not None:
            self.on_evict(list(zip(node.blocks, node.hashes, strict=True)))
        del parent.children[node.key[: self.block_size]]
        self._free_blocks(node.blocks)
        node.removed, node.parent = True, None
        if parent.parent is not None:
            if self._is_evictable_leaf(parent):
                self.policy.push(parent)
        elif not parent.children:
            del self._roots[parent.namespace]  # type: ignore[arg-type]

    def reset(self) -> bool:
        """Unregister and free every block; refused (False) while a registered block is referenced."""
        if self.num_protected_blocks:
            return False
        if self.on_evict is not None and self._node_of:
            nodes = {id(node): node for node in self._node_of.values()}.values()
            self.on_evict([pair for node in nodes for pair in zip(node.blocks, node.hashes, strict=True)])
        for block_id in self._node_of:
            self.allocator.free(block_id)
        self._roots.clear()
        self._node_of.clear()
        self.policy.clear()
        self._num_evictable = 0
        return True

    # ---- checks (tests) --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recount everything from the tree and the allocator; raises AssertionError on a mismatch."""
        bs, refs, alloc = self.block_size, self.allocator.ref_counts, self.allocator
        queued = self.policy.queued()
        seen: set[int] = set()
        for namespace, root in self._roots.items():
            assert root.parent is None and not root.blocks and root.namespace == namespace
            assert root.children, f"empty root kept for {namespace}"
            stack = list(root.children.items())
            while stack:
                first, node = stack.pop()
                assert not node.removed and node.parent is not None
                assert node.parent.children.get(first) is node and node.key[:bs] == first
                assert node.blocks and len(node.key) == len(node.blocks) * bs == len(node.hashes) * bs
                assert node.num_referenced == sum(1 for b in node.blocks if refs[b] > 0)
                assert node.depth == node.parent.depth + len(node.blocks), "depth drifted"
                assert (node.heap_stamp is not None) == (id(node) in queued)
                if self._is_evictable_leaf(node):
                    assert id(node) in queued, "evictable leaf missing from the eviction heap"
                for block_id in node.blocks:
                    assert self._node_of.get(block_id) is node and block_id not in seen
                    assert not alloc.is_free(block_id), f"block {block_id} both free and registered"
                    seen.add(block_id)
                stack.extend(node.children.items())
        assert seen == set(self._node_of), "block map and tree disagree"
        check_accounting(alloc, seen, self._num_evictable)

