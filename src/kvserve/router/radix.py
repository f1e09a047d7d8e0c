"""An approximate token radix tree per worker: what the router *sent* there, not what it holds.

SGLang's cache-aware router keeps one such tree per worker and steers a request to the worker whose
tree matches the longest prefix. The tree is approximate on purpose (the worker may have evicted
those blocks); it costs no worker cooperation. It is bounded: when it holds more than `budget`
tokens, least recently matched leaves are dropped until it holds `budget * LOW_WATER`.

Keys are lists of ints. The router prepends a namespace marker (a negative int, never a token id)
so trees of different tenants share no path.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

LOW_WATER = 0.9  # evict down to this fraction of the budget, so eviction runs rarely


@dataclass(slots=True, eq=False)
class _Node:
    key: list[int]  # the edge label leading into this node
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_access: int = 0


def _common_length(edge: list[int], tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of `edge` equal tokens[start:]."""
    n = min(len(edge), len(tokens) - start)
    if tokens[start : start + n] == edge[:n]:
        return n
    i = 0
    while i < n and edge[i] == tokens[start + i]:
        i += 1
    return i


class TokenTree:
    """Insert token sequences, match the longest stored prefix, evict to a token budget."""

    def __init__(self, budget: int) -> None:
        if budget < 1:
            raise ValueError(f"tree token budget must be >= 1, got {budget}")
        self.budget = budget
        self._root = _Node(key=[], parent=None)
        self._size = 0
        self._clock = itertools.count(1)

    @property
    def num_tokens(self) -> int:
        return self._size

    def match(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of `tokens` in the tree (touches the matched path)."""
        tick = next(self._clock)
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            common = _common_length(child.key, tokens, i)
            child.last_access = tick
            i += common
            if common < len(child.key):
                break
            node = child
        return i

    def insert(self, tokens: Sequence[int]) -> None:
        """Add `tokens` (splitting edges where they diverge), then evict if over budget."""
        tick = next(self._clock)
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(key=list(tokens[i:]), parent=node, last_access=tick)
                node.children[tokens[i]] = leaf
                self._size += len(leaf.key)
                break
            common = _common_length(child.key, tokens, i)
            if common < len(child.key):
                child = self._split(child, common)  # the part below keeps its own age
            child.last_access = tick
            node, i = child, i + common
        if self._size > self.budget:
            self.evict(int(self.budget * LOW_WATER))

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        upper = _Node(key=child.key[:at], parent=parent)
        parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def evict(self, target: int) -> None:
        """Drop least recently used leaves until at most `target` tokens remain."""
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        while self._size > target and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self._size -= len(leaf.key)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                leaves.append(node)
        return leaves

    def check_invariants(self) -> None:
        """Sizes add up, children are keyed by their first token, parents point back."""
        total, stack = 0, [self._root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.key and child.key[0] == first, "child keyed by a token its edge does not start with"
                assert child.parent is node, "broken parent link"
                total += len(child.key)
                stack.append(child)
        assert total == self._size, f"tree size {self._size} but edges hold {total} tokens"
        assert self._size <= self.budget, f"tree holds {self._size} tokens over its budget {self.budget}"
