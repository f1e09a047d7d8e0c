"""A stream's first bytes wait for the engine's first output (server/generation.py `sse_stream`), as
vLLM's do: a router takes a stream's first bytes as "the prompt is computed" (its pending-prefill
count, the worker's prefill speed, cache_aware's record of what a shared store holds). Chat's role chunk
sent at once made every chat stream look prefilled the moment it was accepted."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pydantic import BaseModel

from kvserve.engine.request import CompletionOutput
from kvserve.server.generation import StreamFormat, sse_stream
from kvserve.server.responses import ResponseContext


class Event(BaseModel):
    kind: str


class HeldGroup:
    """One output, released by the test."""

    request_ids = ["r0"]

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.sent = False

    def __aiter__(self) -> HeldGroup:
        return self

    async def __anext__(self):
        if self.sent:
            raise StopAsyncIteration
        await self.release.wait()
        self.sent = True
        return 0, SimpleNamespace(completions=[CompletionOutput(0, "hi", [7], "length")], finished=True,
                                  finish_reason="length")

    def abort(self) -> int:
        return 0


class Metrics:
    def observe_output(self, output) -> None:
        pass

    def observe_aborted(self, num_aborted: int, request_ids) -> None:
        pass


def test_the_role_chunk_waits_for_the_first_output():
    async def scenario() -> list[str]:
        group = HeldGroup()
        ctx = ResponseContext("chatcmpl-1", "m", 1, [3], token_texts=None)
        fmt = StreamFormat(first_chunks=lambda _: [Event(kind="role")], chunk=lambda *_: Event(kind="token"),
                           usage_chunk=None)
        events = sse_stream(group, ctx, fmt, Metrics())
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done(), "a byte went out before the prompt was computed"
        group.release.set()
        received = [await first]
        received += [event async for event in events]
        return received

    received = asyncio.run(scenario())
    assert received[0] == 'data: {"kind":"role"}\n\n' and received[1] == 'data: {"kind":"token"}\n\n'
    assert received[-1].startswith("data: [DONE]")
