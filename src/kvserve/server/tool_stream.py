"""Streaming tool calls: chat with `tools` and `stream: true`, in OpenAI's chunk shape.

Agent frameworks stream by default, so a server that answers tool calls only whole breaks them. Each
choice's text becomes deltas by the same rules the whole answer follows (responses._assistant_message):

- a named function: the output is the call's arguments (constrained JSON). The first chunk opens the call
  (index 0, id, type, name) and every delta's text is an `arguments` fragment, as OpenAI streams them.
- "required": the output is a JSON array of calls, held until it ends, then every call in one chunk.
- "auto": content streams as it comes, except what could begin a call: a tail that may be the start of
  `<tool_call>` (held until it cannot), everything from `<tool_call>` on, a reply whose first non-space
  character is `{` (a bare JSON call, Llama 3.1 style), and trailing whitespace (the whole answer strips
  the content beside calls). At the end the whole text is parsed as the whole answer would be: its calls
  in one chunk, the rest of its content (the text less its call blocks) as content. The streamed content
  equals the whole answer's, but for a reply's leading whitespace when calls follow.

A choice that ends other than by a stop (max_tokens) has no calls: what was held comes as content, with
its finish_reason, as the whole answer does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.request import CompletionOutput
from kvserve.server.constraints import (
    TOOL_CALL_OPEN,
    NamedToolChoice,
    ToolChoice,
    new_call_id,
    parse_auto_tool_calls,
    tool_calls_from_text,
    without_tool_call_blocks,
)
from kvserve.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    FunctionCallDelta,
    ToolCallDelta,
)
from kvserve.server.responses import ResponseContext, chat_logprobs, delta_logprobs


@dataclass(slots=True)
class _ChoiceState:
    sent: int = 0  # characters of the text already streamed (or deliberately passed over)
    holding: bool = False  # auto: the rest may be a call; held until the end
    opened: bool = False  # named: the call's first chunk went out


@dataclass(slots=True)
class ToolCallStreams:
    """The chat stream's `chunk` function when tools may be called (one state per choice)."""

    tool_choice: ToolChoice
    logprobs: bool
    _states: dict[int, _ChoiceState] = field(default_factory=dict)

    def chunk(self, ctx: ResponseContext, index: int, completion: CompletionOutput) -> ChatCompletionChunk | None:
        state = self._states.setdefault(index, _ChoiceState())
        if isinstance(self.tool_choice, NamedToolChoice):
            delta, finish = self._named(state, completion)
        elif self.tool_choice == "required":
            delta, finish = self._required(completion)
        else:
            delta, finish = self._auto(state, completion)
        entries = delta_logprobs(completion) if self.logprobs else []
        token_ids = ctx.token_ids(completion, delta=True)
        if delta is None and not entries and not token_ids and finish is None:
            return None
        choice = ChatChunkChoice(index=index, delta=delta or ChatDelta(content=""), finish_reason=finish,
                                 logprobs=chat_logprobs(entries, ctx.logprob_texts) if self.logprobs else None,
                                 token_ids=token_ids)
        return ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model, choices=[choice])

    def _named(self, state: _ChoiceState, c: CompletionOutput) -> tuple[ChatDelta | None, str | None]:
        finish = c.finish_reason
        if finish == "stop" and tool_calls_from_text(c.text, self.tool_choice) is not None:
            finish = "tool_calls"
        if not c.delta_text and state.opened:
            return None, finish
        opening = not state.opened
        state.opened = True
        call = ToolCallDelta(index=0, id=new_call_id() if opening else None, type="function" if opening else None,
                             function=FunctionCallDelta(name=self.tool_choice.function.name if opening else None,
                                                        arguments=c.delta_text))
        return ChatDelta(tool_calls=[call]), finish

    def _required(self, c: CompletionOutput) -> tuple[ChatDelta | None, str | None]:
        if c.finish_reason is None:
            return None, None
        calls = tool_calls_from_text(c.text, self.tool_choice) if c.finish_reason == "stop" else None
        if not calls:
            return ChatDelta(content=c.text), c.finish_reason
        return ChatDelta(tool_calls=_deltas(calls)), "tool_calls"

    def _auto(self, state: _ChoiceState, c: CompletionOutput) -> tuple[ChatDelta | None, str | None]:
        text = c.text
        if c.finish_reason is not None:
            return self._auto_end(state, c)
        if state.holding:
            return None, None
        if state.sent == 0 and text.lstrip().startswith("{"):
            state.holding = True
            return None, None
        marker = text.find(TOOL_CALL_OPEN, state.sent)
        end = marker if marker >= 0 else len(text) - _partial_marker(text)
        state.holding = marker >= 0
        while end > state.sent and text[end - 1].isspace():
            end -= 1
        if end <= state.sent:
            return None, None
        delta = ChatDelta(content=text[state.sent:end])
        state.sent = end
        return delta, None

    def _auto_end(self, state: _ChoiceState, c: CompletionOutput) -> tuple[ChatDelta | None, str | None]:
        content, calls = parse_auto_tool_calls(c.text) if c.finish_reason == "stop" else (c.text, None)
        rest = c.text[state.sent:]
        if not calls:
            return (ChatDelta(content=rest) if rest else None), c.finish_reason
        # The whole answer's content is the text less its blocks, stripped; what streamed is its start
        # (never ending in whitespace; a reply's leading whitespace may have gone out with it).
        streamed = c.text[:state.sent].lstrip()
        rest = without_tool_call_blocks(c.text)[len(streamed):] if content is not None else ""
        return ChatDelta(content=rest or None, tool_calls=_deltas(calls)), "tool_calls"


def _partial_marker(text: str) -> int:
    """The length of the longest tail of `text` that `<tool_call>` starts with (held: it may become one)."""
    for size in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0


def _deltas(calls: list[dict[str, Any]]) -> list[ToolCallDelta]:
    """Whole calls (constraints' OpenAI dicts) as one chunk's deltas, each with its index."""
    return [ToolCallDelta(index=i, id=call["id"], type="function",
                          function=FunctionCallDelta(name=call["function"]["name"],
                                                     arguments=call["function"]["arguments"]))
            for i, call in enumerate(calls)]
