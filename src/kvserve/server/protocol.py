"""OpenAI wire format: request bodies (validated strictly) and response / stream-chunk models.

Requests are parsed in pydantic strict mode, so a wrong JSON type ("5" for an integer, 1 for a bool)
is a 400 naming the field instead of a silent coercion. Nothing is silently ignored: a field that is
not here is refused with a 400 naming it (request_fields.py says why for OpenAI's and vLLM's fields;
those are accepted at their neutral value). Extensions beyond OpenAI follow vLLM's names: `top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`, `ignore_eos`, `cache_salt`, `best_of` (chat too), `structured_outputs` (and the
older `guided_*`), `allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`, `return_token_ids`,
`return_tokens_as_token_ids`, chat-template fields on chat, and on /v1/completions beam search:
`use_beam_search`, `beam_width`, `length_penalty`, `early_stopping`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.engine.params import (
    MAX_LENGTH_PENALTY,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    MAX_TOP_K,
    SEED_RANGE,
)
from kvserve.server import request_fields
from kvserve.server.constraints import ResponseFormat, StructuredOutputsField, Tool, ToolChoice

# n, best_of and beam_width: each sample / beam is a sequence holding KV blocks, so this bounds one
# caller's share (the prompt itself is prefilled once and shared).
MAX_N = 16
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
CLIENT_ID_PATTERN = r"^[A-Za-z0-9._:@/+=-]+$"  # a caller's request id: no spaces, quotes or control characters

# --- requests ----------------------------------------------------------------------------------------


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls, passed to the template
    tool_call_id: str | None = None  # a tool message's answer to that call

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template sees it."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        for name in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        return message

    def text(self) -> str:
        """The content as one string (text parts joined; no content is empty text)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class RefusingModel(StrictModel):
    """A request body with a table of refused fields (request_fields.py): at their neutral value they are
    dropped before validation, any other value fails as an unknown field, a 400 saying why."""

    refused: ClassVar[dict[str, request_fields.Refused]] = {}

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral_refused(cls, data: Any) -> Any:
        """Refused fields at their neutral value mean nothing: drop them; others fail as unknown fields."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if not (k in cls.refused and request_fields.refused_value(cls.refused, k, v) is None)}
        return data


class SamplingFields(RefusingModel):
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
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI) -> bias in [-100, 100]
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None  # accepted: identifies the end user to OpenAI; kvserve keeps no record
    # OpenAI's cache-routing hint: `kvserve router` keeps requests with one key on one worker (router/affinity.py);
    # a single server's prefix cache needs none (it matches prefixes by content)
    prompt_cache_key: str | None = Field(None, max_length=1024)
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)  # vLLM's: lower first, with --schedule-policy priority
    # vLLM's: the response's id (after "chatcmpl-" / "cmpl-"); the X-Request-Id header wins, as in vLLM
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=CLIENT_ID_PATTERN)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: each prompt token's, top N
    allowed_token_ids: list[int] | None = Field(None, min_length=1)  # vLLM's: only these may be sampled
    bad_words: list[str] | None = None  # vLLM's: never generated (each word's last token banned in context)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_TOKENS_LIMIT)  # vLLM's: keep the last N
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids in the response
    return_tokens_as_token_ids: bool = False  # vLLM's: log-prob tokens written as "token_id:N"

    refused: ClassVar[dict[str, request_fields.Refused]] = request_fields.COMMON

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    refused: ClassVar[dict[str, request_fields.Refused]] = request_fields.CHAT

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)  # 0: with echo, score the prompt only
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt comes back before the completion (with its log-probs when logprobs is set)
    # vLLM's: text prompts with the tokenizer's own special tokens (a BOS where it adds one). kvserve's default
    # is False (vLLM's True): the same for tokenizers that add none, as the default model's
    add_special_tokens: bool = False
    use_beam_search: bool = False
    # Beam search (with use_beam_search): the n best of `beam_width` beams come back, best first.
    beam_width: int | None = Field(None, ge=1, le=MAX_N)  # default: n
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY, allow_inf_nan=False)
    early_stopping: bool | Literal["never"] = False

    refused: ClassVar[dict[str, request_fields.Refused]] = request_fields.COMPLETION


# --- responses -----------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    # kvserve extension: where the cached tokens came from (device, host, disk, remote); sums to cached_tokens
    cached_tokens_by_source: dict[str, int] = Field(default_factory=dict)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class PromptLogprob(BaseModel):
    """vLLM's `Logprob` as its server writes prompt_logprobs (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt token; None for the first


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


def _unset(value: object) -> bool:
    return value is None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = Field(None, exclude_if=_unset)  # vLLM's return_token_ids


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=lambda value: value is None)  # vLLM's
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_unset)  # vLLM's return_token_ids


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, exclude_if=lambda value: value is None)  # in a call's first chunk
    arguments: str = ""  # a fragment of the arguments' JSON text


class ToolCallDelta(BaseModel):
    """One streamed piece of a tool call (OpenAI's `ChoiceDeltaToolCall`): `id` and `type` open the call."""

    index: int
    id: str | None = Field(None, exclude_if=lambda value: value is None)
    type: Literal["function"] | None = Field(None, exclude_if=lambda value: value is None)
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=lambda value: value is None)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_unset)  # return_token_ids: this chunk's tokens


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_unset)  # return_token_ids: first chunk only


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing before it)
    top_logprobs: list[dict[str, float] | None]
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
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=lambda value: value is None)
    # vLLM's return_token_ids: the prompt's ids (streamed: in each choice's first chunk) and the generated ones
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_unset)
    token_ids: list[int] | None = Field(None, exclude_if=_unset)


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
