"""BackgroundWriter: puts blocks into a store from its own thread, through a bounded queue.

`offer` never blocks: when the queue is full (the store is slow or down) the blocks are dropped and
counted. A cache may always lose a block; a step must never wait for one. The worker batches what has
queued up into one `put` (one pipelined round trip for Redis).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from kvserve.tiers.store import BlockKey, BlockStore

_STOP = object()
_MAX_BATCH = 64


class BackgroundWriter:
    def __init__(self, store: BlockStore, max_queued_blocks: int = 256) -> None:
        if max_queued_blocks < 1:
            raise ValueError(f"writer queue must hold >= 1 block, got {max_queued_blocks}")
        self.store = store
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queued_blocks)
        self._lock = threading.Lock()
        self.queued = 0
        self.dropped = 0
        self.written = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name=f"kv-writer-{store.name}", daemon=True)
        self._thread.start()

    def has_room(self, num_blocks: int) -> bool:
        """Cheap pre-check so a caller can skip encoding blocks that would be dropped anyway."""
        return self._queue.maxsize - self._queue.qsize() >= num_blocks

    def offer(self, items: Sequence[tuple[BlockKey, bytes]]) -> int:
        """Queue what fits; returns how many blocks were dropped."""
        dropped = 0
        for item in items:
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                dropped += 1
        with self._lock:
            self.queued += len(items) - dropped
            self.dropped += dropped
        return dropped

    def flush(self) -> None:
        """Wait until every queued block has been handed to the store (tests, shutdown)."""
        self._queue.join()

    def close(self, timeout_s: float = 5.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"queued": self.queued, "dropped": self.dropped, "written": self.written, "failed": self.failed,
                    "queue_depth": self._queue.qsize()}

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            batch, stop = [], first is _STOP
            if not stop:
                batch.append(first)
            while not stop and len(batch) < _MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                stop = item is _STOP
                if not stop:
                    batch.append(item)
            try:
                if batch:
                    self.store.put(batch)  # stores count their own I/O errors
                    with self._lock:
                        self.written += len(batch)
            except Exception:  # noqa: BLE001 - a dead writer thread would silently stop the tier
                with self._lock:
                    self.failed += len(batch)
            finally:
                for _ in range(len(batch) + (1 if stop else 0)):
                    self._queue.task_done()
            if stop:
                return
