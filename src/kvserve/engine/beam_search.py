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

from kvserve.engine.beam_scoring import BeamScorer, Candidate, num_candidates, top_candidates
from kvserve.engine.fork import enqueue_fork, fork_request
from kvserve.engine.parallel import group_output
from kvserve.engine.params import (
    MAX_LENGTH_PENALTY,
    MAX_NUM_SAMPLES,
    MAX_TOKENS_LIMIT,
    SamplingParams,
    check_float,
    check_int,
)
from kvserve.engine.request import CompletionOutput, Request, RequestOutput
from kvserve.engine.scheduler import Scheduler
from kvserve.model.tokenizer import Tokenizer


@dataclass(slots=True)
class BeamSearchParams:
    """Beam search settings; Hugging Face `generate(num_beams=beam_width, do_sample=False, ...)` names.

    `num_return_sequences` (default: beam_width) hypotheses come back, best first. Stops on the
    model's EOS ids or after `max_tokens` generated tokens; no stop strings.
    """

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    num_return_sequences: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        check_int("beam_width", self.beam_width, 1, MAX_NUM_SAMPLES)
        check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        check_float("length_penalty", self.length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        returned = self.num_return_sequences
        if returned is not None and (not isinstance(returned, int) or not 1 <= returned <= self.beam_width):
            raise ValueError(f"num_return_sequences must be between 1 and beam_width, got {returned!r}")

    @property
    def num_returned(self) -> int:
        return self.num_return_sequences or self.beam_width

    def sampling_params(self) -> SamplingParams:
        """What each beam carries as a request (beams never sample: the group picks their tokens)."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0,
                              skip_special_tokens=self.skip_special_tokens)


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
        return not self.beams

    def sequences(self) -> list[Request]:
        return self.beams

    def add_row(self, beam: Request, logits: torch.Tensor) -> None:
        self.rows[beam] = logits

    @property
    def ready(self) -> bool:
        """Every live beam has its logits for this step."""
        return bool(self.beams) and len(self.rows) == len(self.beams)

    def step(self, scheduler: Scheduler) -> None:
        """One beam step: score the candidates, record finished ones, fork / keep / release beams."""
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
            self.release(scheduler)
            return
        self.beams = self._advance(running, scheduler)

    def _advance(self, running: list[Candidate], scheduler: Scheduler) -> list[Request]:
        """The next beams: a parent's first pick continues in place, later picks fork from it."""
        parents = self.beams
        kept = [False] * len(parents)
        next_beams = []
        for candidate in running:
            parent = parents[candidate.beam]
            if kept[candidate.beam]:
                beam = fork_request(parent, f"{self.request_id}#b{next(self._ids)}", scheduler.block_manager)
                enqueue_fork(scheduler, parent, beam)
            else:
                kept[candidate.beam] = True
                beam = parent
            next_beams.append(beam)
        # Tokens go on only after every fork, so forks copy the parent's history without them.
        for beam, candidate in zip(next_beams, running, strict=True):
            beam.append_token(candidate.token_id)
            beam.cumulative_logprob = candidate.score
        for parent, is_kept in zip(parents, kept, strict=True):
            if not is_kept:
                scheduler.finish(parent)  # a dropped beam releases its blocks (shared ones lose a ref)
        return next_beams

    def release(self, scheduler: Scheduler) -> None:
        """End the search: every live beam gives its blocks back."""
        for beam in self.beams:
            if not beam.is_finished:
                scheduler.finish(beam)
        self.beams = []
        self.rows = {}

    def mark_aborted(self) -> None:
        """After the engine aborted every live beam."""
        self.aborted = True
        self.beams = []
        self.rows = {}

    def output(self) -> RequestOutput | None:
        """The finished hypotheses, best first (those finished so far when aborted); None while the
        search runs: hypotheses are only ranked at the end, so there is nothing to stream."""
        if self.beams:
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
