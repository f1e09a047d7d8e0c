"""Request: one generation's state as it moves through the engine, and what it reports back.

A request's tokens by index, where its counters meet (bs = block_size; all ranges half-open):

    [0, num_tokens)                           prompt + output so far (`all_token_ids`)
    [0, num_computed_tokens)                  KV in the pool, in `block_table` (matched, adopted or computed)
    [num_computed_tokens, num_tokens)         still to compute: a prefill chunk, or the last token (decode)
    [0, num_published_blocks * bs)            full blocks registered in the prefix cache (<= computed)
    [0, num_cached_tokens)                    found in the prefix cache at first admission, plus blocks
                                              adopted while prefilling: the `cached_tokens` it reports
    [num_published_blocks * bs, k * bs)       at a block boundary while prefilling: cached meanwhile by
                                              another request -> adopt those blocks (k = blocks matched)
    [published * bs, present * bs)            at publish: registered first by another request -> swap our
                                              copies for the cached blocks, free ours

Only the block manager moves `num_computed_tokens` back (preemption frees everything: 0) and touches
`block_table`, `block_hashes` and `num_published_blocks`; the engine advances `num_computed_tokens`
after each forward.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvserve.engine.detokenizer import DetokenizerState, streamable_length
from kvserve.engine.params import BeamSearchParams, SamplingParams
from kvserve.prefix.base import Namespace

if TYPE_CHECKING:
    from kvserve.lora.adapter import LoRAAdapter


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # its prefix is being loaded from the disk or remote tier
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"  # failed inside the engine; the output carries a generic message, the log the details


class RequestError(ValueError):
    """A failure the request itself caused, found only while generating (e.g. its masks leave no token):
    its message names no internals, so the caller is told it instead of the generic one (failures.py)."""


@dataclass(slots=True)
class TokenLogprob:
    """kvserve's per-token log-prob record (what the sampler produces and the server formats)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
    rank: int = 1  # 1 + how many tokens the raw distribution rates strictly higher


@dataclass(slots=True)
class Logprob:
    """vLLM's `Logprob`: one token's log-prob, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def vllm_logprobs(entries: list[TokenLogprob], decode: Callable[[int], str] | None) -> list[dict[int, Logprob]]:
    """kvserve's records as vLLM's `list[dict[int, Logprob]]`: per position the sampled token plus the
    top alternatives, keyed by token id (the top ones ranked 1..N)."""
    result = []
    for entry in entries:
        position = {token: Logprob(value, rank, decode(token) if decode else None)
                    for rank, (token, value) in enumerate(entry.top, start=1)}
        if entry.token_id not in position:
            text = decode(entry.token_id) if decode else None
            position = {entry.token_id: Logprob(entry.logprob, entry.rank, text), **position}
        result.append(position)
    return result


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def total_time(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request (vLLM's fields first): the only one of a plain request, a sample of
    a parallel (n / best_of) request, or a beam hypothesis.

    `logprobs` is vLLM's shape (`list[dict[int, Logprob]]`); `token_logprobs` kvserve's records.
    `stop_reason`: the stop string or stop token id that ended it (None for EOS or length).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None  # sum of the raw model log-probs of token_ids
    score: float | None = None  # beam search: cumulative_logprob / len(token_ids) ** length_penalty
    token_logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        """vLLM's `BeamSearchSequence.tokens` spelling (completion tokens here)."""
        return self.token_ids

    @property
    def cum_logprob(self) -> float | None:
        """vLLM's `BeamSearchSequence.cum_logprob` spelling."""
        return self.cumulative_logprob


@dataclass(slots=True)
class RequestOutput:
    """A request's result so far (cumulative); `delta_*` hold what the last step added.

    `outputs` (as vLLM's) always lists the completions: one for a plain request, n for a parallel
    (n / best_of) or beam-search request (in sample order, or best first when ranked: best_of > n,
    beam search). kvserve's top-level fields (`text`, `token_ids`, `finish_reason`, `logprobs` as
    kvserve's records, `delta_*`) mirror `outputs[0]`. A ranked request reports once, when finished;
    the others after every step (each completion with its own `delta_*`).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)  # device/host/disk/remote
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    outputs: list[CompletionOutput] | None = None  # None given: one completion from the top-level fields
    # params.prompt_logprobs: kvserve's records for prompt tokens 1.. (`prompt_token_logprobs`) and vLLM's
    # shape (`prompt_logprobs`: None for the first token, then a dict per token; filled by LLM)
    prompt_token_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # the request failed inside the engine: a generic message naming its id
    error_is_request_fault: bool = False  # `error` is the request's own doing (failures.RequestError)

    def __post_init__(self) -> None:
        if self.outputs is None:
            self.outputs = [CompletionOutput(
                0, self.text, self.token_ids, self.finish_reason, token_logprobs=self.logprobs,
                delta_text=self.delta_text, delta_token_ids=self.delta_token_ids,
            )]

    @property
    def completions(self) -> list[CompletionOutput]:
        """Every completion (the same list as `outputs`)."""
        return self.outputs

    @property
    def sequences(self) -> list[CompletionOutput]:
        """vLLM's `BeamSearchOutput.sequences` spelling: the hypotheses, best first."""
        return self.outputs


