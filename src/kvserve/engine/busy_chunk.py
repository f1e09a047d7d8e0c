"""Busy chunking: while a server has been busy lately, a long prompt is computed in short steps.

The scheduler chunks a prefill at `long_prefill_token_threshold` (327 tokens at 8k context) while other
requests wait or run beside it (`Scheduler._chunk`), and alone not at all, so a lone long prompt pays
nothing for chunking (a 2,048-token prompt in 96-token chunks took up to 11% longer on one CPU thread). But
whoever arrives during a step waits for all of it, and on one CPU thread a 1,072-token step takes ~3 s, a
327-token chunk ~1 s. Over 2 workers with RAG traffic in a closed loop (BENCHMARKS.md, router_busy_chunk_zen4),
a question on a cached document that reached its worker 80 ms after another document's first read began
waited out that read, and the client slots such waits held kept the next document's read from starting beside
it on the other worker: cache-aware routing's p90 was 2.9-3.3 s, no better than round_robin's.

So, while the server has had two or more callers' requests at once (contention) within the last
`memory_s` seconds, a prompt with at least `min_uncached` tokens to compute is computed at most `tokens`
(96, ~0.3 s here) a step, alone or beside others: a newcomer waits for one short step. A server used one
request at a time never splits a lone prompt, and a prompt under `min_uncached` (a chat turn's question and
the reply before it, ~240 tokens) keeps the usual rule: `--long-prefill-always --long-prefill-token-threshold
96` split those into three steps too, which is what slowed chat's warm turns under it (router_chat_chunked96).
Off offline (`LLM`: nobody arrives during a batch) and on a GPU, where a long prompt's step is short.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

BUSY_CHUNK_TOKENS = 96  # ~0.3 s of a 135M model's prefill on one CPU thread
BUSY_MIN_UNCACHED = 512  # prompts computing fewer tokens than this keep the usual rule
BUSY_MEMORY_S = 5.0  # how long after the last contention the server counts as busy


@dataclass(slots=True)
class BusyChunking:
    """The rule above: `note` each step whether it was contended, `chunk` a prefill's step."""

    tokens: int = 0  # 0: off
    min_uncached: int = BUSY_MIN_UNCACHED
    memory_s: float = BUSY_MEMORY_S
    clock: Callable[[], float] = time.monotonic
    contended_at: float = -math.inf

    def note(self, contended: bool) -> None:
        if contended and self.tokens:
            self.contended_at = self.clock()

    def chunk(self, uncached: int, num_new: int) -> int:
        """Tokens a prefill computes this step: `num_new` (what the usual rule gives), or at most `tokens`
        when the server is busy lately and the prompt computes at least `min_uncached` tokens."""
        if not self.tokens or num_new <= self.tokens or uncached < self.min_uncached:
            return num_new
        return self.tokens if self.clock() - self.contended_at <= self.memory_s else num_new
