"""cache_aware: SGLang's rule over approximate per-worker token trees.

1. Load imbalanced (max − min > `balance_abs` and max > `balance_rel` × min) → the least loaded worker,
   if that costs no copy worth avoiding: it holds more than `cache_threshold` of the prompt itself, or
   what it lacks is a hot prefix (`HotPrefixes`: one bringing its holders more traffic than the other
   workers get, such as the system prompt every chat user sends, or a document most questions name).
   A cold prefix (one of 4 equally asked documents on 4 workers) is not copied for one request's wait.
2. Else, if the best tree match covers more than `cache_threshold` of the prompt → that worker.
3. Else → the worker with the smallest tree (then the least loaded): new prefixes spread out.

That is the rule with `load_estimate="requests"`. With `"eta"` (the default) steps 2 and 3 weigh each
worker's estimated time to first token (`EtaCost`: the prompt tokens its tree lacks + the prefill and
requests this router has in flight there) instead of its request count: a hit goes to the best match
unless the work queued there outweighs computing the prompt on another worker (reason `rebalance`);
a miss goes to the worker whose queue finishes first (the smallest tree among equals); then
`ShareGuard` may send it to a less busy worker when the chosen one has served more than `max_share` of
the recent requests (with `warm_copy`, when that worker lacks the prefix: keep it, and copy the prefix
there with a duplicate nobody waits for). (By estimate alone and without the share guard, a simulated
RAG run once put 3 of 4 documents on one worker and 60% of the requests with them; the smallest tree
within half a prompt of the cheapest, the rule in between, started first reads behind another worker's
queue.) The
request count alone missed the difference between a busy worker and a busy one with an idle twin: over
2 workers, a conversation's turn waited behind two others on its worker while the other idled, and
chat TTFT p90 was 1.3× one worker's (benchmarks/results/router.md). Step 1 stays SGLang's.

The chosen worker's tree then gets the prompt. A tree holds at most `tree_budget` tokens and never more
than its worker can keep: its KV pool and the host RAM and disk tiers below it, from which it loads a
prompt back instead of computing it (`num_blocks` + `tier_blocks`, × `block_size`, from `/load`). Tree
keys start with the namespace marker, so a tenant's prompt can only ever match what was sent for the same
tenant (and cache_salt).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvserve.router.config import (
    BALANCE_ABS,
    BALANCE_REL,
    CACHE_THRESHOLD,
    LOAD_ESTIMATES,
    MAX_SHARE,
    SHARE_MIN_SEEN,
    TREE_BUDGET,
)
from kvserve.router.keys import RouteKey, namespace_marker
from kvserve.router.policies.base import (
    Decision,
    HotPrefixes,
    LoadTieBreaker,
    Policy,
    ShareGuard,
    is_imbalanced,
)
from kvserve.router.policies.eta import EtaCost
from kvserve.router.policies.store import SharedStore
from kvserve.router.radix import TokenTree
from kvserve.router.workers import Worker


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    balance_abs: int = BALANCE_ABS
    balance_rel: float = BALANCE_REL
    cache_threshold: float = CACHE_THRESHOLD
    tree_budget: int = TREE_BUDGET
    load_estimate: str = "eta"  # "requests": SGLang's rule as is
    cost: EtaCost = EtaCost()
    max_share: float = MAX_SHARE  # with eta: ShareGuard (1.0: off)
    warm_copy: bool = True  # ShareGuard copies a prefix with a duplicate nobody waits for, not by moving a request
    store: SharedStore = SharedStore()  # workers sharing a KV store load what another one computed
    share_min_seen: int = SHARE_MIN_SEEN  # ShareGuard acts from this many routed requests on

    def __post_init__(self) -> None:
        if self.load_estimate not in LOAD_ESTIMATES:
            raise ValueError(f"load_estimate must be one of {LOAD_ESTIMATES}, got {self.load_estimate!r}")
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError("balance thresholds: abs must be >= 0 and rel >= 1.0")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.tree_budget < 1:
            raise ValueError(f"tree_budget must be >= 1, got {self.tree_budget}")
        if not 0.0 < self.max_share <= 1.0:
            raise ValueError(f"max_share must be in (0, 1], got {self.max_share}")


def tree_key(key: RouteKey) -> list[int]:
    assert key.tokens is not None and key.namespace is not None
    return [namespace_marker(key.namespace), *key.tokens]


class CacheAwarePolicy(Policy):
    name = "cache_aware"

    def __init__(self, settings: CacheAwareSettings | None = None) -> None:
        self.settings = settings or CacheAwareSettings()
        self._trees: dict[Worker, TokenTree] = {}
        self._answered: dict[Worker, TokenTree] = {}  # prompts each worker has answered: computed, in its store
        self._ties = LoadTieBreaker()
        self.hot = HotPrefixes()
        self.shares = ShareGuard(self.settings.max_share, warm_copy=self.settings.warm_copy,
                                 min_seen=self.settings.share_min_seen)

    def tree(self, worker: Worker, trees: dict[Worker, TokenTree] | None = None) -> TokenTree:
        """The worker's tree (of `trees`, default what was sent there), bounded by what the worker can hold:
        a tree that remembered more than the worker's KV pool would predict hits the worker evicted long ago."""
        trees = self._trees if trees is None else trees
        budget = min(self.settings.tree_budget, worker.capacity_tokens or self.settings.tree_budget)
        tree = trees.get(worker)
        if tree is None:
            tree = trees[worker] = TokenTree(budget)
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
        held = self._matched(seq, workers)
        if not s.store.applies(workers):
            return self._choose(key, workers, held, imbalanced)
        answered = self._matched(seq, workers, self._answered)
        matches = s.store.effective(held, answered)  # what another worker answered is in the store: loadable
        decision = self._choose(key, workers, matches, imbalanced)
        if matches[decision.worker] > held[decision.worker] and decision.reason in (
                "cache_hit", "rebalance", "smallest_tree"):
            decision = dataclasses.replace(decision, reason="shared_store")
        return decision  # no probe hint: these trees forget what the store still holds (see SharedStore)

    def _choose(self, key: RouteKey, workers: list[Worker], matches: dict[Worker, int], imbalanced: bool) -> Decision:
        """SGLang's rule (module docstring) over `matches`, the tokens each worker holds or can load."""
        s = self.settings
        assert key.tokens is not None
        best = max(matches.values())
        hit = best > s.cache_threshold * len(key.tokens)
        if imbalanced:
            emptiest = None if hit else lambda w: (self.tree(w).num_tokens,)  # a new prefix: spread it
            chosen = self._ties.least_loaded(workers, emptiest)
            target = matches[chosen]
            if target > s.cache_threshold * len(key.tokens) or self.hot.worth_copying(key, matches, target):
                return Decision(chosen, "imbalance", target)
        if s.load_estimate == "eta":
            return self.shares.apply(self._by_eta(key, workers, matches, hit), workers, matches, len(key.tokens),
                                     lambda length: self.hot.share(key, length))
        if hit:
            holders = [worker for worker in workers if matches[worker] == best]
            return Decision(self._ties.least_loaded(holders), "cache_hit", best)
        smallest = min(self.tree(worker).num_tokens for worker in workers)
        fresh = [worker for worker in workers if self.tree(worker).num_tokens == smallest]
        chosen = self._ties.least_loaded(fresh)
        return Decision(chosen, "smallest_tree", matches[chosen])

    def _by_eta(self, key: RouteKey, workers: list[Worker], matches: dict[Worker, int], hit: bool) -> Decision:
        """Steps 2 and 3 by estimated time to first token. A hit: the cheapest worker (then the least
        loaded). A miss: the worker whose queue finishes first (the least estimate), the smallest tree
        among equals (a new prefix brings later requests with it: spreading prefixes spreads the load to
        come), then the least loaded. The rule before took the smallest tree among workers within half a
        prompt's prefill of the cheapest, which could start a document's first read behind another
        worker's queue while its questions piled up behind it (the RAG tails); the share guard now keeps
        the prefixes' requests from piling onto one worker."""
        assert key.tokens is not None
        costs = self.settings.cost.costs(len(key.tokens), matches)
        if hit:
            chosen = self._ties.least_loaded(EtaCost.cheapest(costs))
            reason = "cache_hit" if matches[chosen] == max(matches.values()) else "rebalance"
            return Decision(chosen, reason, matches[chosen])
        able = EtaCost.cheapest(costs)
        smallest = min(self.tree(worker).num_tokens for worker in able)
        chosen = self._ties.least_loaded([worker for worker in able if self.tree(worker).num_tokens == smallest])
        return Decision(chosen, "smallest_tree", matches[chosen])

    def on_routed(self, key: RouteKey, worker: Worker) -> None:
        self.hot.add(key)
        self.shares.add(worker)
        self.on_copied(key, worker)

    def on_copied(self, key: RouteKey, worker: Worker) -> None:
        if key.usable:
            self.tree(worker).insert(tree_key(key))

    def on_prefilled(self, key: RouteKey, worker: Worker) -> None:
        if key.usable and self.settings.store.applies([worker]):
            self.tree(worker, self._answered).insert(tree_key(key))

    def held_by(self, key: RouteKey, workers: list[Worker]) -> dict[Worker, int] | None:
        return self._matched(tree_key(key), workers) if key.usable else None

    def _matched(self, seq: list[int], workers: list[Worker], trees: dict[Worker, TokenTree] | None = None
                 ) -> dict[Worker, int]:
        """The prompt tokens of `seq` (namespace marker first) each worker's tree (of `trees`) matches."""
        return {worker: max(self.tree(worker, trees).match(seq) - 1, 0) for worker in workers}

    def on_join(self, worker: Worker) -> None:
        self._trees[worker] = TokenTree(self.settings.tree_budget)
        self._answered.pop(worker, None)

    def on_leave(self, worker: Worker) -> None:
        self._trees.pop(worker, None)
        self._answered.pop(worker, None)