@dataclass(slots=True, eq=False)
class Request:
    """Engine-side state. Tokens are prompt + output; KV exists for the first `num_computed_tokens`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: Namespace = ()
    prompt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_published_blocks: int = 0  # leading blocks registered in the prefix cache
    num_cached_tokens: int = 0  # prefix hit at first admission (+ adopted), see the module docstring
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)  # splits num_cached_tokens
    kv_sources: dict[int, str] = field(default_factory=dict)  # block index -> tier it was loaded from
    kv_load_tried: bool = False  # a disk/remote load was started for the current admission
    probe_remote: bool = True  # False: a router knows the shared store holds nothing more of it (kv_tiers.py)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    seed: int | None = None  # what `generator` was seeded with (a parallel group derives its members')
    beam_params: BeamSearchParams | None = None  # a beam-search request as submitted (params: per beam)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # entry i: prompt token i + 1 (params.prompt_logprobs)
    output_text: str = ""
    num_sent_tokens: int = 0  # outputs already reported through deltas
    num_sent_chars: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    group_id: str = ""  # the request as submitted that this sequence belongs to (itself, or a fork's root)
    detokenizer: DetokenizerState = field(default_factory=DetokenizerState)
    may_share_tail: bool = False  # forked: the partial tail block may be shared (copy it before writing)
    cumulative_logprob: float = 0.0  # kept when its group asks for it (parallel members, beams)
    stop_reason: str | int | None = None  # the stop string or stop token id that finished it
    grammar: Any = None  # a structured-output matcher (engine/structured.py) when params ask for one
    lora: LoRAAdapter | None = None  # the adapter it runs under (its id is also in `namespace`)
    priority: int = 0  # --schedule-policy priority: lower first (vLLM's convention; engine/waiting_order.py)
    background: bool = False  # a router's idle copy: runs only while nothing else does (engine/background.py)
    allowed_ids: torch.Tensor | None = None  # params.allowed_token_ids as a tensor, made at its first step
    held_since_step: int = 0  # scheduler step at which it last got blocks (admission or fork): fair preemption
    table_version: int = 0  # renumbered by the block manager on every change to `block_table` (engine/pool_share.py)
    speculate: bool = False  # a plain request on an engine with speculative_config: steps may carry drafts
    draft_backoff: int = 0  # after drafts that all missed: outputs to decode plainly before drafting again
    drafts_resume_at: int = 0  # ... counted from here (num_output_tokens), see engine/speculative.py

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.group_id = self.group_id or self.request_id
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def num_reusable_blocks(self, block_size: int) -> int:
        """Leading whole blocks whose KV may come from a cache: all but the last token's, and while prompt
        log-probs are still owed only those before the first unscored position (its logits are needed)."""
        usable = (self.num_tokens - 1) // block_size
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1:
            usable = min(usable, len(self.prompt_logprobs) // block_size)
        return usable

    def prompt_positions_to_score(self, start: int, end: int) -> range:
        """Of the positions [start, end) computed now, those whose logits score a prompt token not yet
        scored (position p scores prompt token p + 1); empty when no prompt log-probs are asked."""
        if self.prompt_logprobs is None:
            return range(0)
        scored = len(self.prompt_logprobs)
        if start > scored and scored < self.num_prompt_tokens - 1:
            raise RuntimeError(f"request {self.request_id}: positions from {start} computed before prompt "
                               f"position {scored} was scored")  # num_reusable_blocks prevents it
        return range(max(start, scored), min(end, self.num_prompt_tokens - 1))

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def was_admitted(self) -> bool:
        """Admitted at least once (so a later admission is a resumption, not a first prefix query)."""
        return self.metrics.first_scheduled_time is not None

    def take_delta(self) -> tuple[str, list[int]]:
        """Text and token ids produced since the last call; advances the sent counters.

        Text that could still turn into a stop string is held back until it cannot (or until the end).
        """
        text_end = streamable_length(self.output_text, self.params.stop, self.is_finished)
        delta_text = self.output_text[self.num_sent_chars : text_end]
        delta_tokens = self.output_token_ids[self.num_sent_tokens :]
        self.num_sent_chars = max(self.num_sent_chars, text_end)
        self.num_sent_tokens = self.num_output_tokens
        return delta_text, delta_tokens
