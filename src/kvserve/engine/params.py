"""SamplingParams and BeamSearchParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's names and meanings).

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1 and min_p 0 disable theirs.
    A request with a `seed` draws the same tokens whatever else shares its batch.

    `n` > 1 or `best_of` > 1 asks for several completions of one prompt (parallel sampling): the prompt
    is prefilled once and its blocks are shared; sample i draws from seed `(seed + i) % 2**63`.
    `best_of` (default n) samples are drawn and the n with the highest cumulative log-probability kept.

    Logits processing, in vLLM's order, on every row (greedy too) before temperature and the filters:
    `min_tokens` masks EOS and `stop_token_ids` until that many tokens exist; `logit_bias` is added;
    `repetition_penalty` (prompt + output tokens) divides positive logits and multiplies negative ones;
    `frequency_penalty` x count and `presence_penalty` (output tokens) are subtracted;
    `structured_outputs` masks every token its grammar forbids (engine/structured.py).
    `prompt_logprobs` is refused: kvserve computes no logits for prompt positions.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.stop is None:
            self.stop = []
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias:
            self.logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}
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
        self._validate_processing()

    def _validate_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: token ids must be >= 0 and biases in [-100, 100], "
                                 f"got {token}: {bias}")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported: kvserve computes no logits for prompt "
                             "positions")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor applies (penalties, bias, min_tokens, a grammar)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.min_tokens or self.logit_bias or self.structured_outputs is not None
        )

    @property
    def num_samples(self) -> int:
        """How many sequences are sampled: best_of if set, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of json (a schema, dict or str), regex, choice,
    grammar (EBNF), or json_object=True (any JSON object)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def validate(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")


@dataclass(slots=True)
class BeamSearchParams:
    """Beam search settings: vLLM's `BeamSearchParams` names (beam_width, max_tokens, ignore_eos,
    temperature, length_penalty, include_stop_str_in_output) plus Hugging Face's `early_stopping` and
    `num_return_sequences`; scored as `generate(num_beams=beam_width, do_sample=False, ...)`.

    `num_return_sequences` (default: beam_width) hypotheses come back, best first. Stops on the
    model's EOS ids or after `max_tokens` generated tokens; no stop strings. Only temperature 0 and
    ignore_eos False are supported (refused otherwise).
    """

    beam_width: int
    max_tokens: int = 16
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
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
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 for beam search (kvserve's beams are deterministic), "
                             f"got {self.temperature}")
        if self.ignore_eos:
            raise ValueError("ignore_eos is not supported for beam search")
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
