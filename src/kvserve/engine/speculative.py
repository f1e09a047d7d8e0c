"""Speculative decoding by prompt lookup (vLLM's `{"method": "ngram"}`): drafts from the request's own tokens.

Code edits, RAG answers, agent tool loops and multi-turn chat repeat long runs of their context. When the
last n tokens of a running request occurred earlier in its prompt or output, the tokens that followed
them there are a guess at what comes next. The step then computes the last token and k drafted ones as
one chunk (one pass over the weights, which is what a decode step costs on a CPU) and checks the logits
of every position in order: each row is sampled exactly as a normal step would sample it (processors,
grammar, penalties, the request's own generator), the token is appended, and the check goes on only
while the sampled token equals the draft. So the output is the one plain decoding gives, token for token,
greedy or seeded: a draft token is kept only when sampling chose it (for a one-point draft that is
speculative sampling's accept-with-probability-p rule, and a mismatch is the residual draw). Accepted
drafts' KV is already in the pool; the rejected tail's slots are overwritten when those positions are
computed again (`num_computed_tokens` moves back; nothing unverified is ever published to the prefix
cache).

Scope: plain requests (groups of one); n / best_of samples and beams decode one token at a time. Drafts
are proposed only when they fit the step's token budget and the pool's free blocks (no preemption, no
cached block evicted for a guess).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvserve.engine.sampler import sample

if TYPE_CHECKING:
    from kvserve.engine.request import FinishReason, Request, TokenLogprob

    Append = Callable[[Request, int, TokenLogprob | None], FinishReason | None]  # tokens.append_sampled_token

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16
MAX_BACKOFF = 16  # outputs decoded without drafts, at most, after drafts that missed


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for `method: ngram`: propose up to `num_speculative_tokens` tokens that
    followed the longest match (from `prompt_lookup_max` down to `prompt_lookup_min` tokens) of the
    sequence's tail, searched in its own prompt and output."""

    # Defaults measured on a Zen 4 (benchmarks/results/speculative.md): 3 drafts beat 2, 4 and 6; matches
    # shorter than 3 tokens draft often and miss often.
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 3
    method: str = "ngram"
    # vLLM's knob: no drafts while more requests than this run. On a CPU a batched step is bound by its
    # rows' arithmetic, so drafts stop paying from a few requests (measured: 1.14x at 2 running, 0.95-1.05x
    # at 4, 0.93-0.99x at 9).
    disable_by_batch_size: int = 2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS} (no draft models on this "
                             f"engine), got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")


