"""A circuit breaker: stop calling a tier that keeps failing, and probe it back after a cool-down.

closed     calls go through; `failure_threshold` consecutive failures open the breaker.
open       calls are refused at once (no network wait) until `cooldown_s` has passed; then the next
           call is let through as the probe and the breaker is half-open.
half_open  only the probe is in flight (other calls are refused); its success closes the breaker,
           its failure opens it again for another cool-down.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_CODES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # gauge values for /metrics


class CircuitBreaker:
    def __init__(
        self, failure_threshold: int = 2, cooldown_s: float = 2.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failure_threshold < 1 or cooldown_s < 0:
            raise ValueError(f"bad breaker settings: threshold {failure_threshold}, cooldown {cooldown_s}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self.state = CLOSED
        self.consecutive_failures = 0
        self.times_opened = 0
        self._opened_at = 0.0

    def allow(self) -> bool:
        """Whether a call may go to the tier now (an open breaker past its cool-down admits one probe)."""
        with self._lock:
            if self.state == CLOSED:
                return True
            if self.state == OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                self.state = HALF_OPEN
                return True
            return False

    def is_open(self) -> bool:
        """Open and still cooling down: a call now would be refused (no state change, unlike `allow`)."""
        with self._lock:
            return self.state == HALF_OPEN or (
                self.state == OPEN and self._clock() - self._opened_at < self.cooldown_s
            )

    def record_success(self) -> None:
        with self._lock:
            self.state = CLOSED
            self.consecutive_failures = 0

    def record_failure(self) -> None:
        with self._lock:
            self.consecutive_failures += 1
            if self.state == HALF_OPEN or self.consecutive_failures >= self.failure_threshold:
                if self.state != OPEN:
                    self.times_opened += 1
                self.state = OPEN
                self._opened_at = self._clock()
