"""Sampler: logits processors, greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Random rows draw with the exponential-race trick (argmax of p / Exp(1) noise) from the request's own
torch.Generator, so a seeded request gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.logits_processors import process_logits
from kvserve.engine.request import Request, TokenLogprob


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row of ``logits [rows, vocab]`` (float32); row i belongs to requests[i].

    The processors (penalties, bias, min_tokens, grammar) apply first; log-probs are of the raw row."""
    processed = process_logits(logits, requests)
    token_ids = processed.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, dtype=torch.long)
        probs = _processed_probs(processed[rows], [requests[i] for i in random_rows])
        for position, row in enumerate(random_rows):
            noise = torch.empty_like(probs[position]).exponential_(generator=requests[row].generator)
            token_ids[row] = (probs[position] / noise).argmax()
    sampled = token_ids.tolist()
    return sampled, _logprobs(logits, requests, sampled)


def _processed_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    temperatures = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype)
    logits = logits / temperatures.unsqueeze(1)
    top_ks = [r.params.top_k for r in requests]
    if any(k > 0 for k in top_ks):
        logits = _apply_top_k(logits, top_ks)
    probs = logits.softmax(dim=-1)
    top_ps = [r.params.top_p for r in requests]
    if any(p < 1.0 for p in top_ps):
        probs = _apply_top_p(probs, torch.tensor(top_ps, dtype=probs.dtype))
    min_ps = [r.params.min_p for r in requests]
    if any(p > 0.0 for p in min_ps):
        threshold = torch.tensor(min_ps, dtype=probs.dtype).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab_size else vocab_size for k in top_ks])
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth_largest = sorted_logits.gather(1, (ks - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def _apply_top_p(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest set whose mass reaches top_p: drop a token if the mass before it already does.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_ps.unsqueeze(1), 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _logprobs(
    logits: torch.Tensor, requests: Sequence[Request], sampled: list[int]
) -> list[TokenLogprob | None]:
    """Log-probabilities of the model's raw distribution (before temperature and filters)."""
    wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    results: list[TokenLogprob | None] = [None] * len(requests)
    if not wanted:
        return results
    log_probs = logits[wanted].log_softmax(dim=-1)
    for position, row in enumerate(wanted):
        num_top = requests[row].params.logprobs or 0
        chosen = log_probs[position, sampled[row]]
        rank = int((log_probs[position] > chosen).sum().item()) + 1
        entry = TokenLogprob(sampled[row], chosen.item(), rank=rank)
        if num_top:
            values, indices = log_probs[position].topk(num_top)
            entry.top = list(zip(indices.tolist(), values.tolist(), strict=True))
        results[row] = entry
    return results


def add_cumulative_logprobs(logits: torch.Tensor, requests: Sequence[Request], token_ids: list[int],
                            rows: list[int]) -> None:
    """Add the sampled token's raw log-prob to `cumulative_logprob` of requests[i] for i in `rows`."""
    if not rows:
        return
    log_probs = logits[rows].log_softmax(dim=-1)
    picked = log_probs[torch.arange(len(rows)), torch.tensor([token_ids[i] for i in rows])].tolist()
    for row, logprob in zip(rows, picked, strict=True):
        requests[row].cumulative_logprob += logprob
