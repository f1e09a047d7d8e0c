"""The policy interface and the load comparison every policy falls back to."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.router.config import SHARE_COPY_MIN, SHARE_MIN_SEEN, SHARE_WINDOW
from kvserve.router.keys import RouteKey
from kvserve.router.workers import Worker


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes; `reason` labels the decision metric; `matched_tokens` what the policy
    believes is cached there for this prompt."""

    worker: Worker
    reason: str
    matched_tokens: int = 0
    store_probe: bool | None = None  # over a shared store: should the worker ask it (None: no opinion)
    copy_to: Worker | None = None  # the share guard's warm copy: send a duplicate there too, answered to nobody

    def uncached(self, key: RouteKey) -> int:
        """The prompt tokens the worker must compute (its pending prefill while the request waits)."""
        return max(len(key.tokens) - self.matched_tokens, 0) if key.tokens is not None else 0


class Policy:
    """Pick one of `workers` (non-empty, all healthy). Index hooks default to doing nothing."""

    name = "policy"

    def choose(self, key: RouteKey, workers: list[Worker]) -> Decision:
        raise NotImplementedError

    def on_routed(self, key: RouteKey, worker: Worker) -> None:
        """The request keyed `key` was sent to `worker` (the proxy calls this once it commits)."""

    def on_prefilled(self, key: RouteKey, worker: Worker) -> None:
        """`worker` answered the request keyed `key` (its first token or its whole answer): the prompt's
        blocks are computed there, and written through to its store if it shares one."""

    def on_copied(self, key: RouteKey, worker: Worker) -> None:
        """A duplicate of the request keyed `key` went to `worker` to compute its prompt there (a warm copy,
        `Decision.copy_to`): index it as sent there, without counting it as a request routed."""

    def held_by(self, key: RouteKey, workers: list[Worker]) -> dict[Worker, int] | None:
        """The prompt tokens each worker holds or was sent, as the policy knows it; None: it does not know
        (no index, or an unkeyed request). Idle copies (`router/idle_copy.py`) go where this is short."""
        return None

    def on_join(self, worker: Worker) -> None:
        """`worker` (re)joined the pool: whatever was indexed for it is stale."""

    def on_leave(self, worker: Worker) -> None:
        """`worker` left the pool."""

    def index_sizes(self) -> list[tuple[str, str, int]]:
        """(worker URL, medium, blocks) the policy's exact index holds, for `/metrics` (none by default)."""
        return []

    async def start(self) -> None:
        """Start background work (event subscriptions)."""

    async def stop(self) -> None:
        """Stop background work."""


class LoadTieBreaker:
    """The least loaded worker; ties rotate, so equal workers share the traffic evenly."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def least_loaded(self, workers: list[Worker], prefer: Callable[[Worker], tuple] | None = None) -> Worker:
        """`prefer` (lowest first) narrows the tie before it rotates: the imbalance guard's least loaded
        workers are often several idle ones, and a prompt cached nowhere should go to the emptiest, not
        to whichever the rotation reaches (4 workers: a new document went to an idle worker already
        holding another while a fourth stayed empty all run)."""
        best = min(_load_key(worker) for worker in workers)
        tied = [worker for worker in workers if _load_key(worker) == best]
        if prefer is not None:
            first = min(prefer(worker) for worker in tied)
            tied = [worker for worker in tied if prefer(worker) == first]
        return tied[next(self._turn) % len(tied)]


def _load_key(worker: Worker) -> tuple[int, float]:
    return worker.load_score, round(worker.load.kv_usage, 2)


def is_imbalanced(workers: list[Worker], abs_threshold: int, rel_threshold: float) -> bool:
    """SGLang's test: max − min load above `abs_threshold` and max above `rel_threshold` × min."""
    loads = [worker.load_score for worker in workers]
    high, low = max(loads), min(loads)
    return high - low > abs_threshold and high > rel_threshold * low


HOT_WINDOW = 64  # recent requests the popularity of a prefix is measured over
HOT_MARGIN = 2.0  # a prefix is hot when its traffic per holder is this many times the others' per worker


