"""SamplingParams and BeamSearchParams: how one request picks its tokens and when it stops.

Every numeric field is bounded here, so no value a caller can send reaches the sampler or the beam
scorer as NaN, infinity or an int that overflows a tensor: a bad value is a ValueError naming its field
(the server answers 400 with that field as `param`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Bounds (shared with the server's request models, so both refuse the same values).
MAX_TOKENS_LIMIT = 2**31 - 1  # an int32 (contexts are far smaller; the engine checks the real limit)
MAX_TEMPERATURE = 100.0  # beyond this the distribution is uniform in float32 anyway
GREEDY_TEMPERATURE = 1e-5  # below this, sample greedily (as vLLM's _SAMPLING_EPS)
GREEDY_TOP_P = 1e-7  # below this only the most likely token survives top-p (vocabularies < 10M)
MAX_TOP_K = 2**31 - 1
MAX_LOGPROBS = 20
MAX_NUM_SAMPLES = 256  # n, best_of (and beam_width): each is a sequence holding KV blocks
MAX_LENGTH_PENALTY = 10.0  # |length_penalty| of beam search; HF's useful range is about -2 to 2
MAX_STOP_STRINGS = 64
MAX_REPETITION_PENALTY = 100.0
MAX_STOP_STRING_CHARS = 1024
SEED_RANGE = (-(2**63), 2**64)


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's names and meanings).

    temperature 0 (or below 1e-5) means greedy. top_k -1 (or 0) disables top-k; top_p 1 and min_p 0
    disable theirs; a top_p below 1e-7 keeps only the most likely token, i.e. greedy.
    A request with a `seed` draws the same tokens whatever else shares its batch.

    `n` > 1 or `best_of` > 1 asks for several completions of one prompt (parallel sampling): the prompt
    is prefilled once and its blocks are shared; sample i draws from seed `(seed + i) % 2**63`.
    `best_of` (default n) samples are drawn and the n with the highest cumulative log-probability kept.

    Logits processing, in vLLM's order, on every row (greedy too) before temperature and the filters:
    `min_tokens` masks EOS and `stop_token_ids` until that many tokens exist; `logit_bias` is added;
    `repetition_penalty` (prompt + output tokens) divides positive logits and multiplies negative ones;
    `frequency_penalty` x count and `presence_penalty` (output tokens) are subtracted;
    `structured_outputs` masks every token its grammar forbids (engine/structured.py). Before all of these,
    as vLLM: `allowed_token_ids` keeps only those tokens; `bad_words` (strings, each tokenized alone and
    after a space, as vLLM does) bans a word's last token wherever the output already ends with the tokens
    before it.
    `truncate_prompt_tokens` keeps only the prompt's last N tokens (-1: the last max_model_len), vLLM's left
    truncation, applied before the prompt is checked against the context.
    `prompt_logprobs` (0..20): the log-prob of every prompt token after the first given the tokens before it,
    plus the top N alternatives (vLLM's meaning). Those positions need logits, so such a request reuses
    no cached prefix: its whole prompt is computed (and cached for others).
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
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # bad_words as token ids, one list per variant: set by the engine from its tokenizer (validation.py)
    bad_words_token_ids: list[list[int]] | None = None

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
        check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if not is_int(self.top_k) or not (self.top_k == -1 or 0 <= self.top_k <= MAX_TOP_K):
            raise ValueError(f"top_k must be -1 (disabled) or an integer from 0 to {MAX_TOP_K}, got {self.top_k!r}")
        check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            check_int("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1] - 1)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self._validate_stops()
        check_int("n", self.n, 1, MAX_NUM_SAMPLES)
        if self.best_of is not None and (not is_int(self.best_of) or not self.n <= self.best_of <= MAX_NUM_SAMPLES):
            raise ValueError(f"best_of must be an integer from n ({self.n}) to {MAX_NUM_SAMPLES}, got {self.best_of!r}")
        self._validate_processing()

    def _validate_stops(self) -> None:
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must be a list of at most {MAX_STOP_STRINGS} strings")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if any(not is_int(t) or not 0 <= t < 2**31 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers below 2**31")

    def _validate_processing(self) -> None:
        check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
        check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        for token, bias in (self.logit_bias or {}).items():
            if token < 0 or not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: token ids must be >= 0 and biases in [-100, 100], "
                                 f"got {token}: {bias}")
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        self._validate_token_filters()

    def _validate_token_filters(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, list) or not allowed
                                    or any(not is_int(t) or not 0 <= t < 2**31 for t in allowed)):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids (integers >= 0)")
        words = self.bad_words
        if words is not None and (not isinstance(words, list) or len(words) > MAX_STOP_STRINGS or any(
                not isinstance(w, str) or not w.strip() or len(w) > MAX_STOP_STRING_CHARS for w in words)):
            raise ValueError(f"bad_words must be a list of at most {MAX_STOP_STRINGS} non-blank strings of at "
                             f"most {MAX_STOP_STRING_CHARS} characters")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (not is_int(truncate) or not (truncate == -1 or 1 <= truncate <= MAX_TOKENS_LIMIT)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (the context length) or an integer from 1 to "
                             f"{MAX_TOKENS_LIMIT}, got {truncate!r}")

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor applies (penalties, bias, min_tokens, a grammar)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.min_tokens or self.logit_bias or self.structured_outputs is not None
            or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)
        )

    @property
    def num_samples(self) -> int:
        """How many sequences are sampled: best_of if set, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        """Greedy when temperature or top_p is so small that only the most likely token can be drawn
        (tiny values would otherwise underflow to 0 in float32 and empty the distribution)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_p < GREEDY_TOP_P or self.top_k == 1


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, low: int, high: int) -> None:
    """ValueError naming `name` unless `value` is an int in [low, high]."""
    if not is_int(value) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}, got {value!r}")


def check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    """ValueError naming `name` unless `value` is a finite number in [low, high] ((low, high] if low_open)."""
    number_ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not number_ok or not (low < value if low_open else low <= value) or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be a finite number in {bracket}{low}, {high}], got {value!r}")


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
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 for beam search (kvserve's beams are deterministic), "
                             f"got {self.temperature}")
        if self.ignore_eos:
            raise ValueError("ignore_eos is not supported for beam search")
        check_int("beam_width", self.beam_width, 1, MAX_NUM_SAMPLES)
        check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        check_float("length_penalty", self.length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
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
