"""The replay driver: requests arrive at their timestamps and go through the real cache classes.

Each request does what the engine does to the prefix cache, with no model: match its prompt (capped so
one token is computed), wait in a FIFO queue until the pool can hold it (free + evictable blocks, in-use
blocks protected), acquire the hit, evict for and allocate the rest (prompt and output blocks at once),
insert the prompt's full blocks (swapping in cached duplicates), run for a modelled time, then release
its blocks tail first. Output blocks are held but not registered: the trace does not say what they hold.
Service time = uncached prompt tokens / prefill rate + output tokens * time per output token, so
requests overlap as in serving. The cache's clock is the simulated time in seconds. `overlap=False`
replays sequentially instead (each request served in no time, so it holds nothing past its own
admission): the setting of most published cache simulations, kept for comparison with them. On the
Mooncake trace at 2% of its distinct blocks, overlapping requests hold about 36k of the 62k blocks.

`belady` gets the future from the trace: the next request (in arrival order, which is admission
order) whose matchable prompt holds the block (`NextUseOracle`).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvserve.kv.block_allocator import BlockAllocator
from kvserve.prefix.eviction import EvictionPolicy
from kvserve.prefix.hashed import HashCache
from kvserve.prefix.policies import make_policy
from kvserve.prefix.radix import RadixCache
from kvserve.replay.expand import ExpandedPrompt, expand
from kvserve.replay.oracles import ORACLE_POLICIES, make_oracle
from kvserve.replay.trace import TraceRequest


@dataclass(slots=True, frozen=True)
class ReplayConfig:
    cache_blocks: int
    block_size: int = 16
    eviction: str = "lru"
    prefix_cache: str = "radix"  # radix | hash
    prefill_tokens_per_s: float = 10_000.0
    decode_ms_per_token: float = 30.0
    protect_waiting: int = 4  # waiting requests behind the head whose prefixes are refreshed first
    overlap: bool = True  # False: each request is served in no time (sequential; no blocks held across)


@dataclass(slots=True)
class ReplayResult:
    eviction: str
    prefix_cache: str
    cache_blocks: int
    block_size: int
    requests: int = 0
    dropped: int = 0  # larger than the whole cache: counted as misses
    prompt_tokens: int = 0
    hit_tokens: int = 0
    prompt_blocks: int = 0  # full prompt blocks
    hit_blocks: int = 0
    evictions: int = 0
    max_waiting: int = 0
    pinned_sum: int = 0  # blocks in use by running requests, summed over admissions
    seconds: float = 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_pinned(self) -> float:
        """Blocks held by running requests when a request is admitted, on average."""
        return self.pinned_sum / self.requests if self.requests else 0.0

    @property
    def block_hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


def distinct_blocks(requests: Sequence[TraceRequest], block_size: int) -> int:
    """Distinct full prompt blocks of the trace at `block_size` (what an unbounded cache would hold)."""
    return len({h for request in requests for h in expand(request, block_size).hashes})


class NextUseOracle:
    """Next use of a replay block: the first later request (by arrival, the order requests are admitted
    in) whose *matchable* prompt holds it.

    Keyed by trace block, each use remembers how many tokens of that trace block the request can match
    (its prompt capped so one token is computed, in whole replay blocks), so a request that ends inside
    a trace block is not a use of the replay blocks past its end; a request too big for the cache is
    served without it and is no use at all. A next use that never touches the block would leave its
    value in the past, and a stale near use keeps a dead block forever.
    """

    def __init__(self, requests: Sequence[TraceRequest], block_size: int, cache_blocks: int) -> None:
        size = self.trace_block_size = requests[0].block_size if requests else 1
        self.uses: dict[int, tuple[list[int], list[int]]] = {}  # trace id -> (request indices, tokens usable)
        for index, request in enumerate(requests):
            if -(-(request.input_length + request.output_length) // block_size) > cache_blocks:
                continue  # dropped: never matched
            usable = (request.input_length - 1) // block_size * block_size
            for position, block_id in enumerate(request.hash_ids[: -(-usable // size)]):
                indices, covered = self.uses.setdefault(block_id, ([], []))
                indices.append(index)
                covered.append(min(size, usable - position * size))
        self.current = 0

    def __call__(self, block_hash: bytes) -> float:
        name = int.from_bytes(block_hash, "little")
        entry = self.uses.get(name // self.trace_block_size)
        if entry is None:
            return math.inf
        indices, covered = entry
        offset = name % self.trace_block_size  # the block's last token within its trace block
        for k in range(bisect.bisect_right(indices, self.current), len(indices)):
            if offset < covered[k]:
                return indices[k]
        return math.inf


class Replay:
    """One replay of one trace through one cache configuration."""

    def __init__(self, requests: Sequence[TraceRequest], config: ReplayConfig) -> None:
        if len({request.block_size for request in requests}) > 1:
            raise ValueError("a trace must use one block size throughout")
        self.requests, self.config = requests, config
        self.now = 0.0
        self.oracle = NextUseOracle(requests, config.block_size, config.cache_blocks)
        policy = self._policy(config.eviction)
        self.allocator = BlockAllocator(config.cache_blocks)
        clock: Callable[[], float] = lambda: self.now
        if config.prefix_cache == "radix":
            self.cache: RadixCache | HashCache = RadixCache(self.allocator, config.block_size, clock, policy)
        elif config.prefix_cache == "hash":
            self.cache = HashCache(self.allocator, config.block_size, clock=clock, policy=policy)
        else:
            raise ValueError(f"replay needs prefix_cache radix or hash, got {config.prefix_cache!r}")
        self.result = ReplayResult(config.eviction, config.prefix_cache, config.cache_blocks, config.block_size)
        self._running: list[tuple[float, int, list[int]]] = []  # (finish time, index, blocks)
        self._waiting: deque[int] = deque()
        self._head: tuple[int, ExpandedPrompt] | None = None  # the queue head's expansion, kept

    def _policy(self, name: str) -> EvictionPolicy:
        if name in ORACLE_POLICIES:
            return make_oracle(name, self._next_use_time, lambda: self.now)
        return make_policy(name, self.oracle if name == "belady" else None)

    def _next_use_time(self, block_hash: bytes) -> float:
        """Arrival time (s) of the block's next use; inf when never."""
        index = self.oracle(block_hash)
        return math.inf if index == math.inf else self.requests[int(index)].timestamp_ms / 1000.0

    def run(self, on_request: Callable[[], None] | None = None) -> ReplayResult:
        start = time.perf_counter()
        for index, request in enumerate(self.requests):
            self._finish_until(request.timestamp_ms / 1000.0)
            self.now = max(self.now, request.timestamp_ms / 1000.0)
            self._waiting.append(index)
            self._admit_waiting()
            if on_request is not None:
                on_request()
        self._finish_until(math.inf)
        assert not self._waiting and self.allocator.num_referenced() == 0, "replay left blocks in use"
        self.result.evictions = self.cache.num_evictions
        self.result.seconds = time.perf_counter() - start
        return self.result

    def _finish_until(self, until: float) -> None:
        while self._running and self._running[0][0] <= until:
            finish, _, blocks = heapq.heappop(self._running)
            self.now = max(self.now, finish)
            self.cache.release(blocks[::-1])
            self._admit_waiting()

    def _admit_waiting(self) -> None:
        self.result.max_waiting = max(self.result.max_waiting, len(self._waiting))
        while self._waiting and self._try_admit(self._waiting[0]):
            self._waiting.popleft()

    def _try_admit(self, index: int) -> bool:
        request, config, cache, alloc = self.requests[index], self.config, self.cache, self.allocator
        bs = config.block_size
        total = -(-(request.input_length + request.output_length) // bs)
        if total > config.cache_blocks:  # can never fit: served without the cache, all misses
            self.result.dropped += 1
            self._record(request, 0, request.input_length // bs)
            return True
        if self._head is None or self._head[0] != index:
            self._head = (index, expand(request, bs))
        prompt = self._head[1]
        self.oracle.current = index
        usable = (request.input_length - 1) // bs
        matched = cache.match(prompt.tokens[: usable * bs], prompt.hashes[:usable], ())
        need = total - len(matched)
        refs = alloc.ref_counts
        held_evictable = sum(1 for block_id in matched if refs[block_id] == 0)
        if need > alloc.num_free + cache.num_evictable_blocks - held_evictable:
            return False
        self.result.pinned_sum += alloc.num_referenced()
        cache.acquire(matched)
        if need > alloc.num_free:
            self._protect_waiting()
            cache.evict(need - alloc.num_free)
        blocks = matched + alloc.allocate(need)
        self._insert(prompt, blocks, len(matched))
        self._record(request, len(matched), len(prompt.hashes))
        uncached = request.input_length - len(matched) * bs
        duration = uncached / config.prefill_tokens_per_s + request.output_length * config.decode_ms_per_token / 1e3
        duration = duration if config.overlap else 0.0
        heapq.heappush(self._running, (self.now + duration, index, blocks))
        return True

    def _protect_waiting(self) -> None:
        """The queue is known future: touch the cached prefixes of the next waiting requests (as the
        engine's scheduler does each step) so this eviction takes other blocks first."""
        bs = self.config.block_size
        for index in itertools.islice(self._waiting, 1, 1 + self.config.protect_waiting):
            request = self.requests[index]
            if request.input_length // bs == 0:
                continue
            prompt = expand(request, bs)
            usable = (request.input_length - 1) // bs
            self.cache.match(prompt.tokens[: usable * bs], prompt.hashes[:usable], ())

    def _insert(self, prompt: ExpandedPrompt, blocks: list[int], num_matched: int) -> None:
        """Register the full prompt blocks; hold the cached copy of any block cached meanwhile."""
        num_full, bs, cache = len(prompt.hashes), self.config.block_size, self.cache
        tokens = prompt.tokens[: num_full * bs]
        present = cache.insert(tokens, prompt.hashes, blocks[:num_full], ())
        if present <= num_matched:
            return
        cached = cache.match(tokens[: present * bs], prompt.hashes[:present], ())
        for i in range(num_matched, min(present, len(cached))):
            if cached[i] != blocks[i]:
                cache.acquire([cached[i]])
                cache.release([blocks[i]])
                blocks[i] = cached[i]

    def _record(self, request: TraceRequest, num_matched: int, num_full: int) -> None:
        result = self.result
        result.requests += 1
        result.prompt_tokens += request.input_length
        result.hit_tokens += num_matched * self.config.block_size
        result.prompt_blocks += num_full
        result.hit_blocks += num_matched


def replay(requests: Sequence[TraceRequest], config: ReplayConfig) -> ReplayResult:
    return Replay(requests, config).run()