class HotPrefixes:
    """Whether the imbalance guard's copy pays. Sending a request to the least loaded worker copies the
    part of the prompt only busier workers hold, at the price of its prefill there. That pays when the
    prefix brings its holders more traffic than the other workers get (the shared system prompt every chat
    user sends, one hot document): the copy then serves a share of all later requests. A prefix taking
    no more than its holders' fair share (one of 4 equally asked documents on each of 4 workers) only
    looks hot while its requests happen to bunch up: the copy buys one request's wait and costs a prefill
    (about 3 points of hit rate each in the RAG benchmark).

    The prefix judged is the prompt up to the first token the least loaded worker lacks; its share is the
    fraction of the last `HOT_WINDOW` routed requests (same namespace) that start with it; it is hot when
    share / holders > `HOT_MARGIN` × (1 − share) / (workers − holders)."""

    def __init__(self, window: int = HOT_WINDOW, margin: float = HOT_MARGIN) -> None:
        self.recent: deque[tuple[tuple[str, ...] | None, tuple[int, ...]]] = deque(maxlen=window)
        self.margin = margin

    def add(self, key: RouteKey) -> None:
        if key.usable:
            assert key.tokens is not None
            self.recent.append((key.namespace, key.tokens))

    def share(self, key: RouteKey, length: int) -> float:
        """The fraction of recent requests that begin with the prompt's first `length` tokens."""
        assert key.tokens is not None
        if not self.recent:
            return 1.0
        prefix = key.tokens[:length]
        same = sum(1 for namespace, tokens in self.recent if namespace == key.namespace and tokens[:length] == prefix)
        return same / len(self.recent)

    def worth_copying(self, key: RouteKey, matches: dict[Worker, int], target: int) -> bool:
        """`matches`: tokens of the prompt each worker holds; `target`: what the least loaded worker holds.
        True when nothing needs copying, when every worker already holds more, or when the prefix is hot."""
        holders = sum(1 for held in matches.values() if held > target)
        if holders == 0 or holders == len(matches) or not key.usable:
            return True
        share = self.share(key, target + 1)
        return share / holders > self.margin * (1.0 - share) / (len(matches) - holders)


