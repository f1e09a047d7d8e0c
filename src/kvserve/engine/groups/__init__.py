"""Groups of sequences behind one interface (base.py): a plain request (single.py), parallel sampling
(parallel.py) and beam search (beam_search.py + beam_scoring.py); fork.py copies a member's history."""

from __future__ import annotations

from kvserve.engine.groups.base import Decision, Drop, Extend, Finish, Fork, Sample, SequenceGroup
from kvserve.engine.groups.beam_search import BeamGroup
from kvserve.engine.groups.parallel import ParallelGroup
from kvserve.engine.groups.single import SingleSequence
from kvserve.engine.params import BeamSearchParams
from kvserve.engine.request import Request
from kvserve.model.tokenizer import Tokenizer

__all__ = [
    "BeamGroup", "Decision", "Drop", "Extend", "Finish", "Fork", "ParallelGroup", "Sample", "SequenceGroup",
    "SingleSequence", "make_group",
]


def make_group(
    root: Request, beam_params: BeamSearchParams | None, seed: int | None, tokenizer: Tokenizer | None
) -> SequenceGroup:
    """The group a submitted request runs as: beam search, parallel samples, or a single sequence."""
    if beam_params is not None:
        return BeamGroup(root, beam_params, tokenizer)
    if root.params.num_samples > 1:
        return ParallelGroup(root, root.params.n, root.params.num_samples, seed)
    return SingleSequence(root)
