"""The order the scheduler admits waiting requests in, besides fcfs / lpm: groups' members, and priority.

`--schedule-policy priority` (vLLM's `--scheduling-policy priority`): each request carries an integer
`priority`, lower first (vLLM's convention); among equal priorities the order stays what it was (arrival,
preempted requests first). Running sequences are ordered the same way, stably over the pool-share order
(engine/pool_share.py), so the lowest-priority sequences are the ones preempted first; and when the queue's
head outranks the lowest-priority running sequence but cannot be admitted (no room in the pool, or
`max_num_seqs` reached), that sequence is preempted for it. Lower priorities can wait indefinitely while
higher ones keep coming: that is the policy. The group rules below reorder the queue within a priority,
never across (the scheduler sorts it again after them).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from kvserve.engine.block_manager import BlockManager
from kvserve.engine.request import Request


class Queues(Protocol):
    """What `order_by_priority` needs of the scheduler."""

    running: list[Request]
    waiting: deque[Request]
    block_manager: BlockManager
    max_num_seqs: int
    max_num_batched_tokens: int

    def preempt(self, request: Request, front: bool = True) -> None: ...


def unserved_groups_first(waiting: deque[Request], running: list[Request]) -> deque[Request]:
    """The queue with requests whose group has no running sequence first (FCFS among them), then the
    members of groups already running: one group of n samples cannot keep newcomers out by
    re-admitting its own preempted members ahead of them."""
    served = {request.group_id for request in running}
    if not any(request.group_id in served for request in waiting):
        return waiting
    return deque([r for r in waiting if r.group_id not in served] + [r for r in waiting if r.group_id in served])


def oldest_group_first(waiting: deque[Request], running: list[Request]) -> deque[Request]:
    """The queue with the waiting members of the oldest running sequence's group first, when that
    sequence waits for them (a beam holding its logits): the oldest sequence is the one that must always
    finish (`pool_share`), and a beam cannot finish without its siblings. Without this, groups in a small
    pool each keep one beam computed while its sibling waits behind newcomers, forever
    (tests/test_scheduler_livelock.py)."""
    if not running or running[0].num_tokens > running[0].num_computed_tokens:
        return waiting
    keeper = running[0].group_id
    if not any(request.group_id == keeper for request in waiting):
        return waiting
    return deque([r for r in waiting if r.group_id == keeper] + [r for r in waiting if r.group_id != keeper])


LPM_MAX_WAITING = 128  # beyond this many waiting requests, lpm's per-step matching costs too much


def longest_prefix_first(waiting: deque[Request], block_manager: BlockManager) -> deque[Request]:
    """SGLang's lpm: admit the longest cached prefix first; FCFS when the queue is long. Preempted
    requests keep their place at the front: they already waited their turn."""
    if len(waiting) > LPM_MAX_WAITING:
        return waiting
    resumed = [r for r in waiting if r.was_admitted]
    fresh = [r for r in waiting if not r.was_admitted]
    fresh.sort(key=lambda r: len(block_manager.match_prefix(r)), reverse=True)  # stable sort
    return deque(resumed + fresh)


def priority_of(request: Request) -> int:
    return request.priority


def order_by_priority(scheduler: Queues) -> list[Request]:
    """Running sequences by priority (stable), then room for the highest-priority waiting request (the first
    of them): the lowest-priority running sequences below it are preempted while it cannot be admitted
    (returned, to report). The queue itself is sorted where admission reads it (`Scheduler._schedule_waiting`);
    the request is admitted at the next step (a step that preempts admits nobody)."""
    scheduler.running.sort(key=priority_of)
    victims: list[Request] = []
    if not scheduler.waiting:
        return victims
    head, manager = min(scheduler.waiting, key=priority_of), scheduler.block_manager
    while scheduler.running and scheduler.running[-1].priority > head.priority:
        matched = manager.match_prefix(head)
        first_chunk = min(head.num_tokens - len(matched) * manager.block_size, scheduler.max_num_batched_tokens)
        if len(scheduler.running) < scheduler.max_num_seqs and manager.can_admit(head, matched, first_chunk):
            break
        victims.append(scheduler.running.pop())
        scheduler.preempt(victims[-1], front=False)
    return victims
