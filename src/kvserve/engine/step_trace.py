"""StepTrace: one JSON line per scheduled step and per finished request, to explain TTFT under load.

A short request's time to first token is the wait before its first scheduled step (the step in flight
when it arrived, plus any steps it sat out) and that step's own duration, which depends on what shared
it (decode rows, prefill tokens). The aggregate TTFT percentiles cannot say which; this trace can
(`benchmarks/soak_trace.py` reads it). The server writes it when KVSERVE_STEP_TRACE names a file; it
costs one small write per step, so it is off by default. Times are `time.monotonic()` (the same clock
as `time.perf_counter()` on Linux, so a client on the same machine can line its times up with them).
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TextIO

if TYPE_CHECKING:
    from kvserve.engine.request import Request


class ScheduledRow(Protocol):  # scheduler.ScheduledRequest (not imported: the scheduler imports this module)
    request: Request
    num_new_tokens: int


class StepTrace:
    """Append-only JSONL trace; `step()` from the scheduler, `__call__(request)` as a finish listener."""

    def __init__(self, path: str | Path) -> None:
        self._file: TextIO = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered: read while it runs
        self._lock = threading.Lock()
        self._last = 0.0  # when the previous step was scheduled: requests first scheduled since are new

    def step(self, scheduled: Sequence[ScheduledRow], num_waiting: int) -> None:
        """One line for the step just scheduled: its prompt rows (chunks, with their tokens: a cached
        prompt's last token is a one-token chunk) and decode rows, the queue, and the requests new in it."""
        now, last = time.monotonic(), self._last
        self._last = now
        chunks = [item for item in scheduled
                  if item.request.num_computed_tokens < item.request.num_prompt_tokens]
        fresh = [item.request.request_id for item in chunks
                 if (item.request.metrics.first_scheduled_time or 0) > last]
        groups = collections.Counter(item.request.group_id for item in scheduled)
        self._write({
            "k": "step", "t": now, "waiting": num_waiting, "decode": len(scheduled) - len(chunks),
            "prefill": sum(item.num_new_tokens for item in chunks), "chunks": len(chunks), "new": fresh,
            "group": max(groups.values(), default=0),  # the most rows one group (n / best_of / beams) has
        })

    def __call__(self, request: Request) -> None:
        metrics = request.metrics
        self._write({
            "k": "req", "id": request.request_id, "arrival": metrics.arrival_time,
            "scheduled": metrics.first_scheduled_time, "first": metrics.first_token_time,
            "finished": metrics.finished_time, "prompt": request.num_prompt_tokens,
            "output": len(request.output_token_ids), "preemptions": request.num_preemptions,
        })

    def _write(self, record: dict) -> None:
        with self._lock:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()