def parse_speculative_config(value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """A config from a dict, its JSON text (the CLI flag) or None (off); ValueError naming what is wrong."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"speculative_config is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    known = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
    for key, item in value.items():
        if key != "method" and (not isinstance(item, int) or isinstance(item, bool)):
            raise ValueError(f"speculative_config {key} must be an integer, got {item!r}")
    value = dict(value)
    defaults = SpeculativeConfig()
    if "prompt_lookup_max" in value and "prompt_lookup_min" not in value:  # one bound given: the other follows
        value["prompt_lookup_min"] = min(defaults.prompt_lookup_min, value["prompt_lookup_max"])
    if "prompt_lookup_min" in value and "prompt_lookup_max" not in value:
        value["prompt_lookup_max"] = max(defaults.prompt_lookup_max, value["prompt_lookup_min"])
    return SpeculativeConfig(**value)


def propose_ngram(tokens: list[int], config: SpeculativeConfig, limit: int) -> list[int]:
    """Up to `limit` (<= num_speculative_tokens) tokens that followed the latest earlier occurrence of the
    longest matching tail n-gram (the latest one followed by all `limit` of them, when there is one: in a
    run of one token the latest occurrence is one step back and has a single follower); [] when nothing
    matches."""
    limit = min(limit, config.num_speculative_tokens)
    if limit <= 0 or len(tokens) < config.prompt_lookup_min + 1:
        return []
    sequence = np.asarray(tokens, dtype=np.int64)
    for n in range(min(config.prompt_lookup_max, len(tokens) - 1), config.prompt_lookup_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(sequence[:-1], n)  # every earlier n-gram
        hits = np.flatnonzero((windows == sequence[-n:]).all(axis=1))
        if hits.size:  # the latest occurrence (nearest context) among those followed by `limit` tokens, if any
            whole = hits[hits + n + limit <= len(tokens)]
            start = int(whole[-1] if whole.size else hits[-1]) + n
            return sequence[start : start + limit].tolist()
    return []


@dataclass(slots=True)
class SpeculativeCounters:
    """Totals since start (vLLM's spec_decode counters): draft tokens proposed and accepted, and the
    steps that carried drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted

    def stats(self) -> dict[str, int | float]:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return {"spec_drafts": self.num_drafts, "spec_draft_tokens": self.num_draft_tokens,
                "spec_accepted_tokens": self.num_accepted_tokens, "spec_acceptance_rate": rate}


@dataclass(slots=True)
class Speculator:
    """The scheduler's drafter: how many drafts a running request may carry this step, and which."""

    config: SpeculativeConfig
    max_model_len: int
    counters: SpeculativeCounters = field(default_factory=SpeculativeCounters)

    def draft(self, request: Request, budget: int, num_running: int) -> list[int]:
        """Drafts for a request about to decode one token ([] when it does not speculate, or more than
        `disable_by_batch_size` requests run): at most what the step's `budget` leaves beside its own token,
        what `max_tokens` leaves after the token every step yields anyway, and what the context allows."""
        if not request.speculate or request.num_tokens - request.num_computed_tokens != 1:
            return []
        if num_running > self.config.disable_by_batch_size:
            return []
        if request.num_output_tokens < request.drafts_resume_at:  # backing off after drafts that missed
            return []
        limit = min(budget - 1, request.params.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens)
        return propose_ngram(request.all_token_ids, self.config, limit)

    def verify(self, request: Request, draft: list[int], logits: torch.Tensor, append: Append,
               publish: Callable[[Request], None]) -> FinishReason | None:
        """Check a drafted step (`logits`: its last token's row, then one per draft) row by row: each row
        sampled as a plain step would, its token appended, on only while it equals the draft. The KV of
        the last token and of the accepted drafts is kept (and published); the rest is computed again
        later. Returns why the request ends, if a token ended it (the caller finishes it)."""
        start = request.num_computed_tokens
        reason, accepted, matched = None, 0, 0
        for row in range(len(draft) + 1):
            token_ids, logprobs = sample(logits[row : row + 1], [request])
            reason = append(request, token_ids[0], logprobs[0])
            hit = row < len(draft) and token_ids[0] == draft[row]
            matched += hit
            if reason is not None or not hit:
                break
            accepted += 1
        request.num_computed_tokens = start + 1 + accepted
        publish(request)
        self.counters.record(len(draft), matched)
        back_off(request, matched)
        return reason


def back_off(request: Request, matched: int) -> None:
    """Drafts that all missed cost a wider step for one token: decode the next 1, 2, 4 ... `MAX_BACKOFF`
    outputs plainly before drafting again; any accepted draft ends the back-off. (Open questions, where a
    tail n-gram recurs but what followed it does not: benchmarks/results/speculative.md.)"""
    if matched:
        request.draft_backoff = 0
        return
    request.draft_backoff = min(2 * request.draft_backoff or 1, MAX_BACKOFF)
    request.drafts_resume_at = request.num_output_tokens + request.draft_backoff


def make_speculator(value: SpeculativeConfig | dict[str, Any] | str | None, max_model_len: int) -> Speculator | None:
    """The engine's drafter for `EngineConfig.speculative_config`; None when off."""
    config = parse_speculative_config(value)
    return None if config is None else Speculator(config, max_model_len)
