"""In-batch prefix sharing at admission: hold a request back while a running one computes its prefix.

Nothing enters the prefix cache until a request's blocks are computed and published. When sixteen
requests with one long prefix arrive together, each admitted in the same step would compute the whole
prefix itself (the cache is still empty for all of them). SGLang's scheduler avoids that with in-batch
prefix caching; this is the same idea on block hashes, so it works for every cache kind (radix, hash):

- a waiting request whose leading full blocks (chained hashes: equal hash = equal tokens before it and
  equal namespace, so tenants never match) go at least one block past its current cache hit into blocks
  that a running request is still prefilling and has not yet published, is *held*: it stays waiting for
  this step (not a refusal: the queue goes on behind it), and is admitted once those blocks are
  registered, taking them as a hit;
- it is never starved: a request is held for at most `max_hold_steps` steps since it was first held
  (the default covers a 2,048-token prefix at a 64-token chunk), and only while its leader still runs
  and prefills (a finished, preempted or decoding leader holds nobody);
- requests that share nothing are never held, and the check costs one dict lookup per waiting request
  looked at (leaders are indexed by their first block hash once per step).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.engine.request import Request

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

DEFAULT_MAX_HOLD_STEPS = 32


@dataclass(slots=True)
class PrefixHold:
    """Decides, per waiting request, whether to hold it for a running request's prefix (see above)."""

    block_size: int
    max_hold_steps: int = DEFAULT_MAX_HOLD_STEPS
    num_holds: int = 0  # request-steps held (statistics)
    _held_since: dict[str, int] = field(default_factory=dict)  # request id -> step first held
    _leaders: dict[bytes, list[Request]] = field(default_factory=dict)  # first block hash -> prefillers
    _step: int = -1

    def begin_step(self, step: int, running: list[Request], waiting: Iterable[Request]) -> None:
        """Index this step's leaders (running requests with prompt blocks not yet published) and forget
        requests that left the queue (admitted or aborted)."""
        self._step = step
        self._leaders = {}
        for request in running:
            self.add_leader(request)
        if self._held_since:
            waiting_ids = {request.request_id for request in waiting}
            for request_id in [r for r in self._held_since if r not in waiting_ids]:
                del self._held_since[request_id]

    def add_leader(self, request: Request) -> None:
        """A request running this step (already running, or admitted a moment ago) may lead others."""
        if _unpublished_prompt_blocks(request, self.block_size) and request.block_hashes:
            self._leaders.setdefault(request.block_hashes[0], []).append(request)

    def should_hold(self, request: Request, num_matched_blocks: int) -> bool:
        """Whether `request` (its blocks hashed by a match that found `num_matched_blocks`) should wait
        for a leader to publish blocks it shares beyond that hit."""
        if not request.block_hashes or not self._leaders:
            return False
        leaders = self._leaders.get(request.block_hashes[0], ())
        if not any(self._gain(request, leader, num_matched_blocks) for leader in leaders):
            self._held_since.pop(request.request_id, None)
            return False
        first = self._held_since.setdefault(request.request_id, self._step)
        if self._step - first >= self.max_hold_steps:
            return False  # held long enough: compute the prefix itself rather than wait on
        self.num_holds += 1
        return True

    def _gain(self, request: Request, leader: Request, num_matched_blocks: int) -> bool:
        """Whether `leader` will publish at least one full block of `request`'s prefix beyond its hit."""
        if leader is request or leader.namespace != request.namespace:
            return False
        limit = min(len(request.block_hashes), len(leader.block_hashes), leader.num_prompt_tokens // self.block_size)
        # The first block past both the hit and what the leader already published: shared and still to come?
        index = max(num_matched_blocks, leader.num_published_blocks)
        return index < limit and request.block_hashes[index] == leader.block_hashes[index]


def _unpublished_prompt_blocks(request: Request, block_size: int) -> bool:
    """Whether the request has full prompt blocks still to compute and publish."""
    return request.num_published_blocks < request.num_prompt_tokens // block_size


def make_prefix_hold(config: EngineConfig) -> PrefixHold | None:
    """The hold for an engine, or None when it is turned off or nothing is ever cached (cache off)."""
    enabled = not config.disable_prefix_hold and config.prefix_cache != "off"
    return PrefixHold(config.block_size) if enabled else None
