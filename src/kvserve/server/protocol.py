"""OpenAI wire format: request bodies (validated strictly) and response / stream-chunk models.

Requests are parsed in pydantic strict mode, so a wrong JSON type ("5" for an integer, 1 for a bool)
is a 400 naming the field instead of a silent coercion. Unknown fields are ignored, as OpenAI
clients send extras (`user`, `metadata`, ...). Extensions beyond OpenAI follow vLLM's names:
`top_k`, `min_p`, `ignore_eos`, `cache_salt`, `best_of` (chat too), and on /v1/completions beam search:
`use_beam_search`, `beam_width`, `length_penalty`, `early_stopping`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.engine.params import (
    MAX_LENGTH_PENALTY,
    MAX_LOGPROBS,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    MAX_TOP_K,
    SEED_RANGE,
)

# n, best_of and beam_width: each sample / beam is a sequence holding KV blocks, so this bounds one
# caller's share (the prompt itself is prefilled once and shared).
MAX_N = 16
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range; only 0 is supported)

# --- requests ----------------------------------------------------------------------------------------


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool = False


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined; no content is empty text)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(StrictModel):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # samples drawn; the n most likely are returned
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    use_beam_search: bool = False  # kvserve extension; only /v1/completions runs it (chat: 400)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    # Beam search (with use_beam_search): the n best of `beam_width` beams come back, best first.
    beam_width: int | None = Field(None, ge=1, le=MAX_N)  # default: n
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY, allow_inf_nan=False)
    early_stopping: bool | Literal["never"] = False


# --- responses -----------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class BeamInfo(BaseModel):
    """`kvserve` extension of a beam-search choice: its hypothesis' tokens and scores."""

    score: float  # cumulative_logprob / len(token_ids) ** length_penalty (what beams are ranked by)
    cumulative_logprob: float
    token_ids: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    kvserve: BeamInfo | None = Field(None, exclude_if=lambda value: value is None)  # beam search only


class Completion(BaseModel):
    """A text completion; also the shape of each streamed chunk (with `usage` None)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    max_model_len: int
    root: str | None = None  # vLLM's: a LoRA adapter's path (None for the base model)
    parent: str | None = None  # vLLM's: a LoRA adapter's base model (None for the base model)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
