"""pd: prefill and decode on separate workers, joined through the shared KV store.

Workers say their role in `/load` (`kvserve serve --role prefill|decode|mixed`). For each request the
policy makes a `PdPlan`: which decode worker streams the answer, and whether a prefill worker first
computes the prompt's KV (a hand-off) or the decode worker computes it itself (mixed serving):

1. no prefill worker in the pool (`no_prefill_worker`) or no decode worker (`no_decode_worker`) → no
   hand-off; a request that cannot be keyed skips the next two steps (its prompt may well be long);
2. the prompt is already warm on a decode worker (its tree covers more than `cache_threshold` of it)
   → that worker, no hand-off (`warm`): fetching what it holds from the store would only cost time;
3. the prompt is shorter than `min_prompt_tokens` → the least loaded decode worker (`short`): a chat
   turn's prefill is cheaper than a round trip through the store;
4. the chosen decode worker has no reachable store (`remote_tier` not "ok" in its `/load`) → no
   hand-off (`store_down`): its admission could not find the prefill worker's blocks;
5. otherwise → a prefill worker chosen cache-aware (SGLang's rule over the prefill workers' trees),
   then the least loaded decode worker (`handoff`).

Decode workers are chosen by load, except on a warm hit. `mixed` workers count as decode workers; when
no decode worker is in the pool, a prefill worker serves the request whole (`no_decode_worker`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.router.keys import RouteKey
from kvserve.router.policies.base import Decision, LoadTieBreaker, Policy
from kvserve.router.policies.cache_aware import CacheAwarePolicy, CacheAwareSettings, tree_key
from kvserve.router.workers import Worker

PREFILL, DECODE, MIXED = "prefill", "decode", "mixed"
ROLES = (PREFILL, DECODE, MIXED)
MIN_PROMPT_TOKENS = 128
# Plans that count as a fallback to mixed serving (kvserve_router_pd_fallbacks_total).
FALLBACK_REASONS = ("no_prefill_worker", "no_decode_worker", "store_down")


@dataclass(frozen=True, slots=True)
class PdPlan:
    """`prefill` None: the decode worker computes the whole prompt itself."""

    decode: Worker
    prefill: Worker | None
    reason: str
    matched_tokens: int = 0


class PdPolicy(Policy):
    name = "pd"

    def __init__(self, settings: CacheAwareSettings | None = None, min_prompt_tokens: int = MIN_PROMPT_TOKENS) -> None:
        if min_prompt_tokens < 0:
            raise ValueError(f"min_prompt_tokens must be >= 0, got {min_prompt_tokens}")
        # One approximate tree per worker, both pools; request counts for load (the prefill hand-offs bypass
        # the proxy's pending-prefill count that the eta estimate reads).
        self.trees = CacheAwarePolicy(replace(settings or CacheAwareSettings(), load_estimate="requests"))
        self.min_prompt_tokens = min_prompt_tokens
        self._ties = LoadTieBreaker()

    @staticmethod
    def decode_pool(workers: list[Worker]) -> list[Worker]:
        pool = [worker for worker in workers if worker.load.role != PREFILL]
        return pool or list(workers)

    @staticmethod
    def prefill_pool(workers: list[Worker]) -> list[Worker]:
        return [worker for worker in workers if worker.load.role == PREFILL]

    def plan(self, key: RouteKey, workers: list[Worker]) -> PdPlan:
        """`workers`: the healthy pool (non-empty)."""
        decoders, prefillers = self.decode_pool(workers), self.prefill_pool(workers)
        if not prefillers:
            return PdPlan(self._ties.least_loaded(decoders), None, "no_prefill_worker")
        if decoders == prefillers:  # only prefill workers are left: one of them serves the request whole
            return PdPlan(self._ties.least_loaded(decoders), None, "no_decode_worker")
        if key.usable:
            assert key.tokens is not None
            warm = self._warm(key, decoders)
            if warm is not None:
                return warm
            if len(key.tokens) < self.min_prompt_tokens:
                return PdPlan(self._ties.least_loaded(decoders), None, "short")
        decode = self._ties.least_loaded(decoders)
        if decode.load.remote_tier != "ok":
            return PdPlan(decode, None, "store_down")
        prefill = self.trees.choose(key, prefillers)
        return PdPlan(decode, prefill.worker, "handoff", prefill.matched_tokens)

    def _warm(self, key: RouteKey, decoders: list[Worker]) -> PdPlan | None:
        seq = tree_key(key)
        matches = {worker: max(self.trees.tree(worker).match(seq) - 1, 0) for worker in decoders}
        best = max(matches.values())
        assert key.tokens is not None
        if best <= self.trees.settings.cache_threshold * len(key.tokens):
            return None
        holders = [worker for worker in decoders if matches[worker] == best]
        return PdPlan(self._ties.least_loaded(holders), None, "warm", best)

    def choose(self, key: RouteKey, workers: list[Worker]) -> Decision:
        """A retry after the planned decode worker failed: the least loaded other decode worker."""
        return Decision(self._ties.least_loaded(self.decode_pool(workers)), "retry")

    def on_routed(self, key: RouteKey, worker: Worker) -> None:
        self.trees.on_routed(key, worker)

    def on_join(self, worker: Worker) -> None:
        self.trees.on_join(worker)

    def on_leave(self, worker: Worker) -> None:
        self.trees.on_leave(worker)
