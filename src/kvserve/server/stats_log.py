"""The periodic stats line vLLM prints: throughput, running/waiting, KV usage, prefix-cache hit rate.

    kvserve: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 55.1 tokens/s,
    Running: 12 reqs, Waiting: 3 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 78.9%

Logged at INFO every `interval` seconds while there is traffic (this interval or the last), at DEBUG
when idle so an idle server's log stays quiet -- as vLLM's `LoggingStatLogger`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvserve.server.metrics import Stats, TokenTotals
from kvserve.server.periodic import every

LOG_FORMAT = ("kvserve: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
              "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%")


@dataclass(slots=True)
class StatsLogger:
    """Turns token totals and engine stats into one log line per interval."""

    totals: TokenTotals
    stats: Callable[[], Stats]
    logger: logging.Logger
    _last_time: float = 0.0
    _last_prompt: int = 0
    _last_generation: int = 0
    _was_busy: bool = False

    def __post_init__(self) -> None:
        self._last_time = time.monotonic()

    def log(self, now: float | None = None) -> tuple[float, float]:
        """Log the line for the interval since the last call; returns (prompt, generation) tokens/s."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._last_time, 1e-9)
        prompt_rate = (self.totals.prompt_tokens - self._last_prompt) / elapsed
        generation_rate = (self.totals.generation_tokens - self._last_generation) / elapsed
        self._last_time, self._last_prompt = now, self.totals.prompt_tokens
        self._last_generation = self.totals.generation_tokens
        busy = bool(prompt_rate or generation_rate)
        level = logging.INFO if busy or self._was_busy else logging.DEBUG
        self._was_busy = busy
        stats = self.stats()
        self.logger.log(level, LOG_FORMAT, prompt_rate, generation_rate, stats["num_running"],
                        stats["num_waiting"], 100 * stats["kv_cache_usage"],
                        100 * stats["prefix_cache_hit_rate"])
        return prompt_rate, generation_rate


@contextlib.asynccontextmanager
async def periodic_stats(stats_logger: StatsLogger, interval: float) -> AsyncIterator[None]:
    """Run `stats_logger.log()` every `interval` seconds while the context is open (0: never)."""
    async with every(interval, stats_logger.log):
        yield
