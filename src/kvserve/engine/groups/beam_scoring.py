"""Beam search scoring, step for step as Hugging Face transformers' `GenerationMixin._beam_search`.

Per step, for one request with W beams (transformers 4.5x / 5.x semantics, checked in tests):
- Every live beam's next-token log-probs are `log_softmax(logits)` (float32) plus the beam's cumulative
  log-prob; the best K = max(2, 1 + number of EOS ids) * W (beam, token) candidates over all beams are
  taken, best first. (At the first step there is one beam, the prompt: HF's W copies of it score -1e9
  for all but the first, which is the same.)
- A candidate *hits* when its token is an EOS id, or when it makes the output `max_tokens` long.
- The best W candidates that do not hit become the next beams.
- A hit ranked among the first W candidates (not W of the hits: of all K) is a finished hypothesis,
  scored `cumulative_logprob / num_generated_tokens ** length_penalty`, where the count includes the
  EOS token; the best W finished hypotheses are kept.
- The search ends when no candidate could continue (max_tokens reached), or once W hypotheses are
  finished and: `early_stopping=True`; or the best live beam cannot beat the worst finished one, judged
  with its current length (`early_stopping=False`), or with max_tokens when `early_stopping="never"`
  and length_penalty > 0 (with "never" and length_penalty <= 0, its current length again).
The result is the finished hypotheses, best first (HF returns the first `num_return_sequences`).

`length_normalized` divides as HF does while `length ** penalty` is a normal float (so scores stay
bit-equal to transformers), and goes through log space otherwise: a huge penalty or a long output
then gives 0 or -inf instead of an OverflowError / ZeroDivisionError on the engine thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Candidate:
    score: float  # cumulative log-prob including the new token (a float32 value)
    beam: int  # index of the parent among the live beams
    token_id: int


@dataclass(slots=True)
class Hypothesis:
    token_ids: list[int]  # generated tokens, the EOS token included
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (ended on EOS) or "length"


_MAX_LOG_FLOAT = 700.0  # exp(±700) is a normal float64; math.exp overflows just above 709


def length_normalized(score: float, length: int, penalty: float) -> float:
    """`score / length ** penalty` (score <= 0 is a log-prob sum, length >= 1), never raising."""
    log_denominator = penalty * math.log(length)
    if abs(log_denominator) <= _MAX_LOG_FLOAT:
        return score / (length**penalty)  # HF's arithmetic, exactly
    if score == 0.0:
        return 0.0
    log_magnitude = math.log(abs(score)) - log_denominator
    magnitude = math.inf if log_magnitude > _MAX_LOG_FLOAT else math.exp(log_magnitude)
    return math.copysign(magnitude, score)


def num_candidates(beam_width: int, num_eos_ids: int) -> int:
    """HF's K: enough candidates that W survive even if every beam's best token is an EOS."""
    return max(2, 1 + num_eos_ids) * beam_width


def top_candidates(log_probs: torch.Tensor, beam_scores: Sequence[float], k: int) -> list[Candidate]:
    """The k best (beam, token) continuations of ``log_probs [beams, vocab]``, best first."""
    scores = torch.tensor(beam_scores, dtype=torch.float32, device=log_probs.device)
    totals = (log_probs + scores.unsqueeze(1)).view(-1)
    values, indices = totals.topk(min(k, totals.numel()))
    vocab_size = log_probs.shape[1]
    return [Candidate(v, i // vocab_size, i % vocab_size)
            for v, i in zip(values.tolist(), indices.tolist(), strict=True)]


@dataclass(slots=True)
class BeamScorer:
    """Picks each step's next beams and keeps the best `beam_width` finished hypotheses."""

    beam_width: int
    max_tokens: int
    eos_token_ids: frozenset[int]
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    hypotheses: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width

    def select(
        self, candidates: list[Candidate], histories: list[list[int]], num_generated: int
    ) -> list[Candidate]:
        """Record the finished candidates; return the next beams (best first, at most beam_width).

        `histories[b]` is beam b's output so far; `num_generated` counts the tokens after this step.
        """
        at_max_length = num_generated >= self.max_tokens
        running: list[Candidate] = []
        finished: list[Hypothesis] = []
        for rank, candidate in enumerate(candidates):
            is_eos = candidate.token_id in self.eos_token_ids
            if is_eos or at_max_length:
                if rank < self.beam_width:
                    finished.append(self._hypothesis(candidate, histories[candidate.beam], is_eos))
            elif len(running) < self.beam_width:
                running.append(candidate)
        if finished:
            # Stable: on equal scores older hypotheses stay ahead.
            merged = sorted(self.hypotheses + finished, key=lambda h: h.score, reverse=True)
            self.hypotheses = merged[: self.beam_width]
        return running

    def _hypothesis(self, candidate: Candidate, history: list[int], is_eos: bool) -> Hypothesis:
        token_ids = [*history, candidate.token_id]
        score = length_normalized(candidate.score, len(token_ids), self.length_penalty)
        return Hypothesis(token_ids, candidate.score, score, "stop" if is_eos else "length")

    def is_done(self, running: list[Candidate], num_generated: int) -> bool:
        """Whether the search ends after this step (HF's stopping rules; see the module docstring)."""
        if not running:
            return True
        if len(self.hypotheses) < self.beam_width:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = num_generated
        best_possible = length_normalized(running[0].score, best_length, self.length_penalty)
        return best_possible <= self.hypotheses[-1].score
