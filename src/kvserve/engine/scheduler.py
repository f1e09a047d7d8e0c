"""Scheduler: continuous batching with chunked prefill, preemption by recompute, fcfs | lpm order.

Every step, running requests go first (one decode token each, or their next prefill chunk: at most
`long_prefill_token_threshold` tokens while others wait or run; at most `max_step_rows` of them, in
turn, `step_rows.RowRotation`; at most `max_group_rows` of one group while other groups run or wait,
`step_rows.group_sit_outs`), then waiting ones are admitted while the token budget, `max_num_seqs`,
the pool and the admission cap (`limits.joins_step`) allow. When a running request cannot get a block, the
running sequence of the group holding the largest share of the pool (blocks x steps held,
`pool_share.PoolShare`; never the oldest sequence, so something always finishes) is preempted: its
blocks are released (full ones stay in the prefix cache) and it goes back to the front of the queue,
to be recomputed. Admission is FCFS, except that members of a group that already runs wait behind
requests whose group does not (`unserved_groups_first`).

A running request with nothing to compute is waiting for the rest of its group (a beam whose
siblings have not computed their logits yet); it is skipped. If nothing at all could run, such
requests are preempted (queued behind the head) until the head of the queue fits, so a group never
deadlocks. Forks join through `add_fork` and leave through `finish`: no other module edits `running`
or `waiting`. `schedule()` ends by asserting what must hold after every step.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.engine.background import (
    background_chunk,
    background_last,
    fits_free,
    num_foreground,
    waiting_background_last,
)
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.busy_chunk import BusyChunking
from kvserve.engine.cache_counters import PrefixCacheCounters, split_by_source
from kvserve.engine.limits import joins_step
from kvserve.engine.pool_share import PoolShare
from kvserve.engine.prefix_admission import PrefixHold
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.step_rows import RowRotation, group_sit_outs
from kvserve.engine.waiting_order import (
    longest_prefix_first,
    oldest_group_first,
    order_by_priority,
    priority_of,
    unserved_groups_first,
)

if TYPE_CHECKING:
    from kvserve.engine.kv_tiers import EngineTiers
    from kvserve.engine.speculative import Speculator
    from kvserve.engine.step_trace import StepTrace

PROTECT_WAITING = 4  # head-of-queue requests whose cached prefixes are refreshed before running ones grow
IDLE_LOAD_WAIT_S = 0.01  # a step that scheduled nothing while loads are in flight waits this long for one


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    draft: list[int] = field(default_factory=list)  # speculated tokens after its last one (in num_new_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the forward

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
        policy: str = "fcfs", long_prefill_token_threshold: int = 0, max_step_rows: int = 0,
        max_group_rows: int = 0, long_prefill_always: bool = False, max_admitted_prefill_tokens: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.long_prefill_token_threshold = long_prefill_token_threshold  # 0: a chunk takes the budget
        self.long_prefill_always = long_prefill_always  # the threshold applies alone too (`_chunk`)
        self.max_admitted_prefill_tokens = max_admitted_prefill_tokens  # 0: admit while the budget lasts
        self.rotation = RowRotation(max_step_rows)  # 0: every running sequence computes every step
        self.max_group_rows = max_group_rows  # 0: a group's sequences all compute every step
        self.num_steps = 0
        self._contended = False  # others wait or run beside a request this step (long prefills yield)
        self._foreground = False  # a foreground request waits or runs this step (`engine/background.py`)
        self.dropped: list[Request] = []  # background requests that cannot fit without evicting: the engine fails them
        self._yielded_last_step = False  # running prefills sat out the last step for a newcomer
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pool_share = PoolShare()  # orders `running` each step (kept counts: cheap when little changed)
        self.num_preemptions = 0
        self.counters = PrefixCacheCounters()
        self.tiers: EngineTiers | None = None  # set by the engine when a lower tier is configured
        self.prefix_hold: PrefixHold | None = None  # set by the engine: in-batch prefix sharing at admission
        self.trace: StepTrace | None = None  # set by the server under KVSERVE_STEP_TRACE
        self.speculator: Speculator | None = None  # set by the engine under speculative_config
        self.busy = BusyChunking()  # off unless the engine sets it: long prompts in short steps while busy lately

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def take_dropped(self) -> list[Request]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or (self.tiers is not None and self.tiers.loading))

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        output = SchedulerOutput()
        if self.tiers is not None:
            self._requeue_loaded()
        self.running = background_last(self.pool_share.order(self.running, self.num_steps))  # last: first victims
        if self.policy == "priority":
            output.preempted += order_by_priority(self)
        foreground = num_foreground(self.waiting) + num_foreground(self.running)
        self._contended = foreground > 1
        self.busy.note(self._contended)
        self._foreground = foreground > 0  # background requests sit out
        self._protect_waiting()
        budget = self._schedule_running(output, self.max_num_batched_tokens)
        num_running_before = len(output.scheduled)
        if not output.preempted:
            self._schedule_waiting(output, budget)
        self._yield_to_newcomers(output, num_running_before)
        if not output.scheduled and self.waiting and self.running:
            self._unblock_waiting(output)
        self.rotation.record((item.request for item in output.scheduled), self.running, self.num_steps)
        output.blocks_to_copy = self.block_manager.take_pending_copies()
        self._assert_end_of_step(output)
        if self.tiers is not None and not output.scheduled:
            self.tiers.wait_any(IDLE_LOAD_WAIT_S)  # only loads can unblock the queue: wait for one, do not spin
        if self.trace is not None:
            self.trace.step(output.scheduled, len(self.waiting))
        return output

    def _assert_end_of_step(self, output: SchedulerOutput) -> None:
        """What must hold after every schedule (vLLM states the same facts)."""
        assert self.max_num_batched_tokens - output.num_tokens >= 0, "token budget below 0"
        assert len(self.running) <= self.max_num_seqs, f"{len(self.running)} running > {self.max_num_seqs}"
        block_size = self.block_manager.block_size
        for item in output.scheduled:
            request = item.request
            assert request.status is RequestStatus.RUNNING, f"{request.request_id} scheduled while not running"
            assert len(request.block_table) * block_size >= request.num_computed_tokens + item.num_new_tokens, (
                f"{request.request_id}: blocks do not cover its tokens")

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        turn = self.rotation.select(self.running)  # None: all; else the request ids whose turn it is
        capped = group_sit_outs(self.running, self.max_group_rows) if self._other_groups() else set()
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if ((turn is not None and request.request_id not in turn) or request.request_id in capped
                    or (request.background and self._foreground)):
                index += 1  # sits out (keeps its blocks): row cap, group cap, background
                continue
            self._adopt_cached_continuation(request)
            num_new = background_chunk(request, self._chunk(request.num_tokens - request.num_computed_tokens, budget,
                                                            request.num_prompt_tokens - request.num_cached_tokens))
            if request.background and not self.block_manager.can_grow_from_free(request, num_new):
                self.preempt(self.running.pop(index), front=False)  # never evicts: re-admitted if it fits, else dropped
                continue
            if num_new == 0:  # holding its logits until the rest of its group has theirs
                index += 1
                continue
            draft = self.speculator.draft(request, budget, len(self.running)) if self.speculator else []
            if draft and self.block_manager.can_grow_from_free(request, num_new + len(draft)):  # never preempt
                self.block_manager.grow(request, num_new + len(draft))
                output.scheduled.append(ScheduledRequest(request, num_new + len(draft), draft))
                budget -= num_new + len(draft)
                index += 1
                continue
            while not self.block_manager.can_grow(request, num_new):
                victim = self.running.pop()
                self.preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            else:
                self.block_manager.grow(request, num_new)
                output.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                index += 1
                continue
            break  # the request itself was preempted: everything after it is gone too
        return budget

    def _other_groups(self) -> bool:
        """More than one group runs, or someone waits: the group cap applies (`step_rows.group_sit_outs`)."""
        if not self.max_group_rows:
            return False
        return bool(self.waiting) or any(r.group_id != self.running[0].group_id for r in self.running)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        """Admit from the queue while the budget, `max_num_seqs`, the pool and `limits.joins_step` allow."""
        if self.policy == "lpm":
            self.waiting = longest_prefix_first(self.waiting, self.block_manager)
        self.waiting = unserved_groups_first(self.waiting, self.running)
        self.waiting = oldest_group_first(self.waiting, self.running)
        if self.policy == "priority":  # the group rules above reorder within a priority, never across
            self.waiting = deque(sorted(self.waiting, key=priority_of))
        self.waiting = waiting_background_last(self.waiting)
        self._free_slot_for_foreground(output)
        hold, held = self.prefix_hold, []  # held: waiting for a running request's prefix blocks
        if hold is not None:
            hold.begin_step(self.num_steps, [r for r in self.running if not r.background], self.waiting)
        cap, admitted = (self.max_admitted_prefill_tokens if self._contended else 0), 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.background and self._foreground:
                break  # behind every foreground request (`waiting_background_last`)
            matched = self.block_manager.match_prefix(request)
            if hold is not None and hold.should_hold(request, len(matched)):
                held.append(self.waiting.popleft())
                continue
            if self.tiers is not None:
                matched = self.tiers.extend_match(request, matched)
                if matched is None:  # WAITING_FOR_KV: the queue goes on without it
                    self.waiting.popleft()
                    continue
            num_computed = len(matched) * self.block_manager.block_size
            if not fits_free(request, matched, self.block_manager):  # background, nobody running to free blocks
                self.dropped.append(self.waiting.popleft())
                continue
            remaining = request.num_tokens - num_computed
            num_new = background_chunk(request, self._chunk(remaining, budget, remaining))
            if not joins_step(cap, admitted, num_new):
                break  # the next step's: prompts that queued together are answered one after another
            if not self.block_manager.can_admit(request, matched, num_new):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            self._record_match(request, num_computed)
            self.block_manager.admit(request, matched)
            self.block_manager.grow(request, num_new)
            request.status = RequestStatus.RUNNING
            request.held_since_step = self.num_steps
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()
            self.running.append(request)
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget, admitted = budget - num_new, admitted + num_new
            if hold is not None and not request.background:
                hold.add_leader(request)
        self.waiting.extendleft(reversed(held))

    def _free_slot_for_foreground(self, output: SchedulerOutput) -> None:
        """A foreground request at the head of a full batch takes a background request's sequence slot."""
        while (len(self.running) >= self.max_num_seqs and self.waiting and not self.waiting[0].background
               and self.running and self.running[-1].background):
            victim = self.running.pop()
            self.preempt(victim, front=False)
            output.preempted.append(victim)

    def _protect_waiting(self) -> None:
        """The queue is known future: matching its next requests refreshes their cached prefixes (a
        match counts as a use for the eviction policy), so the growth of running requests evicts other
        blocks first (with the cache off, a match is empty and costs nothing)."""
        for request in itertools.islice(self.waiting, PROTECT_WAITING):
            self.block_manager.match_prefix(request)

    def _yield_to_newcomers(self, output: SchedulerOutput, num_running_before: int) -> None:
        """In a step that admits a request for the first time, running prefill chunks sit out (they keep
        their blocks), so the newcomer's first step costs what it would alone: its TTFT is its solo TTFT
        plus the step in flight when it arrived. Never two steps in a row, so a long prefill gets a chunk
        at least every other step however many newcomers arrive. Decode rows stay: letting them sit out
        too was tried and measured (benchmarks/results/soak.md): on a CPU a step's fixed cost dominates at
        a few rows, so the extra steps and the larger step after each yield made the tail no better; the
        row cap (`step_rows.RowRotation`) bounds how many there are instead. A decode with drafts is one."""
        fresh = any(item.request.metrics.first_token_time is None for item in output.scheduled[num_running_before:])
        yielding = [i for i in output.scheduled[:num_running_before] if i.num_new_tokens > 1 and not i.draft]
        if not fresh or not yielding or self._yielded_last_step:
            self._yielded_last_step = False
            return
        output.scheduled = [item for item in output.scheduled if item not in yielding]
        self._yielded_last_step = True

    def _chunk(self, num_remaining: int, budget: int, uncached: int) -> int:
        """Tokens to compute for a request this step: what remains, within the budget; while other
        requests wait or run beside it, a prefill chunk of at most `long_prefill_token_threshold` (vLLM's
        knob), so a long prompt never takes a whole step from the others: a newcomer's first step costs
        little more than it would alone. Alone, a request takes the whole budget, unless
        `long_prefill_always` (vLLM's rule): a request arriving during a step waits for it, and on a CPU a
        step of 1,072 prompt tokens takes ~3 s on one thread. Measured over 2 one-thread servers
        (BENCHMARKS.md, router_zen4_chunked): round_robin's RAG p90 halved, but cache-aware chat's p90 grew
        15-45% (cold turns interleaved with warm ones) and a lone 2,048-token prompt took up to 11% longer:
        opt-in. While the server is busy lately, `busy` (`engine/busy_chunk.py`) cuts a long prompt's chunk
        further, alone or not: what one arriving during its step waits for."""
        num_new = min(num_remaining, budget)
        threshold = self.long_prefill_token_threshold
        if (self._contended or self.long_prefill_always) and 0 < threshold < num_new:
            num_new = threshold
        return self.busy.chunk(uncached, num_new)

    def _adopt_cached_continuation(self, request: Request) -> None:
        adopted = self.block_manager.adopt_cached_continuation(request)
        if adopted:
            request.num_cached_tokens += adopted
            by_source = request.cached_tokens_by_source
            by_source["device"] = by_source.get("device", 0) + adopted
            if request.num_preemptions:
                self.counters.preempted_hits += adopted
            else:
                self.counters.hits += adopted
                self.counters.hits_by_source["device"] += adopted

    def _record_match(self, request: Request, num_matched_tokens: int) -> None:
        if not request.was_admitted:
            request.num_cached_tokens = num_matched_tokens
            request.cached_tokens_by_source = split_by_source(
                request.kv_sources, num_matched_tokens, self.block_manager.block_size)
        self.counters.record(request, num_matched_tokens)
        request.kv_sources, request.kv_load_tried = {}, False
        request.probe_remote = True  # a router's hint is about its first admission: later ones ask the store

    def _requeue_loaded(self) -> None:
        """Requests whose tier load landed (or failed) go back to the head of the queue, in order."""
        for request in reversed(self.tiers.poll()):
            self.waiting.appendleft(request)

    def _unblock_waiting(self, output: SchedulerOutput) -> None:
        """Nothing ran: every running request holds its logits for its group while the queue's head (say
        a preempted sibling) does not fit. Preempt from the newest until the head is admitted. The victims
        keep their logits and go to the back: they need no compute before their group's next step."""
        while self.running and not output.scheduled:
            victim = self.running.pop()
            self.preempt(victim, front=False)
            output.preempted.append(victim)
            self._schedule_waiting(output, self.max_num_batched_tokens)

    def preempt(self, request: Request, front: bool = True) -> None:
        self.block_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def add_fork(self, parent: Request, child: Request) -> None:
        """Queue a fork of `parent`: running beside it, sharing its blocks, while `max_num_seqs` allows;
        otherwise waiting right behind it (or at the front of the queue), holding no blocks, to be
        computed on admission like a preempted request."""
        if parent.status is RequestStatus.RUNNING and len(self.running) < self.max_num_seqs:
            self.block_manager.fork(parent, child)
            child.status = RequestStatus.RUNNING
            child.held_since_step = self.num_steps
            self.running.append(child)
            return
        child.status = RequestStatus.WAITING
        index = self.waiting.index(parent) + 1 if parent.status is RequestStatus.WAITING else 0
        self.waiting.insert(index, child)

    def sequences_of(self, group_id: str) -> list[Request]:
        """Every queued or running sequence of one group (read only: the engine aborts a failed group)."""
        return [r for r in (*self.running, *self.waiting) if r.group_id == group_id]

    def check_invariants(self) -> None:
        """Pool, cache and block-table checks (the engine runs them after every step under
        KVSERVE_DEBUG_CHECKS=1); AssertionError on a mismatch."""
        for request in self.waiting:
            assert not request.block_table, f"waiting {request.request_id} holds blocks"
            assert request.status is RequestStatus.WAITING, request.request_id
        for request in self.running:
            assert request.status is RequestStatus.RUNNING, request.request_id
        assert len(self.running) <= self.max_num_seqs, f"{len(self.running)} running > {self.max_num_seqs}"
        loading = self.tiers.holders() if self.tiers is not None else []
        for request in loading:
            assert request.status is RequestStatus.WAITING_FOR_KV, request.request_id
        self.block_manager.check_invariants(self.running + loading)
        self.pool_share.check(self.running)

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request and release its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif self.tiers is not None:
            self.tiers.abort(request)  # loading: drop its job (its blocks are freed below)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED

