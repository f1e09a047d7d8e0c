"""SingleSequence: a plain request is a group of one that samples its own token every step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.groups.base import Decision, Sample
from kvserve.engine.groups.outputs import plain_output
from kvserve.engine.request import Request, RequestOutput


@dataclass(slots=True, eq=False)
class SingleSequence:
    root: Request

    @property
    def request_id(self) -> str:
        return self.root.request_id

    @property
    def finished(self) -> bool:
        return self.root.is_finished

    def sequences(self) -> list[Request]:
        return [self.root]

    def decide(self, rows: list[tuple[Request, int]], logits: torch.Tensor) -> list[Decision]:
        return [Sample(member, row) for member, row in rows]

    def output(self) -> RequestOutput | None:
        return plain_output(self.root)

    def mark_aborted(self) -> None:
        """Nothing to do: the root carries its own finish reason."""
