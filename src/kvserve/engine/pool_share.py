"""The order of running sequences by their group's share of the pool: who yields the step, who is preempted.

Each step the scheduler orders its running sequences by weight: a group (a plain request, or all the
samples / beams of one) weighs the distinct blocks its running members hold times the steps since the
first of them got blocks. The order sets who takes the step's token budget first and who is
preempted (from the end). `order_by_pool_share` defines it from scratch; it hashes every block id of
every running sequence, about 1 ms a step at 64 requests x 128 blocks, although most steps change
few tables (a decode crosses a block boundary once every `block_size` tokens).

`PoolShare` gives the same order, keeping each group's distinct-block count between steps and
counting again only for a group whose running members changed, or one of whose members' block table
changed since: the block manager gives a table a fresh `table_version` (unique across requests) on
every edit, so comparing versions is enough. Under KVSERVE_DEBUG_CHECKS the scheduler's
`check_invariants` recounts every kept group (`PoolShare.check`), so an edit that skipped the version
would fail the suite; the test checks the two orders are equal on random sequences of steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.engine.request import Request


def order_by_pool_share(running: list[Request], step: int) -> list[Request]:
    """Running sequences, the most preemptible last (the scheduler preempts from the end).

    A group weighs the blocks it holds (each counted once, however many members share it) times the
    steps since it first got them; the heaviest group goes last, its newest member last of all. So a
    request that has held a large part of the pool for long yields to newcomers, instead of the newest
    arrival always paying. One exception keeps the system live: the oldest sequence (by arrival; a
    group's root before its forks) goes first, so it is never preempted while anything else runs and
    always finishes (a lone sequence fits the pool; a beam that waits for its siblings keeps its whole
group first, as they must all compute before it can go on) -- without it, whoever held longest would be
    preempted over and over and nothing might finish. (The definition; `PoolShare.order` is the same
    order, computed incrementally.)
    """
    blocks: dict[str, set[int]] = {}
    since: dict[str, int] = {}
    for request in running:
        blocks.setdefault(request.group_id, set()).update(request.block_table)
        since[request.group_id] = min(since.get(request.group_id, step), request.held_since_step)
    weight = {group_id: len(held) * (step - since[group_id] + 1) for group_id, held in blocks.items()}
    return _ordered(running, weight)


def _ordered(running: list[Request], weight: dict[str, int]) -> list[Request]:
    ordered = sorted(running, key=lambda r: (weight[r.group_id], r.held_since_step))
    if ordered:  # progress: the oldest sequence goes first, so it is never a victim while others run
        oldest = min(ordered, key=lambda r: (r.metrics.arrival_time, r.request_id != r.group_id, r.request_id))
        ordered.remove(oldest)
        ordered.insert(0, oldest)
        if oldest.num_tokens <= oldest.num_computed_tokens:  # it waits for its group (beams): keep them all
            group = [r for r in ordered[1:] if r.group_id == oldest.group_id]
            ordered = [oldest, *group, *(r for r in ordered[1:] if r.group_id != oldest.group_id)]
    return ordered


def distinct_blocks(members: list[Request]) -> int:
    if len(members) == 1:
        return len(set(members[0].block_table))
    held: set[int] = set()
    for request in members:
        held.update(request.block_table)
    return len(held)


class PoolShare:
    """`order_by_pool_share`, incrementally: a group's count is kept until its members or their tables change.

    A group's key is (id, table_version) of each running member, in running order; ids reused by new
    requests are harmless, since versions are unique (a version-0 table is empty). A member moving
    within the running list only costs a recount.
    """

    def __init__(self) -> None:
        self._kept: dict[str, tuple[tuple[int, ...], int]] = {}  # group -> (key when counted, distinct blocks)

    def order(self, running: list[Request], step: int) -> list[Request]:
        members: dict[str, list[Request]] = {}
        keys: dict[str, tuple[int, ...]] = {}
        since: dict[str, int] = {}
        for request in running:  # one pass, no generators: this runs every step
            group_id, held_since = request.group_id, request.held_since_step
            group_members = members.get(group_id)
            if group_members is None:
                members[group_id] = [request]
                keys[group_id] = (id(request), request.table_version)
                since[group_id] = held_since if held_since < step else step
            else:
                group_members.append(request)
                keys[group_id] += (id(request), request.table_version)
                if held_since < since[group_id]:
                    since[group_id] = held_since
        kept, counted = self._kept, {}
        weight: dict[str, int] = {}
        for group_id, key in keys.items():
            entry = kept.get(group_id)
            if entry is None or entry[0] != key:
                entry = (key, distinct_blocks(members[group_id]))
            counted[group_id] = entry
            weight[group_id] = entry[1] * (step - since[group_id] + 1)
        self._kept = counted  # groups no longer running are dropped
        return _ordered(running, weight)

    def check(self, running: list[Request]) -> None:
        """Every kept count whose key still matches is right (AssertionError if a table changed
        without a new version)."""
        for group_id, group_members in members_by_group(running).items():
            entry = self._kept.get(group_id)
            key = tuple(part for r in group_members for part in (id(r), r.table_version))
            if entry is not None and entry[0] == key:
                assert entry[1] == distinct_blocks(group_members), (
                    f"group {group_id}: kept {entry[1]} blocks, holds {distinct_blocks(group_members)}")


def members_by_group(running: list[Request]) -> dict[str, list[Request]]:
    members: dict[str, list[Request]] = {}
    for request in running:
        members.setdefault(request.group_id, []).append(request)
    return members
