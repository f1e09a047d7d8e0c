"""The Responses API's wire format: the request (validated strictly, as protocol.py's) and the response.

Input is a string or a list of items: messages (`role` + text content, OpenAI's "easy" form or
`type: "message"`), `function_call` items (the model's earlier calls) and `function_call_output` items
(their results). Tools are OpenAI's flat function tools. Extensions follow vLLM's names: `cache_salt`,
`seed`, `top_k`. Fields not here are refused with a 400 naming them; request_fields.RESPONSES says why for
OpenAI's others (`reasoning`, `include`, `background`, `truncation`, ...), which are accepted at their
neutral values only.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.engine.params import MAX_TEMPERATURE, MAX_TOKENS_LIMIT, MAX_TOP_K, SEED_RANGE
from kvserve.server import request_fields
from kvserve.server.protocol import RefusingModel


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier output_text part, sent back as it came
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the neutral value only: kvserve does not steer length


class ResponsesRequest(RefusingModel):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    prompt_cache_key: str | None = Field(None, max_length=1024)  # a routing hint (server/protocol.py)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    cache_salt: str | None = None

    refused: ClassVar[dict[str, request_fields.Refused]] = request_fields.RESPONSES

    @model_validator(mode="after")
    def _input_not_empty(self) -> ResponsesRequest:
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ValueError("input: must not be empty")
        return self


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    """OpenAI's `Response` object (what the official client parses), as stored and returned."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
