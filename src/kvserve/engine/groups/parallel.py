"""Parallel sampling: n (or best_of) completions of one prompt that share its KV blocks.

The request is prefilled once, as one sequence (the parent). When the parent's first logits arrive it
forks into best_of members: itself (member 0) and best_of - 1 children sharing its blocks
(`Fork` decisions, see base.py). All members sample their first token from those same logits, each with its own
generator (member i seeded with `(seed + i) % 2**63`, so member i draws exactly what a lone request
with that seed would), then decode independently through the scheduler: each is preempted, stopped
and aborted on its own. The group reports one `RequestOutput` with a `CompletionOutput` per sample.
With best_of > n the n members with the highest cumulative log-probability are kept, so the group
reports only once, when every member has finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.engine.groups.base import Decision, Fork, Sample
from kvserve.engine.groups.fork import fork_sequence
from kvserve.engine.groups.outputs import group_output, member_completion
from kvserve.engine.request import Request, RequestOutput

SEED_MODULUS = 2**63  # same derivation as the HTTP server's per-choice seeds


def member_seed(base_seed: int, index: int) -> int:
    return (base_seed + index) % SEED_MODULUS


@dataclass(slots=True, eq=False)
class ParallelGroup:
    """The members of one parallel request."""

    root: Request  # the request as submitted: the prefill sequence, then member 0
    n: int
    best_of: int
    base_seed: int | None  # None for greedy: members then need no generator
    members: list[Request] = field(default_factory=list)  # empty until the fork
    aborted: bool = False

    @property
    def request_id(self) -> str:
        return self.root.request_id

    @property
    def forked(self) -> bool:
        return bool(self.members)

    def sequences(self) -> list[Request]:
        """The sequences that exist now: the parent alone before the fork, then every member."""
        return self.members if self.members else [self.root]

    def decide(self, rows: list[tuple[Request, int]], logits: torch.Tensor) -> list[Decision]:
        """Fork at the parent's first row (every member samples from it); then each member its own row."""
        decisions: list[Decision] = []
        if not self.members:
            (parent, row), = rows  # before the fork the parent is the only sequence
            children = self._fork_children()
            decisions = [Fork(parent, child) for child in children]
            rows = [(member, row) for member in self.members]
        return decisions + [Sample(member, row, track_logprob=True) for member, row in rows]

    def _fork_children(self) -> list[Request]:
        children = [fork_sequence(self.root, f"{self.request_id}#{i}") for i in range(1, self.best_of)]
        if self.base_seed is not None:
            for i, child in enumerate(children, start=1):
                child.generator = torch.Generator(device="cpu").manual_seed(member_seed(self.base_seed, i))
        self.members = [self.root, *children]
        return children

    @property
    def finished(self) -> bool:
        return all(member.is_finished for member in self.sequences())

    def mark_aborted(self) -> None:
        """After the engine aborted every unfinished member."""
        self.aborted = True

    def output(self) -> RequestOutput | None:
        """The group's output now, or None while a best_of > n request is still running."""
        finished = self.finished
        ranked = self.best_of > self.n
        if ranked and not finished:
            return None
        members = self.sequences()
        if ranked:
            members = sorted(members, key=lambda m: m.cumulative_logprob, reverse=True)[: self.n]
        completions = [member_completion(index, member) for index, member in enumerate(members)]
        output = group_output(self.root, completions, finished)
        if self.aborted:
            output.finish_reason = "abort"
        return output
