"""Request: one generation's state as it moves through the engine, and what it reports back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.engine.params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.beam_search import BeamGroup
    from kvserve.engine.parallel import ParallelGroup


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


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
    """One completion of a request: a sample of a parallel (n / best_of) request or a beam hypothesis."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None  # sum of the raw model log-probs of token_ids
    score: float | None = None  # beam search: cumulative_logprob / len(token_ids) ** length_penalty
    logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    """A request's result so far (cumulative); `delta_*` hold what the last step added.

    A plain request has one completion: the top-level fields. A parallel (n / best_of) or beam-search
    request also carries `outputs`, its completions (in sample order, or best first when ranked:
    best_of > n, beam search); the top-level fields then mirror `outputs[0]`. `completions` gives the
    list for either kind. A ranked request reports once, when finished; the others after every step
    (each completion with its own `delta_*`).
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
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    outputs: list[CompletionOutput] | None = None

    @property
    def completions(self) -> list[CompletionOutput]:
        """Every completion: `outputs`, or the top-level fields as one completion for a plain request."""
        if self.outputs is not None:
            return self.outputs
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, logprobs=self.logprobs,
                                 delta_text=self.delta_text, delta_token_ids=self.delta_token_ids)]


@dataclass(slots=True, eq=False)
class Request:
    """Engine-side state. Tokens are prompt + output; KV exists for the first `num_computed_tokens`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: tuple[str, ...] = ()
    prompt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_published_blocks: int = 0  # leading blocks registered in the prefix cache
    num_cached_tokens: int = -1  # prefix hit at first admission; -1 until matched
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] | None = None
    output_text: str = ""
    num_sent_tokens: int = 0  # outputs already reported through deltas
    num_sent_chars: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    group: ParallelGroup | BeamGroup | None = None  # the parallel / beam-search request it belongs to
    may_share_tail: bool = False  # forked: the partial tail block may be shared (copy it before writing)
    cumulative_logprob: float = 0.0  # kept for group members only

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
