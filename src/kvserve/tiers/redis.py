"""RedisStore: the tier every replica shares, through the `redis` client (hiredis parser when installed).

Every batch is one pipelined round trip (EXISTS…, MGET, SET…, DEL). Connect and read timeouts bound
how long a call can wait, the client retries nothing (a retry would multiply that bound), and a
circuit breaker (`breaker.py`) skips the tier while it is down: a call made while the breaker is open
returns the "nothing there" answer at once, and after the cool-down one call probes the server. The
connection pool reconnects by itself once the server is back. An optional TTL expires blocks; memory
limits and eviction are Redis's own (`maxmemory`, `allkeys-lru`), since the store is shared.

Keys are ``b"kvserve:" + BlockKey``; values are payloads (`codec.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis as redis_client
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvserve.tiers.breaker import STATE_CODES, CircuitBreaker
from kvserve.tiers.store import BlockKey, TierStats

T = TypeVar("T")
KEY_PREFIX = b"kvserve:"
_DOWN_ERRORS = (redis_client.ConnectionError, redis_client.TimeoutError, OSError)


class RedisStore:
    """See the module docstring. `url` is ``redis://host:port/db``."""

    name = "remote"

    def __init__(
        self,
        url: str,
        ttl_s: float | None = None,
        connect_timeout_s: float = 0.25,
        timeout_s: float = 0.5,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"remote cache TTL must be positive seconds, got {ttl_s}")
        self.url = url
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.timeout_s = timeout_s
        self.breaker = breaker or CircuitBreaker()
        self._client = redis_client.Redis.from_url(
            url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0,
        )
        self._lock = threading.Lock()
        self._stats = TierStats(self.name, extra={"skipped": 0, "bytes_read": 0, "bytes_written": 0})

    # --- the BlockStore protocol ----------------------------------------------------------------

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int:
        if not keys:
            return 0

        def run() -> int:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(KEY_PREFIX + key)
            present = pipe.execute()
            return next((i for i, count in enumerate(present) if not count), len(keys))

        return self._call(run, 0)

    def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        if not keys:
            return []
        values = self._call(lambda: self._client.mget([KEY_PREFIX + k for k in keys]), [None] * len(keys))
        hits = [v for v in values if v is not None]
        with self._lock:
            self._stats.hits += len(hits)
            self._stats.misses += len(keys) - len(hits)
            self._stats.extra["bytes_read"] += sum(len(v) for v in hits)
        return list(values)

    def put(self, items: Sequence[tuple[BlockKey, bytes]]) -> None:
        if not items:
            return

        def run() -> bool:
            pipe = self._client.pipeline(transaction=False)
            for key, payload in items:
                pipe.set(KEY_PREFIX + key, payload, px=self.ttl_ms)
            pipe.execute()
            return True

        if self._call(run, False):
            with self._lock:
                self._stats.puts += len(items)
                self._stats.extra["bytes_written"] += sum(len(p) for _, p in items)

    def delete(self, keys: Sequence[BlockKey]) -> None:
        if keys:
            self._call(lambda: self._client.delete(*[KEY_PREFIX + k for k in keys]), 0)

    def stats(self) -> TierStats:
        """Counters of this process's traffic; blocks/bytes stay 0 (other replicas write the same store)."""
        with self._lock:
            snapshot = TierStats(**{**self._stats.as_dict(), "extra": dict(self._stats.extra)})
        snapshot.extra.update(
            breaker_state=self.breaker.state, breaker_state_code=STATE_CODES[self.breaker.state],
            breaker_opened=self.breaker.times_opened,
        )
        return snapshot

    def check_invariants(self) -> None:
        assert self.breaker.state in STATE_CODES, f"unknown breaker state {self.breaker.state}"

    def close(self) -> None:
        self._client.close()

    def ping(self) -> bool:
        return bool(self._call(self._client.ping, False))

    # --- internals ------------------------------------------------------------------------------

    def _call(self, fn: Callable[[], T], fallback: T) -> T:
        """Run one round trip under the breaker; a down server yields `fallback`, never an exception."""
        if not self.breaker.allow():
            with self._lock:
                self._stats.extra["skipped"] += 1
            return fallback
        try:
            result = fn()
        except _DOWN_ERRORS:
            self.breaker.record_failure()
            self._count_error()
            return fallback
        except redis_client.RedisError:  # the server answered with an error (OOM, wrong type): not down
            self.breaker.record_success()
            self._count_error()
            return fallback
        self.breaker.record_success()
        return result

    def _count_error(self) -> None:
        with self._lock:
            self._stats.errors += 1
