"""Background requests: work a router hands an idle worker, never ahead of anyone's request.

A router's idle copy (`router/idle_copy.py`) asks an idle worker to compute a prompt another worker has
just answered, so the conversation's next turn (or the document's next question) finds its prefix on
both and can go to whichever is free (its share guard's warm copy likewise, for a less served worker).
That is only worth it if the copy costs the worker's own callers nothing but one short step, so a
background request (`Request.background`, set by the router's
`x-kvserve-background` header):

- is admitted only when no foreground request waits or runs, and only if its whole prompt fits in free
  blocks (it never evicts a cached block: a copy must not cost the cache what it adds);
- computes at most `BACKGROUND_CHUNK_TOKENS` prompt tokens a step, so a request arriving meanwhile waits
  for at most one such step (~0.2 s on one CPU thread for 64 tokens of a 135M model);
- sits out, keeping its blocks, every step in which a foreground request waits or runs, and is the first
  preempted when a foreground request needs blocks or a sequence slot;
- counts neither as contention for the others' chunking nor as a leader others are held for
  (`prefix_admission.py`: a held foreground request would wait on a copy that waits on it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvserve.engine.request import Request

if TYPE_CHECKING:
    from kvserve.engine.block_manager import BlockManager

BACKGROUND_CHUNK_TOKENS = 64
BACKGROUND_DROPPED = "background request dropped: its prompt does not fit in free KV blocks (it never evicts)"
MAX_BACKGROUND_REQUESTS = 4  # queued or running on one server: beyond, 429 (a copy is never worth a backlog)


def num_foreground(requests: Iterable[Request]) -> int:
    return sum(not request.background for request in requests)


def background_last(requests: list[Request]) -> list[Request]:
    """Foreground requests first, each side in its order: the queue's tail and the first victims. The list
    itself when it holds no background request (every step, on the scheduler's path: no copy then)."""
    if not any(r.background for r in requests):
        return requests
    return [r for r in requests if not r.background] + [r for r in requests if r.background]


def waiting_background_last(waiting: deque[Request]) -> deque[Request]:
    return waiting if not any(r.background for r in waiting) else deque(background_last(list(waiting)))


def fits_free(request: Request, matched: list[int], block_manager: BlockManager) -> bool:
    """A foreground request: always. A background one: its whole prompt fits in free blocks (no eviction)."""
    if not request.background:
        return True
    needed = block_manager.blocks_for_tokens(request.num_tokens) - len(matched)
    return needed <= block_manager.allocator.num_free


def background_chunk(request: Request, num_new: int) -> int:
    return min(num_new, BACKGROUND_CHUNK_TOKENS) if request.background else num_new
