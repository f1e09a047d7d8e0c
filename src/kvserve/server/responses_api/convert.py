"""A Responses request as the chat request kvserve already serves, and the chat answer as output items.

The conversation is `instructions` (a system message; as OpenAI, an earlier response's instructions are
not carried over), then the stored history of `previous_response_id` (its input and output items, as chat
messages), then this request's input. Function-call items become an assistant message's `tool_calls`,
their outputs `tool` messages: what the chat template renders for the chat endpoint, so a conversation
continued here puts the same tokens in front of the model, and the prefix cache finds the last turn.
"""

from __future__ import annotations

from typing import Any

from kvserve.server.protocol import AssistantMessage, ChatCompletion, ChatCompletionRequest, Usage
from kvserve.server.responses_api.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    Response,
    ResponsesRequest,
    ResponseUsage,
    new_id,
)

ChatDict = dict[str, Any]  # one chat message as ChatMessage accepts it


def input_messages(body: ResponsesRequest) -> list[ChatDict]:
    """The request's input items as chat messages (consecutive function calls share one assistant turn)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[ChatDict] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            assert isinstance(item, FunctionCallOutputItem)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def chat_request(body: ResponsesRequest, history: list[ChatDict], max_tokens: int | None) -> ChatCompletionRequest:
    """The chat request that generates this response (ValidationError: a 400, as any body's)."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    fields: dict[str, Any] = {
        "model": body.model, "messages": system + history + input_messages(body), "max_tokens": max_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
        "cache_salt": body.cache_salt, "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                          "function": {"name": choice.name}}
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type != "text":
        fields["response_format"] = _response_format(text_format)
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


def _response_format(text_format: Any) -> dict[str, Any]:
    if text_format.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": text_format.name or "response", "schema": text_format.schema_,
              "description": text_format.description, "strict": text_format.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def output_items(message: AssistantMessage, finished: bool, message_id: str | None = None) -> list[dict[str, Any]]:
    """The assistant's answer as output items: its text as one message (always, when a stream announced it
    as `message_id`), each tool call as a function_call."""
    items: list[dict[str, Any]] = []
    if message.content or message_id is not None:
        items.append(message_item(message_id or new_id("msg"), message.content or "",
                                  "completed" if finished else "incomplete"))
    for call in message.tool_calls:
        items.append({"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.function.name,
                      "arguments": call.function.arguments, "status": "completed"})
    return items


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def output_messages(items: list[dict[str, Any]]) -> list[ChatDict]:
    """Output items as the chat messages the next turn's history holds."""
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    message: ChatDict = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def usage_of(usage: Usage) -> ResponseUsage:
    return ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens))


def response_of(body: ResponsesRequest, response_id: str, created: int, chat: ChatCompletion,
                message_id: str | None = None) -> Response:
    """The finished response: chat's one choice as output items, its finish reason as the status."""
    choice = chat.choices[0]
    incomplete = choice.finish_reason == "length"
    return Response(
        id=response_id, created_at=created, status="incomplete" if incomplete else "completed", model=body.model,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        output=output_items(choice.message, not incomplete, message_id), usage=usage_of(chat.usage), **echoed(body))


def echoed(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings that a Response repeats."""
    choice = body.tool_choice
    return {
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id, "store": body.store, "temperature": body.temperature,
        "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls, "user": body.user,
        "metadata": body.metadata or {},
        "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice is not None
        else ("auto" if body.tools else "none"),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
        if body.text is not None and body.text.format is not None else {"format": {"type": "text"}},
    }
