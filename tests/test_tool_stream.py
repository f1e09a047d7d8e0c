"""Streamed tool calls equal the whole answer's, however the text is cut into deltas (server/tool_stream.py
against responses._assistant_message, the non-streamed rule), for every tool_choice that calls tools."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.request import CompletionOutput
from kvserve.server.constraints import NamedToolChoice
from kvserve.server.responses import ResponseContext, TokenTexts, _assistant_message
from kvserve.server.tool_stream import ToolCallStreams

CALL = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
AUTO_TEXTS = [
    f"<tool_call>{CALL}</tool_call>",
    f"Let me check the time. <tool_call>\n{CALL}\n</tool_call>",
    f"First. <tool_call>{CALL}</tool_call> then <tool_call>{CALL}</tool_call> done.",
    f"  {CALL}",  # a bare JSON call
    "A plain answer mentioning <tool and < tags, with no call.",
    "  {not json at all",
    "trailing <tool_call",
    "",
]
NAMED = NamedToolChoice(type="function", function={"name": "get_time"})


def stream(choice, text: str, cuts: list[int], finish: str = "stop"):
    ctx = ResponseContext.new("chatcmpl", "m", 1, [3], TokenTexts(None))
    streams = ToolCallStreams(choice, logprobs=False)
    points = sorted({0, *(c for c in cuts if 0 < c < len(text)), len(text)})
    chunks = []
    for start, end in zip(points, points[1:] + [None], strict=False):
        done = end is None
        piece = "" if done else text[start:end]
        so_far = text if done else text[:end]
        output = CompletionOutput(0, so_far, [], finish if done else None, delta_text=piece)
        chunk = streams.chunk(ctx, 0, output)
        if chunk is not None:
            chunks.append(chunk.choices[0])
    return chunks


def assembled(chunks):
    content = "".join(c.delta.content or "" for c in chunks)
    calls: dict[int, dict] = {}
    for c in chunks:
        for call in c.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            entry["arguments"] += call.function.arguments
            assert call.id is None or entry["id"] == call.id
    finishes = [c.finish_reason for c in chunks if c.finish_reason]
    return content, [calls[i] for i in sorted(calls)], finishes


def whole(choice, text: str, finish: str = "stop"):
    message, reason = _assistant_message(CompletionOutput(0, text, [], finish), choice)
    calls = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in message.tool_calls]
    return message.content, calls, reason


@settings(max_examples=150, deadline=None)
@given(text=st.sampled_from(AUTO_TEXTS), cuts=st.lists(st.integers(0, 120), max_size=12),
       finish=st.sampled_from(["stop", "length"]))
def test_auto_streams_what_the_whole_answer_says(text, cuts, finish):
    content, calls, finishes = assembled(stream("auto", text, cuts, finish))
    want_content, want_calls, want_finish = whole("auto", text, finish)
    assert finishes == [want_finish]
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls] == want_calls
    assert all(c["id"] and c["id"].startswith("call_") for c in calls)
    if want_calls:
        assert content.lstrip() == (want_content or "")
    else:
        assert content == want_content


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 40), max_size=10), parallel=st.booleans())
def test_required_and_named_stream_the_calls_they_return_whole(cuts, parallel):
    array = json.dumps([json.loads(CALL)] * (2 if parallel else 1))
    content, calls, finishes = assembled(stream("required", array, cuts))
    assert (content, finishes) == ("", ["tool_calls"])
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls] == whole("required", array)[1]
    arguments = '{"zone": "CET"}'
    chunks = stream(NAMED, arguments, cuts)
    content, calls, finishes = assembled(chunks)
    assert chunks[0].delta.tool_calls[0].id and chunks[0].delta.tool_calls[0].function.name == "get_time"
    assert all(call.id is None for c in chunks[1:] for call in c.delta.tool_calls or [])
    assert calls == [{"id": calls[0]["id"], "name": "get_time", "arguments": arguments}] and finishes == ["tool_calls"]


def test_a_call_cut_by_max_tokens_streams_as_content():
    cut = json.dumps([json.loads(CALL)])[:20]
    content, calls, finishes = assembled(stream("required", cut, [5, 9], finish="length"))
    assert (content, calls, finishes) == (cut, [], ["length"])
