"""Start a server in a subprocess and wait until it is healthy (tests, benchmarks, local replicas)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(slots=True)
class ServerProcess:
    """A running `python -m kvserve.server`; its combined output goes to `log_path`."""

    process: subprocess.Popen
    host: str
    port: int
    log_path: Path
    _log_file: object = field(default=None, repr=False)
    _owns_log: bool = False  # a temporary log, removed after a clean exit

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI client's base_url."""
        return f"{self.url}/v1"

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for the exit status (SIGKILL after `timeout`)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            status = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            status = self.process.wait()
        if self._log_file is not None:
            self._log_file.close()
        if self._owns_log and status == 0:
            self.log_path.unlink(missing_ok=True)  # keep it only when something went wrong
        return status

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.terminate()


def launch_server(
    args: list[str], host: str = "127.0.0.1", port: int | None = None, startup_timeout: float = 180.0,
    env: dict[str, str] | None = None, log_path: str | Path | None = None,
) -> ServerProcess:
    """Run `python -m kvserve.server --host H --port P *args`; return once /health answers 200."""
    port = port or free_port(host)
    owns_log = log_path is None
    if log_path is None:
        handle, log_path = tempfile.mkstemp(prefix="kvserve-server-", suffix=".log")
        os.close(handle)
    log_path = Path(log_path)
    log_file = open(log_path, "w")  # noqa: SIM115 - closed by ServerProcess.terminate
    command = [sys.executable, "-m", "kvserve.server", "--host", host, "--port", str(port), *args]
    process = subprocess.Popen(
        command, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )
    server = ServerProcess(process, host, port, log_path, log_file, owns_log)
    try:
        _wait_until_healthy(server, startup_timeout)
    except BaseException:
        server.terminate(timeout=10)
        raise
    return server


def _wait_until_healthy(server: ServerProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            # stdlib, not httpx: the server package must not need test-only dependencies
            with urllib.request.urlopen(f"{server.url}/health", timeout=2.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"server not healthy after {timeout:.0f}s:\n{server.log_tail()}")
