"""Constrained output over HTTP: `response_format`, vLLM's `structured_outputs`, and tool calls.

Each becomes one `StructuredOutputsParams` for the engine (engine/structured.py masks the tokens):
- `response_format` `json_object` -> any JSON object; `json_schema` -> that schema (always enforced,
  strict or not: an unenforced schema would be a silent ignore);
- `structured_outputs` {json | regex | choice | grammar | json_object} (and vLLM's older `guided_json`,
  `guided_regex`, `guided_choice`, `guided_grammar`) -> itself;
- `tool_choice` "required" -> a JSON array of one or more calls `{"name", "arguments"}` of the given tools
  (one call when `parallel_tool_calls` is false); a named function -> that function's arguments object.
  The output is returned as OpenAI `tool_calls`, `finish_reason` "tool_calls" (streamed: tool_stream.py).
- `tools` with `tool_choice` "auto" (the default when tools are given) need a chat template that renders
  tools (else a 400 saying so); the tools are rendered into the prompt, generation is free, and calls
  written as Hermes-style `<tool_call>{json}</tool_call>` blocks or as one bare JSON object
  `{"name", "arguments" | "parameters"}` (Llama 3.1 style) are returned as `tool_calls`, other text as
  content. "none" renders the tools (when the template can) and generates text.
At most one constraint per request: two are a 400 naming the second.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.engine.params import StructuredOutputsParams


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class JsonSchemaFormat(_Strict):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs` extra field."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ConstraintError(ValueError):
    """A constraint that cannot be honoured; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def from_response_format(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ConstraintError("response_format json_schema needs json_schema.schema", "response_format")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


def from_structured_field(field: StructuredOutputsField | None) -> StructuredOutputsParams | None:
    if field is None:
        return None
    params = StructuredOutputsParams(json=field.json_, regex=field.regex, choice=field.choice,
                                     grammar=field.grammar, json_object=field.json_object)
    try:
        params.validate()
    except ValueError as error:
        raise ConstraintError(str(error), "structured_outputs") from None
    return params


def from_guided(guided: dict[str, Any]) -> StructuredOutputsParams | None:
    """vLLM's older names: guided_json / guided_regex / guided_choice / guided_grammar."""
    given = {name: value for name, value in guided.items() if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ConstraintError(f"only one of {sorted(given)} may be given", sorted(given)[1])
    (name, value), = given.items()
    return StructuredOutputsParams(**{name.removeprefix("guided_"): value})


def tool_call_schema(tools: list[Tool], choice: ToolChoice, parallel: bool) -> dict[str, Any] | None:
    """The JSON schema a forced tool call must match, or None when the choice forces nothing."""
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise ConstraintError(f"tool_choice names {choice.function.name!r}, which is not in tools",
                                  "tool_choice")
        return _parameters(named[0])
    if choice != "required":
        return None
    call = {"anyOf": [
        {"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
         "required": ["name", "arguments"]}
        for t in tools
    ]}
    return {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_calls_from_text(text: str, choice: ToolChoice) -> list[dict[str, Any]] | None:
    """OpenAI `tool_calls` from a constrained output, or None if the output is not complete JSON
    (cut by max_tokens): the caller then returns the text with finish_reason "length"."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(choice, NamedToolChoice):
        calls = [{"name": choice.function.name, "arguments": value}]
    else:
        calls = value
    return [_openai_call(call) for call in calls]


TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_auto_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool_calls) of a free-running output under tool_choice "auto"."""
    blocks = _TOOL_CALL.findall(text)
    candidates = blocks if blocks else [text.strip()]
    calls = []
    for block in candidates:
        try:
            value = json.loads(block)
        except json.JSONDecodeError:
            return text, None
        arguments = value.get("arguments", value.get("parameters")) if isinstance(value, dict) else None
        if not isinstance(value.get("name") if isinstance(value, dict) else None, str) or arguments is None:
            return text, None
        calls.append({"name": value["name"], "arguments": arguments})
    content = _TOOL_CALL.sub("", text).strip() or None if blocks else None
    return content, [_openai_call(call) for call in calls]


def without_tool_call_blocks(text: str) -> str:
    """`text` less its `<tool_call>` blocks, stripped (the content beside auto tool calls)."""
    return _TOOL_CALL.sub("", text).strip()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _openai_call(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["arguments"]
    return {"id": new_call_id(), "type": "function",
            "function": {"name": call["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders a `tools` variable (vLLM's test is the same: it names it)."""
    return bool(chat_template) and "tools" in chat_template


def structured_of(body: Any, template: str | None) -> StructuredOutputsParams | None:
    """The one constraint of a request (a chat or completion body; `template`: its chat template).

    Raises ConstraintError naming the field when two are given or one cannot be honoured."""
    guided = {n: getattr(body, n) for n in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")}
    guided_name = next((name for name, value in guided.items() if value is not None), "guided_json")
    sources = [
        ("response_format", from_response_format(body.response_format)),
        ("structured_outputs", from_structured_field(body.structured_outputs)),
        (guided_name, from_guided(guided)),
        ("tool_choice", _from_tools(body, template)),
    ]
    given = [(name, params) for name, params in sources if params is not None]
    if len(given) > 1:
        raise ConstraintError(f"{given[1][0]} cannot be combined with {given[0][0]}: one output constraint "
                              "per request", given[1][0])
    return given[0][1] if given else None


def effective_tool_choice(body: Any) -> ToolChoice | None:
    """OpenAI's default: "auto" when tools are given, else "none"; None for a text completion."""
    tools = getattr(body, "tools", None)
    choice = getattr(body, "tool_choice", None)
    if choice is None:
        return "auto" if tools else None
    return choice


def _from_tools(body: Any, template: str | None) -> StructuredOutputsParams | None:
    tools = getattr(body, "tools", None) or []
    choice = effective_tool_choice(body)
    if choice in (None, "none"):
        return None
    if not tools:
        raise ConstraintError("tool_choice needs tools", "tool_choice")
    if choice == "auto":
        if not template_supports_tools(template):
            raise ConstraintError("tools with tool_choice 'auto' need a chat template that renders tools, "
                                  "and this model's does not; use tool_choice 'required' or a named function",
                                  "tools")
        return None
    schema = tool_call_schema(tools, choice, body.parallel_tool_calls)
    return StructuredOutputsParams(json=schema)
