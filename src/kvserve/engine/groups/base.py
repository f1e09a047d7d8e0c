"""SequenceGroup: what every request is to the engine, and the decisions a group hands back.

Every request as submitted is a group of sequences: a plain request is a group of one
(`SingleSequence`), a parallel request (n / best_of) forks into members at its first token, a
beam-search request keeps `beam_width` beams. After each forward the engine gives every group the
logits rows of its members that produced one, and the group answers with decisions. The group never
touches the scheduler, the block manager or the pool: `LLMEngine` applies the decisions through their
public methods, in this order:

1. `Fork(parent, child)`    -> `Scheduler.add_fork` (which calls `BlockManager.fork`: shared blocks)
2. `Sample(member, row)`    -> one `sample()` over every group's rows, then append + stop checks
   `Extend(member, token)`  -> append a token the group chose (beam search), no sampling
3. `Drop(member)`           -> `Scheduler.finish`: the member leaves, its blocks are released
4. `Finish()`               -> every live member is finished; the group reports its final output

A group that is waiting for more rows (a beam whose siblings have not computed yet) answers `[]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.engine.request import Request, RequestOutput


@dataclass(slots=True, frozen=True)
class Fork:
    """Add `child` (built by `fork_sequence(parent, ...)`) beside `parent`, sharing its blocks."""

    parent: Request
    child: Request


@dataclass(slots=True, frozen=True)
class Sample:
    """Continue `member`: sample its next token from logits row `row` of this step."""

    member: Request
    row: int
    track_logprob: bool = False  # add the token's raw log-prob to member.cumulative_logprob


@dataclass(slots=True, frozen=True)
class Extend:
    """Continue `member` with a token the group chose; its cumulative log-prob becomes `cumulative_logprob`."""

    member: Request
    token_id: int
    cumulative_logprob: float


@dataclass(slots=True, frozen=True)
class Drop:
    """`member` leaves the group: it is finished and its blocks are released."""

    member: Request


@dataclass(slots=True, frozen=True)
class Finish:
    """The group is done: finish every live member."""


Decision = Fork | Sample | Extend | Drop | Finish


class SequenceGroup(Protocol):
    """The sequences of one submitted request, deciding together what each does next."""

    root: Request  # the request as submitted (its id is the group's id)

    @property
    def request_id(self) -> str: ...

    @property
    def finished(self) -> bool:
        """Nothing of the group runs any more (its output, if any, is final)."""
        ...

    def sequences(self) -> list[Request]:
        """Every sequence of the group that exists now (finished members included)."""
        ...

    def decide(self, rows: list[tuple[Request, int]], logits: torch.Tensor) -> list[Decision]:
        """The members that computed logits this step, each with its row in `logits [rows, vocab]`."""
        ...

    def output(self) -> RequestOutput | None:
        """The group's output after this step; None when there is nothing to report yet."""
        ...

    def mark_aborted(self) -> None:
        """After the engine aborted every unfinished member."""
        ...
