"""Which thread steps the engine: a warning when it is not the one that built it (with OpenMP on).

An engine built on one thread and stepped on another gives libgomp two teams of threads, and on a small
machine that makes every later step slower (kvserve/openmp.py; `benchmarks/server_steps.py`: a 7-row
decode step 40 ms instead of 20 on 2 cores). `LLM` from a worker thread, an `AsyncEngine` around an engine
built elsewhere: the first step from a new thread says so once; `AsyncEngine.spawn` builds on the thread
that steps.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepThreads:
    built_on: int = field(default_factory=threading.get_ident)
    stepping: int | None = None

    def check(self) -> None:
        """Called at each step: cheap unless the stepping thread changed."""
        ident = threading.get_ident()
        if ident == self.stepping:
            return
        self.stepping = ident
        if ident != self.built_on and torch.get_num_threads() > 1:
            logger.warning("the engine was built on another thread than the one stepping it: OpenMP then runs "
                           "two thread teams, which can make every step slower on a small machine (build it on "
                           "the thread that steps it, e.g. with AsyncEngine.spawn)")
