"""Live updates: one sampler per server feeds every open dashboard at about 1 Hz (server-sent events).

While at least one page is subscribed, the sampler takes one snapshot per tick on the engine thread
(whatever the number of open pages), renders it once per distinct viewer off the engine thread, and adds
a point to the time series. With no page open it stops, so a closed dashboard costs nothing. A slow
page never queues: each subscriber holds only the newest event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvserve.server.auth import Principal
from kvserve.server.dashboard.series import Series
from kvserve.server.dashboard.snapshot import RawSnapshot, Renderer, capture
from kvserve.serving.async_engine import AsyncEngine, EngineDeadError

logger = logging.getLogger(__name__)
TICK_S = 1.0


@dataclass(slots=True, eq=False)
class _Subscriber:
    viewer: Principal
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(maxsize=1))


class LiveHub:
    """Snapshots for open pages; `events(viewer)` is one page's SSE stream."""

    def __init__(self, engine: AsyncEngine, renderer: Renderer, series: Series, tick_s: float = TICK_S) -> None:
        self._engine = engine
        self._renderer = renderer
        self.series = series
        self._tick_s = tick_s
        self._subscribers: set[_Subscriber] = set()
        self._task: asyncio.Task | None = None

    @property
    def engine_alive(self) -> bool:
        return self._engine.is_alive

    async def snapshot(self, viewer: Principal, renderer: Renderer | None = None) -> dict:
        """One snapshot for `viewer` now (the `/v1/cache/snapshot` route); EngineDeadError if stopped."""
        renderer = renderer or self._renderer
        raw = await self._engine.call(lambda engine: capture(engine, renderer.limits))
        return await asyncio.to_thread(self._event, raw, viewer, renderer)

    async def events(self, viewer: Principal) -> AsyncIterator[str]:
        """SSE text: an `event: snapshot` per tick until the client leaves (or `event: error`)."""
        subscriber = _Subscriber(viewer)
        self._subscribers.add(subscriber)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            yield ": kvserve dashboard stream\n\n"
            while True:
                kind, payload = await subscriber.queue.get()
                yield f"event: {kind}\ndata: {payload}\n\n"
                if kind == "error":
                    return
        finally:
            self._subscribers.discard(subscriber)

    async def _run(self) -> None:
        while self._subscribers:
            started = time.monotonic()
            try:
                raw = await self._engine.call(lambda engine: capture(engine, self._renderer.limits))
            except EngineDeadError as err:
                self._publish_all("error", json.dumps({"error": str(err)}))
                return
            self.series.sample(raw.stats, raw.time, raw.running)
            await self._publish(raw)
            await asyncio.sleep(max(0.0, self._tick_s - (time.monotonic() - started)))

    async def _publish(self, raw: RawSnapshot) -> None:
        for viewer in {subscriber.viewer for subscriber in self._subscribers}:
            try:
                payload = await asyncio.to_thread(self._encoded_event, raw, viewer)
            except Exception:  # noqa: BLE001 - a rendering bug must not end the stream of every page
                logger.exception("dashboard: rendering a snapshot failed")
                continue
            for subscriber in list(self._subscribers):
                if subscriber.viewer == viewer:
                    _replace(subscriber.queue, ("snapshot", payload))

    def _publish_all(self, kind: str, payload: str) -> None:
        for subscriber in list(self._subscribers):
            _replace(subscriber.queue, (kind, payload))

    def _event(self, raw: RawSnapshot, viewer: Principal, renderer: Renderer | None = None) -> dict:
        snapshot = (renderer or self._renderer).render(raw, viewer)
        # Time series are server-wide aggregates: admins only, like /metrics.
        snapshot["series"] = self.series.columns() if viewer.is_admin else None
        return snapshot

    def _encoded_event(self, raw: RawSnapshot, viewer: Principal) -> str:
        return json.dumps(self._event(raw, viewer), separators=(",", ":"))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


def _replace(queue: asyncio.Queue, item: object) -> None:
    """Keep only the newest event for a subscriber that has not read the previous one yet."""
    with contextlib.suppress(asyncio.QueueEmpty):
        if queue.full():
            queue.get_nowait()
    queue.put_nowait(item)
