"""The row cap: at most `max_step_rows` running sequences compute in one step, taking turns.

On a CPU a step's cost grows about linearly with its rows (idle, the 135M model with quantized
weights: ~4 ms a decode row against ~3.5 ms fixed per step), and a short request arriving under load
waits for the step in flight and then runs in a step of its own: both as long as the rows they carry.
So a step that carries every running sequence (up to `max_num_seqs`) makes a newcomer's time to
first token a multiple of its solo TTFT, however the queue is ordered. The cap keeps every step short:
running sequences beyond it sit the step out (keeping their blocks), the longest-waiting first in
line for the next one; a newcomer's first chunk is admitted beside the capped rows (the cap bounds
what runs, not who may start), its own chunk bounded by `long_prefill_token_threshold`. On an idle CPU
with quantized weights a row costs about the same in a batch of 8 as in one of 32, so a small cap
costs little decode throughput; where a step's fixed part is large (dense weights, an oversubscribed
CPU) it costs more, which `auto` bounds (engine/step_cost.py); on a GPU, where rows are nearly free up
to hundreds, auto leaves it off.

Rotation is by group (a plain request, or the samples / beams of one request, which move together:
a beam search decides only when all its beams have logits). A group's turn comes by the step in which
its members last computed; the group that has waited longest goes first and is always served: whole,
or, if it is larger than the cap, with a whole step of `max_rows` of its members (those that computed
longest ago); then further groups in that order, each whole if it still fits, so small groups fill
what a large one leaves. Never-served groups (none: admission serves a group) would go first.
Guarantee (tests/test_step_rows.py checks it on random steps): with single-sequence groups, every
running sequence computes at least once every ceil(running / cap) steps; with groups, each group at
least once every (number of running groups) steps, since the longest-waiting group is always served.
Newcomers take their first step beside the rows and then join the back of the line, so they never
push an older sequence's turn back. vLLM has no such cap (`max_num_seqs` bounds running sequences and
`max_num_batched_tokens` a step's tokens, both far above what keeps a CPU step short). `--max-step-rows
auto` (opt-in; the default is 0, off: measured no help on an idle CPU) sets the cap from measured step times
(engine/step_cost.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.engine.request import Request

@dataclass(slots=True)
class RowRotation:
    """Which running sequences compute this step; `max_rows` 0 turns the cap off."""

    max_rows: int
    _group_served: dict[str, int] = field(default_factory=dict)  # group id -> last step it had a turn
    _served: dict[str, int] = field(default_factory=dict)  # sequence (request id) -> last step it computed

    def select(self, running: Sequence[Request]) -> set[str] | None:
        """Request ids of the running sequences that may compute this step, whole groups in turn; None:
        every one (cap off, or no more sequences with work than the cap). `running` is the scheduler's
        order (pool share), which breaks ties between groups that waited as long."""
        if not self.max_rows:
            return None
        groups: dict[str, list[Request]] = {}
        num_rows = 0
        for request in running:
            if request.num_tokens > request.num_computed_tokens:  # else: holding logits for its group
                groups.setdefault(request.group_id, []).append(request)
                num_rows += 1
        if num_rows <= self.max_rows:
            return None
        group_served, cap = self._group_served, self.max_rows
        chosen: set[str] = set()
        for group_id in sorted(groups, key=lambda g: group_served.get(g, -1)):  # stable: running order on ties
            members = groups[group_id]
            if len(members) > cap and not chosen:  # a group above the cap: its turn is a whole step
                members = sorted(members, key=lambda r: self._served.get(r.request_id, -1))[:cap]
            elif len(chosen) + len(members) > cap:
                continue  # fits whole in a later step, where it comes first
            chosen.update(member.request_id for member in members)
            if len(chosen) >= cap:
                break
        return chosen

    def record(self, computed: Iterable[Request], running: Sequence[Request], step: int) -> None:
        """After the step is scheduled: its sequences computed at `step` (and their groups had a turn);
        sequences and groups no longer running are forgotten."""
        if not self.max_rows:
            return
        served, group_served = self._served, self._group_served
        for request in computed:
            served[request.request_id] = step
            group_served[request.group_id] = step
        self._served = {r.request_id: served[r.request_id] for r in running if r.request_id in served}
        self._group_served = {r.group_id: group_served[r.group_id] for r in running if r.group_id in group_served}


def group_sit_outs(running: Sequence[Request], max_group_rows: int) -> set[str]:
    """The group cap (`max_group_rows`, 0: off): request ids of the sequences that sit this step out so
    that no group (the n samples / best_of / beams of one request) computes more than `max_group_rows`
    rows in it. Only when other groups run or wait (the caller's call); alone, a group takes every row.
    A group's members with the fewest computed tokens go first (running order on ties), so its samples
    take turns and stay level, and a beam that already holds its logits (nothing to compute) is not
    counted. Why: one request of n=16 puts 16 rows in every step, and every newcomer's step and the step
    in flight when it arrives carry them (benchmarks/results/soak.md); capped, such a request runs at
    `max_group_rows` rows a step while others are served, like everyone else's single row."""
    if not max_group_rows:
        return set()
    groups: dict[str, list[Request]] = {}
    for request in running:
        if request.num_tokens > request.num_computed_tokens:
            groups.setdefault(request.group_id, []).append(request)
    out: set[str] = set()
    for members in groups.values():
        if len(members) > max_group_rows:
            members = sorted(members, key=lambda r: r.num_computed_tokens)  # stable: running order on ties
            out.update(member.request_id for member in members[max_group_rows:])
    return out
