"""RedisStore against a real server: TTL, a crashed or hung server (breaker), a slow one (proxy)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch

from kvserve.prefix.hashing import block_hashes
from kvserve.tiers.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvserve.tiers.codec import BlockCodec
from kvserve.tiers.local_redis import LocalRedis, free_port
from kvserve.tiers.offload import OffloadPolicy
from kvserve.tiers.redis import RedisStore
from kvserve.tiers.store import model_fingerprint

FP = model_fingerprint(kv_dtype="float32", block_size=4, config={"hidden": 64})
TIMEOUT_S = 0.3


def keys(count: int, start: int = 0) -> list[bytes]:
    return FP.keys(block_hashes(list(range(start, start + count * 4)), 4, ()))


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def test_ttl_expires_blocks(redis_url):
    store = RedisStore(redis_url, ttl_s=0.3)
    store.put([(k, b"x" * 10) for k in keys(2)])
    assert store.longest_prefix(keys(2)) == 2
    time.sleep(0.6)
    assert store.longest_prefix(keys(2)) == 0
    with pytest.raises(ValueError):
        RedisStore(redis_url, ttl_s=0)


def _assert_down_then_skipped(store: RedisStore) -> None:
    for _ in range(2):  # threshold 2: each failing call is bounded by the timeout
        (prefix, elapsed) = timed(store.longest_prefix, keys(3))
        assert prefix == 0 and elapsed < TIMEOUT_S + 0.5
    assert store.breaker.state == OPEN
    for op, arg, empty in ((store.get, keys(3), [None] * 3), (store.longest_prefix, keys(3), 0)):
        result, elapsed = timed(op, arg)
        assert result == empty and elapsed < TIMEOUT_S / 2  # skipped: no network wait (a hung call takes the timeout)
    store.put([(keys(1)[0], b"y")])
    stats = store.stats()
    assert stats.errors >= 2 and stats.extra["skipped"] >= 3 and stats.extra["breaker_state"] == OPEN


def _assert_used_again(store: RedisStore) -> None:
    time.sleep(0.55)  # past the cool-down: the next call is the probe
    store.put([(k, b"z" * 5) for k in keys(2, start=100)])
    assert store.breaker.state == CLOSED
    assert store.get(keys(2, start=100)) == [b"z" * 5] * 2


def test_killed_redis_opens_breaker_and_is_used_again_when_back():
    server = LocalRedis().start()
    store = RedisStore(server.url, timeout_s=TIMEOUT_S, breaker=CircuitBreaker(2, cooldown_s=0.5))
    try:
        store.put([(k, b"v") for k in keys(3)])
        assert store.longest_prefix(keys(3)) == 3
        server.kill()
        _assert_down_then_skipped(store)
        server = LocalRedis(port=server.port).start()
        _assert_used_again(store)
        assert store.stats().extra["breaker_opened"] == 1
    finally:
        store.close()
        server.stop()


def test_hung_redis_calls_are_bounded_by_the_timeout():
    server = LocalRedis().start()
    store = RedisStore(server.url, timeout_s=TIMEOUT_S, breaker=CircuitBreaker(2, cooldown_s=0.5))
    try:
        store.put([(k, b"v") for k in keys(3)])
        os.kill(server.process.pid, signal.SIGSTOP)  # accepts nothing, answers nothing
        _assert_down_then_skipped(store)
        os.kill(server.process.pid, signal.SIGCONT)
        _assert_used_again(store)
        assert store.get(keys(3)) == [b"v"] * 3  # the same server: its data is still there
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        store.close()
        server.stop()


def test_breaker_half_open_admits_one_probe():
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=1.0, clock=lambda: now[0])
    breaker.record_failure()
    assert breaker.state == OPEN and breaker.is_open() and not breaker.allow()
    now[0] = 1.0
    assert not breaker.is_open()  # past the cool-down: a call would be the probe
    assert breaker.allow() and breaker.state == HALF_OPEN and breaker.is_open()
    assert not breaker.allow()  # only one probe in flight
    breaker.record_failure()
    assert breaker.state == OPEN and not breaker.allow()
    now[0] = 2.5
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == CLOSED and breaker.allow() and breaker.times_opened == 2


class DelayProxy:
    """TCP proxy to a Redis server that holds every client→server chunk for `delay_s`."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.delay_s = delay_s
        self.target_port = target_port
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, self.delay_s), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, 0.0), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, delay_s: float) -> None:
        try:
            while data := source.recv(65536):
                time.sleep(delay_s)
                sink.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


def test_slow_redis_never_blocks_the_write_through_caller(redis_server, redis_url):
    proxy = DelayProxy(redis_server.port, delay_s=0.4)
    pool = torch.randn(2, 2, 8, 4, 2, 8)
    remote = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", timeout_s=2.0)
    policy = OffloadPolicy(BlockCodec.for_pool(pool), FP, remote=remote, max_queued_blocks=4)
    try:
        hashes = block_hashes(list(range(4 * 40)), 4, ())
        worst = 0.0
        for i in range(40):
            _, elapsed = timed(policy.write_through, hashes[i : i + 1], pool, [i % 8])
            worst = max(worst, elapsed)
        assert worst < 0.05, f"write_through blocked for {worst:.3f}s behind a 0.4 s Redis"
        policy.flush()
        stats = policy.stats()
        dropped = stats["policy"]["write_through_dropped"] + stats["remote"]["writer"]["dropped"]
        assert dropped > 0 and stats["remote"]["writer"]["written"] + dropped == 40
        assert remote.longest_prefix(FP.keys(hashes[:1])) == 1  # what was queued did arrive
    finally:
        policy.close()
        proxy.close()
