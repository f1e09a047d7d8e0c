"""cache_aware: SGLang's rule over approximate per-worker token trees.

1. Load imbalanced (max − min > `balance_abs` and max > `balance_rel` × min) → the least loaded worker,
   if that costs no copy worth avoiding: it holds more than `cache_threshold` of the prompt itself, or
   what it lacks is a hot prefix (`HotPrefixes`: one bringing its holders more traffic than the other
   workers get, such as the system prompt every chat user sends, or a document most questions name).
   A cold prefix (one of 4 equally asked documents on 4 workers) is not copied for one request's wait.
2. Else, if the best tree match covers more than `cache_threshold` of the prompt → that worker.
3. Else → the worker with the smallest tree (then the least loaded): new prefixes spread out.

The chosen worker's tree then gets the prompt. A tree holds at most `tree_budget` tokens and never more
than its worker's KV pool (`num_blocks` × `block_size` from `/load`). Tree keys start with the namespace marker, so a
tenant's prompt can only ever match what was sent for the same tenant (and cache_salt).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.router.config import BALANCE_ABS, BALANCE_REL, CACHE_THRESHOLD, TREE_BUDGET
from kvserve.router.keys import RouteKey, namespace_marker
from kvserve.router.policies.base import Decision, HotPrefixes, LoadTieBreaker, Policy, is_imbalanced
from kvserve.router.radix import TokenTree
from kvserve.router.workers import Worker


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    balance_abs: int = BALANCE_ABS
    balance_rel: float = BALANCE_REL
    cache_threshold: float = CACHE_THRESHOLD
    tree_budget: int = TREE_BUDGET

    def __post_init__(self) -> None:
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError("balance thresholds: abs must be >= 0 and rel >= 1.0")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.tree_budget < 1:
            raise ValueError(f"tree_budget must be >= 1, got {self.tree_budget}")


def tree_key(key: RouteKey) -> list[int]:
    assert key.tokens is not None and key.namespace is not None
    return [namespace_marker(key.namespace), *key.tokens]


class CacheAwarePolicy(Policy):
    name = "cache_aware"

    def __init__(self, settings: CacheAwareSettings | None = None) -> None:
        self.settings = settings or CacheAwareSettings()
        self._trees: dict[Worker, TokenTree] = {}
        self._ties = LoadTieBreaker()
        self.hot = HotPrefixes()

    def tree(self, worker: Worker) -> TokenTree:
        """The worker's tree, bounded by what the worker can hold: a tree that remembered more than the
        worker's KV pool would predict hits the worker evicted long ago."""
        budget = min(self.settings.tree_budget, worker.capacity_tokens or self.settings.tree_budget)
        tree = self._trees.get(worker)
        if tree is None:
            tree = self._trees[worker] = TokenTree(budget)
        elif tree.budget != budget:
            tree.budget = budget
            if tree.num_tokens > budget:
                tree.evict(budget)
        return tree

    def choose(self, key: RouteKey, workers: list[Worker]) -> Decision:
        s = self.settings
        imbalanced = is_imbalanced(workers, s.balance_abs, s.balance_rel)
        if not key.usable:
            return Decision(self._ties.least_loaded(workers), "imbalance" if imbalanced else "unkeyed")
        seq = tree_key(key)
        matches = {worker: max(self.tree(worker).match(seq) - 1, 0) for worker in workers}
        best = max(matches.values())
        hit = best > s.cache_threshold * len(key.tokens)
        if imbalanced:
            chosen = self._ties.least_loaded(workers)
            target = matches[chosen]
            if target > s.cache_threshold * len(key.tokens) or self.hot.worth_copying(key, matches, target):
                return Decision(chosen, "imbalance", target)
        if hit:
            holders = [worker for worker in workers if matches[worker] == best]
            return Decision(self._ties.least_loaded(holders), "cache_hit", best)
        smallest = min(self.tree(worker).num_tokens for worker in workers)
        fresh = [worker for worker in workers if self.tree(worker).num_tokens == smallest]
        chosen = self._ties.least_loaded(fresh)
        return Decision(chosen, "smallest_tree", matches[chosen])

    def on_routed(self, key: RouteKey, worker: Worker) -> None:
        self.hot.add(key)
        if key.usable:
            self.tree(worker).insert(tree_key(key))

    def on_join(self, worker: Worker) -> None:
        self._trees[worker] = TokenTree(self.settings.tree_budget)

    def on_leave(self, worker: Worker) -> None:
        self._trees.pop(worker, None)
