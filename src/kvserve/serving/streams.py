"""What an asyncio caller of the engine thread holds: a group's output stream, and its two errors.

`RequestGroup` iterates the outputs of the requests submitted together; a member that failed inside
the engine arrives as `RequestFailedError` (the others stay open, so leaving the group aborts them);
`EngineDeadError` ends every stream when the engine thread stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvserve.engine.request import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (it crashed, or the engine is shutting down)."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (it was aborted; everyone else goes on). The message is
    generic and names the request id; the details are in the engine's log. `request_fault`: the request
    caused it (its message says how: the caller gets a 400 with it)."""

    def __init__(self, message: str, request_id: str, request_fault: bool = False) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.request_fault = request_fault


class RequestGroup:
    """Async iterator of `(index, RequestOutput)` for a group of requests submitted together.

    Outputs of all members arrive in one queue in engine order; iteration ends when every member
    finished. Leaving the group early (`abort()`, or `async with` exit) aborts unfinished members.
    """

    def __init__(self, abort: Callable[[list[str]], None], request_ids: list[str], queue: asyncio.Queue) -> None:
        self._abort = abort  # the engine's abort: non-blocking
        self.request_ids = request_ids
        self._queue = queue
        self._open = set(range(len(request_ids)))

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._open:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, RequestFailedError):
            # Only that member ended: the others stay open, so leaving the group aborts them.
            self._open.discard(self.request_ids.index(item.request_id))
            raise item
        if isinstance(item, BaseException):
            self._open.clear()
            raise item
        index, output = item
        if output.finished:
            self._open.discard(index)
        return index, output

    @property
    def finished(self) -> bool:
        return not self._open

    def abort(self) -> int:
        """Abort every member that has not finished (idempotent, non-blocking); returns how many."""
        num_open = len(self._open)
        if num_open:
            self._abort([self.request_ids[i] for i in sorted(self._open)])
            self._open.clear()
        return num_open

    async def __aenter__(self) -> RequestGroup:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()
