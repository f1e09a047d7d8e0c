"""Forking a sequence with shared KV blocks, and copy-on-write of the shared tail block.

A fork (a parallel sample, a beam) takes one more reference to each of its parent's blocks instead of
copying them. Full blocks are never written again, so they stay shared for good. The partly filled
tail block is the only one that will be written: the first sequence that writes it while it is still
shared gets a private copy (a fresh block, queued as a (src, dst) copy the engine runs on the pool
before the forward) and drops its reference to the shared one; the last holder writes in place. So n
forks of a prompt hold its blocks once plus at most n - 1 copied tail blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.engine.request import Request, RequestMetrics, RequestStatus
from kvserve.kv.pool import KVPool

if TYPE_CHECKING:
    from kvserve.engine.block_manager import BlockManager
    from kvserve.engine.scheduler import Scheduler


def fork_request(parent: Request, child_id: str, block_manager: BlockManager) -> Request:
    """A copy of `parent` (tokens, progress, published blocks) holding references to its blocks."""
    child = Request(
        child_id, parent.prompt_token_ids, parent.params, namespace=parent.namespace, prompt=parent.prompt,
        eos_token_ids=parent.eos_token_ids, status=parent.status, group=parent.group,
        metrics=RequestMetrics(parent.metrics.arrival_time, parent.metrics.first_scheduled_time),
    )
    child.output_token_ids = list(parent.output_token_ids)
    child.all_token_ids = list(parent.all_token_ids)
    child.block_table = list(parent.block_table)
    child.block_hashes = list(parent.block_hashes)  # hashes of full blocks: common history, valid for both
    child.num_computed_tokens = parent.num_computed_tokens
    child.num_published_blocks = parent.num_published_blocks  # so the cache sees shared blocks once
    child.num_cached_tokens = parent.num_cached_tokens
    child.num_preemptions = parent.num_preemptions  # a resumed parent's child re-matches as "preempted"
    child.cumulative_logprob = parent.cumulative_logprob
    child.logprobs = None if parent.logprobs is None else list(parent.logprobs)
    block_manager.prefix_cache.acquire(child.block_table)
    if child.block_table:
        parent.may_share_tail = child.may_share_tail = True
    return child


def enqueue_fork(scheduler: Scheduler, parent: Request, child: Request) -> None:
    """Put a fork where its parent is: running (it holds blocks), or queued right behind the parent."""
    if parent.status is RequestStatus.RUNNING:
        scheduler.running.append(child)
    else:
        scheduler.waiting.insert(scheduler.waiting.index(parent) + 1, child)


def tail_is_shared(manager: BlockManager, request: Request) -> bool:
    """Whether the block the request writes next exists and is shared (so it must be copied first)."""
    index = request.num_computed_tokens // manager.block_size
    table = request.block_table
    return index < len(table) and manager.allocator.ref_counts[table[index]] > 1


def copy_tail_on_write(manager: BlockManager, request: Request) -> None:
    """Give the request a private copy of its shared tail block (needs one available block)."""
    request.may_share_tail = False  # after this the tail is private until the next fork
    if not tail_is_shared(manager, request):
        return
    if manager.allocator.num_free == 0:
        manager.prefix_cache.evict(1)
    index = request.num_computed_tokens // manager.block_size
    shared = request.block_table[index]
    private = manager.allocator.allocate(1)[0]
    manager.pending_copies.append((shared, private))
    manager.prefix_cache.release([shared])  # still held by the other sharers: only the count drops
    request.block_table[index] = private
    manager.peak_used_blocks = max(manager.peak_used_blocks, manager.allocator.num_referenced())


def copy_blocks(kv_pool: KVPool, copies: list[tuple[int, int]]) -> None:
    """Copy whole blocks (every layer, keys and values) src -> dst; all sources are read first."""
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=kv_pool.tensor.device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=kv_pool.tensor.device)
    kv_pool.tensor[:, :, dst] = kv_pool.tensor[:, :, src]