class ShareGuard:
    """Affinity's balance check over a window rather than a moment. Cache affinity pins each prefix to
    the workers that hold it, so the requests split as the prefixes' popularity does: 4 documents
    asked 32 / 27 / 20 / 17 times over 2 workers split 59 / 37 if the two most asked landed together,
    and the instantaneous guard (`is_imbalanced`, 2 requests apart) never fires at 4 requests in
    flight. So: when the worker a policy chose has served more than `max_share` of this router's last
    `window` requests and another worker has fewer requests (or both none) and no more prefill in flight
    now (not one still computing an earlier copy), the request goes to the least served of those instead (reason
    `share`). Its prefix is computed there once (a copy); from then on both hold it and the estimate
    splits its requests by load. A copy costs: under first-come-first-served, every request queued on
    that worker waits for it (2-3 copies per RAG run here, each one read-long wait or more in the tail).

    Only the busiest worker of 2 can pass a share above 1/2, so the default (0.58) acts on 2 workers
    and, over more, only on one worker taking well over its fair share. It acts from the `min_seen`-th
    request on, over the requests seen so far until the window fills: waiting for a full window let one
    worker take every conversation of a paced chat (a shared system prompt held there alone made it the
    cheapest for each new user; 85-88 of 96 requests at 1 a second, benchmarks/results/router_paced_zen4.md).

    With `warm_copy` (`apply`) nobody waits for that copy: when the lighter worker lacks part of the prompt
    the chosen one holds, the request stays where it was going and a duplicate of it (one token, answered
    to nobody, a background request: `Router._warm_copy`) computes the prompt on the lighter worker in time
    its own traffic leaves; once that is done, the estimate splits the prefix's requests by load. Moving
    the request made it wait for the copy: in the RAG benchmark over 2 workers those one or two copies per
    run were the requests slower than 1 s after the start-up (benchmarks/results/router_rag_chunked96.md).
    An ordinary request before stop 55, the copy shared its worker's steps with a document's first read
    routed there meanwhile, and both took twice as long (benchmarks/results/router_busy_chunk_zen4.md)."""

    def __init__(self, max_share: float, window: int = SHARE_WINDOW, warm_copy: bool = False,
                 min_seen: int = SHARE_MIN_SEEN, copy_min: float = SHARE_COPY_MIN) -> None:
        self.max_share = max_share
        self.warm_copy = warm_copy
        self.copy_min = copy_min
        self.recent: deque[tuple[Worker, float]] = deque(maxlen=window)  # (routed to, when)
        self.min_seen = min(min_seen, window)

    def add(self, worker: Worker, now: float | None = None) -> None:
        self.recent.append((worker, time.monotonic() if now is None else now))

    def share(self, worker: Worker) -> float:
        return sum(1 for seen, _ in self.recent if seen is worker) / max(len(self.recent), 1)

    def shed(self, chosen: Worker, workers: list[Worker]) -> Worker | None:
        """The worker to send to instead of `chosen`, or None to keep it. The counts compared are exact:
        this router's own requests in flight and prefill not yet answered (plus polled traffic from
        elsewhere), not a poll that still shows requests finished since. With `chosen` idle, the others
        idle too are candidates (`apply` then lets only what delays nobody through)."""
        if len(self.recent) < self.min_seen or self.share(chosen) <= self.max_share:
            return None
        lighter = [worker for worker in workers if worker is not chosen
                   and worker.load_score < max(chosen.load_score, 1)
                   and worker.pending_prefill <= chosen.pending_prefill]  # not onto a copy still running
        if not lighter:
            return None
        return min(lighter, key=lambda worker: (self.share(worker), worker.load_score))

    def apply(self, decision: Decision, workers: list[Worker], matches: dict[Worker, int],
              prompt_len: int, popularity: Callable[[int], float] | None = None) -> Decision:
        """The guard over a policy's decision (`matches`: the prompt tokens each worker holds): unchanged;
        moved to a lighter worker (reason `share`) when that one holds as much of the prompt, or, without
        `warm_copy`, when the chosen one is busy; else kept, with the lighter worker as its warm copy's
        target (`copy_to`) -- onto an idle worker only a copy that `fits_gap` (from when copies were
        ordinary requests: a 1,760-token conversation copied onto an idle worker just before a burst made
        the requests there wait 5-7 s, benchmarks/results/router_paced_zen4.md; a background copy delays
        them one 64-token step, and idle copies give an idle worker the rest).

        And only a copy of a prefix that later requests will use: `popularity(n)` is the fraction of recent
        requests that begin with the prompt's first n tokens, and the copy carries what the chosen worker
        holds; below `copy_min` it is not made. A shared system prompt or a document is (every request, a
        quarter of them); one user's conversation is not (one request in a window of 64), and its copy, a
        1,000-1,500-token prefill for the few turns left, held every request queued behind it on the
        lighter worker, which the estimate then saw as busy and moved other turns off, recomputing their
        histories (chat at 1 request a second: the four slowest requests, 4.9-6.0 s)."""
        lighter = self.shed(decision.worker, workers)
        if lighter is None:
            return decision
        moved = Decision(lighter, "share", matches[lighter])
        if matches[lighter] >= matches[decision.worker]:
            return moved
        if not self.warm_copy:  # chosen idle: moving would only make the request wait for a prefill
            return moved if decision.worker.load_score else decision
        if popularity is not None and popularity(matches[decision.worker]) < self.copy_min:
            return decision
        lacks = prompt_len - matches[lighter]
        if lighter.load_score == 0 and not self.fits_gap(lighter, decision.worker, lacks, len(workers)):
            return decision
        return dataclasses.replace(decision, copy_to=lighter)

    def fits_gap(self, target: Worker, chosen: Worker, tokens: int, num_workers: int) -> bool:
        """Whether `tokens` of prefill on `target` (at its prefill speed as seen here, else `chosen`'s) is
        likely done before its next request: within `num_workers` times the mean gap between the
        router's recent requests. No speed known yet: no."""
        speed = target.seconds_per_token or chosen.seconds_per_token
        if speed is None or len(self.recent) < 2:
            return False
        gap = (self.recent[-1][1] - self.recent[0][1]) / (len(self.recent) - 1)
        return tokens * speed <= gap * num_workers
