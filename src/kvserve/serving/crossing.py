"""Handing results from the engine thread to asyncio callers: snapshots of outputs the engine keeps
mutating, batched queue puts on a caller's event loop, futures settled once (AsyncEngine's plumbing)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from kvserve.engine.request import RequestOutput


def snapshot(output: RequestOutput) -> RequestOutput:
    """A copy safe to read on another thread: the engine keeps appending to logprobs and metrics."""
    logprobs = list(output.logprobs) if output.logprobs is not None else None
    return dataclasses.replace(output, logprobs=logprobs, metrics=dataclasses.replace(output.metrics))


def put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # that event loop is closed: its callers are gone


def settle(future: Future | None, result: object = None, error: BaseException | None = None) -> None:
    if future is None or future.done():
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass  # cancelled by its caller in the meantime
