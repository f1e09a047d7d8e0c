"""SamplingParams and BeamSearchParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's names and meanings).

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1 and min_p 0 disable theirs.
    A request with a `seed` draws the same tokens whatever else shares its batch.

    `n` > 1 or `best_of` > 1 asks for several completions of one prompt (parallel sampling): the prompt
    is prefilled once and its blocks are shared; sample i draws from seed `(seed + i) % 2**63`.
    `best_of` (default n) samples are drawn and the n with the highest cumulative log-probability kept.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; N: plus the top N
    skip_special_tokens: bool = True
    n: int = 1
    best_of: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")

    @property
    def num_samples(self) -> int:
        """How many sequences are sampled: best_of if set, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


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
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
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
