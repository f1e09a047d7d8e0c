"""`every(interval, job)`: run a small job every `interval` seconds while an async context is open.

The server's lifespan keeps a few of these (the stats line, the heap trim); one helper so each is a
function, not another hand-written task/cancel loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable


@contextlib.asynccontextmanager
async def every(interval: float, job: Callable[[], object], in_thread: bool = False) -> AsyncIterator[None]:
    """Call `job()` every `interval` seconds (0 or less: never); `in_thread`: on a worker thread, for jobs
    that may block (they must not take the event loop's time)."""
    if interval <= 0:
        yield
        return

    async def loop() -> None:
        while True:
            await asyncio.sleep(interval)
            if in_thread:
                running = asyncio.ensure_future(asyncio.to_thread(job))
                try:
                    await asyncio.shield(running)
                except asyncio.CancelledError:
                    await running  # a thread cannot be interrupted: the context closes once its job returned
                    raise
            else:
                job()

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
