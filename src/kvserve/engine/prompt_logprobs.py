"""Prompt log-probs: score each prompt token against the logits of the position before it.

A request with `prompt_logprobs` needs the model's distribution after every prompt prefix, not only after
the whole prompt. The forward already computes the hidden state of every prefill position; only the
sampled positions go through the LM head. For the positions this step computed that score a prompt token
not yet scored, the head runs too, a few hundred rows at a time (a 2,048-token chunk's full logits would
be 400 MB at this vocabulary), and each row keeps only the prompt token's log-prob and rank and the top N.

Scores are appended in position order and never twice: a prompt recomputed after preemption, or a step
run again after a failed batch, scores only what is still missing (`Request.prompt_positions_to_score`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.engine.request import Request, TokenLogprob

ROWS_PER_HEAD_CALL = 256


@dataclass(slots=True)
class PromptSpan:
    """Positions of one request computed this step that score prompt tokens, and the first one's row."""

    request: Request
    positions: range
    first_row: int


def prompt_spans(request: Request, start: int, end: int, first_row: int) -> list[PromptSpan]:
    """The request's span for positions [start, end) laid out from batch row `first_row` (none when it
    asks no prompt log-probs or has none left to score there)."""
    positions = request.prompt_positions_to_score(start, end)
    if not positions:
        return []
    return [PromptSpan(request, positions, first_row + positions.start - start)]


def score_prompt_spans(
    spans: list[PromptSpan], hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Append each span's scores to its request's `prompt_logprobs`."""
    for span in spans:
        rows = torch.arange(span.first_row, span.first_row + len(span.positions))
        targets = span.request.prompt_token_ids[span.positions.start + 1 : span.positions.stop + 1]
        num_top = span.request.params.prompt_logprobs or 0
        for begin in range(0, len(rows), ROWS_PER_HEAD_CALL):
            part = rows[begin : begin + ROWS_PER_HEAD_CALL]
            log_probs = compute_logits(hidden[part]).log_softmax(dim=-1)
            span.request.prompt_logprobs.extend(
                score_rows(log_probs, targets[begin : begin + ROWS_PER_HEAD_CALL], num_top)
            )


def score_rows(log_probs: torch.Tensor, targets: list[int], num_top: int) -> list[TokenLogprob]:
    """One record per row: the target token's log-prob, its rank (1 + tokens rated strictly higher) and
    the `num_top` best alternatives, as the sampler records a sampled token."""
    chosen = log_probs.gather(1, torch.tensor(targets).unsqueeze(1))
    ranks = ((log_probs > chosen).sum(dim=1) + 1).tolist()
    values = chosen.squeeze(1).tolist()
    records = [TokenLogprob(token, value, rank=rank) for token, value, rank in zip(targets, values, ranks, strict=True)]
    if num_top:
        top_values, top_ids = log_probs.topk(num_top, dim=1)
        for record, ids, tops in zip(records, top_ids.tolist(), top_values.tolist(), strict=True):
            record.top = list(zip(ids, tops, strict=True))
    return records
