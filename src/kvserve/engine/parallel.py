"""Parallel sampling: n (or best_of) completions of one prompt that share its KV blocks.

The request is prefilled once, as one sequence (the parent). When the parent's first logits arrive it
forks into best_of members: itself (member 0) and best_of - 1 children holding references to its
blocks (see fork.py). All members sample their first token from those same logits, each with its own
generator (member i seeded with `(seed + i) % 2**63`, so member i draws exactly what a lone request
with that seed would), then decode independently through the scheduler: each is preempted, stopped
and aborted on its own. The group reports one `RequestOutput` with a `CompletionOutput` per sample.
With best_of > n the n members with the highest cumulative log-probability are kept, so the group
reports only once, when every member has finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.engine.detokenizer import streamable_length
from kvserve.engine.fork import fork_request
from kvserve.engine.request import CompletionOutput, Request, RequestOutput

if TYPE_CHECKING:
    from kvserve.engine.block_manager import BlockManager

SEED_MODULUS = 2**63  # same derivation as the HTTP server's per-choice seeds


def member_seed(base_seed: int, index: int) -> int:
    return (base_seed + index) % SEED_MODULUS


@dataclass(slots=True, eq=False)
class ParallelGroup:
    """The members of one parallel request."""

    root: Request  # the request as submitted: the prefill sequence, then member 0
    n: int
    best_of: int
    base_seed: int | None  # None for greedy: members then need no generator
    members: list[Request] = field(default_factory=list)  # empty until the fork
    aborted: bool = False

    @property
    def request_id(self) -> str:
        return self.root.request_id

    @property
    def forked(self) -> bool:
        return bool(self.members)

    def sequences(self) -> list[Request]:
        """The sequences that exist now: the parent alone before the fork, then every member."""
        return self.members if self.members else [self.root]

    def fork(self, block_manager: BlockManager) -> list[Request]:
        """Create the children at the parent's first token; returns all members (parent first)."""
        children = [fork_request(self.root, f"{self.request_id}#{i}", block_manager)
                    for i in range(1, self.best_of)]
        if self.base_seed is not None:
            for i, child in enumerate(children, start=1):
                child.generator = torch.Generator(device="cpu").manual_seed(member_seed(self.base_seed, i))
        self.members = [self.root, *children]
        return self.members

    @property
    def finished(self) -> bool:
        return all(member.is_finished for member in self.sequences())

    def mark_aborted(self) -> None:
        """After the engine aborted every unfinished member."""
        self.aborted = True

    def output(self) -> RequestOutput | None:
        """The group's output now, or None while a best_of > n request is still running."""
        finished = self.finished
        ranked = self.best_of > self.n
        if ranked and not finished:
            return None
        members = self.sequences()
        if ranked:
            members = sorted(members, key=lambda m: m.cumulative_logprob, reverse=True)[: self.n]
        completions = [_completion(index, member) for index, member in enumerate(members)]
        output = group_output(self.root, completions, finished)
        if self.aborted:
            output.finish_reason = "abort"
        return output


def _completion(index: int, request: Request) -> CompletionOutput:
    """One member's completion so far; advances its sent-deltas bookkeeping (as LLMEngine._output)."""
    text_end = streamable_length(request.output_text, request.params.stop, request.is_finished)
    delta_text = request.output_text[request.num_sent_chars : text_end]
    delta_tokens = request.output_token_ids[request.num_sent_tokens :]
    request.num_sent_chars = max(request.num_sent_chars, text_end)
    request.num_sent_tokens = request.num_output_tokens
    return CompletionOutput(
        index=index, text=request.output_text,
        token_ids=list(request.output_token_ids),
        finish_reason=request.finish_reason.value if request.finish_reason else None,
        cumulative_logprob=request.cumulative_logprob,
        logprobs=None if request.logprobs is None else list(request.logprobs),
        delta_text=delta_text, delta_token_ids=delta_tokens,
    )


def group_output(root: Request, completions: list[CompletionOutput], finished: bool) -> RequestOutput:
    """A group's RequestOutput (`root`: the request as submitted); top-level fields mirror the first
    completion."""
    first = completions[0] if completions else CompletionOutput(0, "", [], None)
    return RequestOutput(
        request_id=root.request_id,
        prompt=root.prompt,
        prompt_token_ids=root.prompt_token_ids,
        text=first.text,
        token_ids=first.token_ids,
        finished=finished,
        finish_reason=first.finish_reason if finished else None,
        num_cached_tokens=max(root.num_cached_tokens, 0),
        metrics=root.metrics,
        logprobs=first.logprobs,
        delta_text=first.delta_text,
        delta_token_ids=first.delta_token_ids,
        outputs=completions,
    )


def add_cumulative_logprobs(logits: torch.Tensor, requests: list[Request], token_ids: list[int]) -> None:
    """Add each group member's sampled-token log-prob (raw model distribution) to its running sum."""
    rows = [i for i, request in enumerate(requests) if request.group is not None]
    if not rows:
        return
    log_probs = logits[rows].log_softmax(dim=-1)
    picked = log_probs[torch.arange(len(rows)), torch.tensor([token_ids[i] for i in rows])].tolist()
    for row, logprob in zip(rows, picked, strict=True):
        requests[row].cumulative_logprob += logprob
