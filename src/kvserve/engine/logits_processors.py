"""Logits processors: what a request's SamplingParams change in its logits row before sampling.

In vLLM's order: allowed_token_ids (every other token masked), bad_words (a word's last token masked where
the output ends with the rest of it), min_tokens (EOS and stop ids masked until reached), logit_bias, then the penalties
(repetition over prompt + output tokens, frequency and presence over output tokens), and last the
structured-output grammar mask. Rows of requests that ask for none of these are left untouched (and
the logits tensor is not copied when no row needs processing). Log-probs are reported from the raw
logits, as vLLM's default `raw_logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.request import Request, RequestError


class NoTokenAllowed(RequestError):
    """A request's processors masked every token (e.g. allowed_token_ids all banned by bad_words, or none
    the grammar accepts): it cannot go on. Raised from sampling, it fails that request alone (failures.py)
    instead of letting an all -inf row pick token 0."""


def process_logits(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Logits after each request's processors (a new tensor when any row changes, else `logits`)."""
    rows = [i for i, r in enumerate(requests) if r.params.processes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for row in rows:
        _process_row(logits[row], requests[row])
        if bool((logits[row] == float("-inf")).all()):  # (a NaN row is the model's failure, not this)
            raise NoTokenAllowed(f"request {requests[row].group_id}: every token is masked (allowed_token_ids, "
                                 "bad_words, min_tokens or the grammar leave none)")
    return logits


def _process_row(row: torch.Tensor, request: Request) -> None:
    params = request.params
    vocab_size = row.shape[-1]
    if params.allowed_token_ids is not None:
        if request.allowed_ids is None:  # once per sequence, not per step (the list can be the vocabulary)
            request.allowed_ids = torch.tensor(params.allowed_token_ids, dtype=torch.long)
        allowed = request.allowed_ids
        kept = row[allowed]
        row.fill_(float("-inf"))
        row[allowed] = kept
    if params.bad_words_token_ids:
        _ban_bad_words(row, params.bad_words_token_ids, request.output_token_ids)
    if request.num_output_tokens < params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(request.eos_token_ids))
        banned_ids = [t for t in banned if t < vocab_size]
        if banned_ids:
            row[torch.tensor(banned_ids, dtype=torch.long)] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        row.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=row.dtype))
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        seen[torch.tensor(request.all_token_ids, dtype=torch.long)] = True
        penalised = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
        row.copy_(torch.where(seen, penalised, row))
    if (params.frequency_penalty or params.presence_penalty) and request.output_token_ids:
        counts = torch.bincount(torch.tensor(request.output_token_ids, dtype=torch.long),
                                minlength=vocab_size)[:vocab_size].to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    if request.grammar is not None:
        request.grammar.mask(row)


def _ban_bad_words(row: torch.Tensor, words: list[list[int]], output: list[int]) -> None:
    """vLLM's rule: a word's last token is banned when the output's last tokens are the word's others
    (a one-token word is banned always)."""
    for word in words:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or output[-len(prefix):] == prefix):
            row[word[-1]] = float("-inf")
