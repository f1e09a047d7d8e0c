"""Beam search inside the engine: the beams of one request are sequences sharing their history's blocks.

A beam-search request starts as one sequence (the prompt). Its beams are ordinary scheduler requests,
batched with everything else; instead of sampling, each beam hands its logits row to the group. Once
every live beam has its row, the group takes one beam step (scoring as Hugging Face's `_beam_search`,
see beam_scoring.py): a beam chosen once continues in place, a beam chosen again is forked (it shares
the parent's blocks, and the partly filled tail is copied when first written, see fork.py), and a beam
not chosen is released. Finished hypotheses are plain token lists: they hold no blocks.

A beam that has its row but waits for a sibling (not scheduled in this step, or preempted) simply has
nothing to compute, and the scheduler skips it. Rows survive preemption, so a group always advances.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from kvserve.engine.groups.base import Decision, Drop, Extend, Finish, Fork
from kvserve.engine.groups.beam_scoring import BeamScorer, Candidate, num_candidates, top_candidates
from kvserve.engine.groups.fork import fork_sequence
from kvserve.engine.groups.outputs import group_output
from kvserve.engine.params import BeamSearchParams
from kvserve.engine.request import CompletionOutput, Request, RequestOutput
from kvserve.model.tokenizer import Tokenizer


@dataclass(slots=True, eq=False)
class BeamGroup:
    """The live beams and finished hypotheses of one beam-search request (`root`: the prompt)."""

    root: Request
    params: BeamSearchParams
    tokenizer: Tokenizer | None
    scorer: BeamScorer = field(init=False)
    beams: list[Request] = field(init=False)
    rows: dict[Request, torch.Tensor] = field(default_factory=dict)  # this step's logits, per beam
    num_generated: int = 0
    done: bool = False
    aborted: bool = False
    _ids: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        params = self.params
        self.scorer = BeamScorer(params.beam_width, params.max_tokens, self.root.eos_token_ids,
                                 params.length_penalty, params.early_stopping)
        self.beams = [self.root]

    @property
    def request_id(self) -> str:
        return self.root.request_id

    @property
    def finished(self) -> bool:
        return self.done

    def sequences(self) -> list[Request]:
        return self.beams

    def decide(self, rows: list[tuple[Request, int]], logits: torch.Tensor) -> list[Decision]:
        """Keep the rows; once every live beam has one, take a beam step."""
        for beam, row in rows:
            self.rows[beam] = logits[row]
        if self.done or len(self.rows) < len(self.beams):
            return []
        return self._step()

    def _step(self) -> list[Decision]:
        """One beam step: score the candidates, record finished ones, fork / keep / drop beams."""
        beams = self.beams
        log_probs = torch.stack([self.rows[beam] for beam in beams]).float().log_softmax(dim=-1)
        self.rows = {}
        k = num_candidates(self.params.beam_width, len(self.root.eos_token_ids))
        candidates = top_candidates(log_probs, [beam.cumulative_logprob for beam in beams], k)
        self.num_generated += 1
        if self.num_generated == 1:
            self.root.metrics.first_token_time = time.monotonic()
        histories = [beam.output_token_ids for beam in beams]
        running = self.scorer.select(candidates, histories, self.num_generated)
        if self.scorer.is_done(running, self.num_generated):
            self.done = True
            return [Finish()]
        return self._advance(running)

    def _advance(self, running: list[Candidate]) -> list[Decision]:
        """The next beams: a parent's first pick continues in place, later picks fork from it.

        Forks copy the parent's history when they are decided, before any token of this step is
        appended; a parent not picked at all is dropped (shared blocks lose one reference).
        """
        parents = self.beams
        kept = [False] * len(parents)
        decisions: list[Decision] = []
        next_beams = []
        for candidate in running:
            parent = parents[candidate.beam]
            if kept[candidate.beam]:
                beam = fork_sequence(parent, f"{self.request_id}#b{next(self._ids)}")
                decisions.append(Fork(parent, beam))
            else:
                kept[candidate.beam] = True
                beam = parent
            next_beams.append(beam)
        decisions += [Extend(beam, c.token_id, c.score) for beam, c in zip(next_beams, running, strict=True)]
        decisions += [Drop(parent) for parent, is_kept in zip(parents, kept, strict=True) if not is_kept]
        self.beams = next_beams
        return decisions

    def mark_aborted(self) -> None:
        """After the engine aborted every live beam."""
        self.aborted = True
        self.done = True
        self.rows = {}

    def output(self) -> RequestOutput | None:
        """The finished hypotheses, best first (those finished so far when aborted); None while the
        search runs: hypotheses are only ranked at the end, so there is nothing to stream."""
        if not self.done:
            return None
        hypotheses = self.scorer.hypotheses[: self.params.num_returned]
        completions = [
            CompletionOutput(index, self._decode(h.token_ids), list(h.token_ids), h.finish_reason,
                             cumulative_logprob=h.cumulative_logprob, score=h.score,
                             delta_text=self._decode(h.token_ids), delta_token_ids=list(h.token_ids))
            for index, h in enumerate(hypotheses)
        ]
        output = group_output(self.root, completions, finished=True)
        if self.aborted:
            output.finish_reason = "abort"
        return output

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, self.params.skip_special_tokens)
