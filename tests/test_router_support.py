"""Helpers for the router tests (this module holds no tests): a router served from a thread of the
test process (its policy state can be inspected), in front of real worker processes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from kvserve.router.app import Router
from kvserve.router.config import RouterConfig
from kvserve.router.serve import build_router
from kvserve.server.launcher import free_port

KEYS = {"keys": {"sk-alice": "alice", "sk-bob": "bob", "sk-ops": {"tenant": "ops", "admin": True}}}


def write_keys(directory: Path) -> Path:
    path = directory / "keys.json"
    path.write_text(json.dumps(KEYS))
    return path


class RouterThread:
    """`kvserve router` on a free loopback port, in a thread; `stop()` shuts it down cleanly."""

    def __init__(self, config: RouterConfig) -> None:
        config.port = config.port if config.port != 8080 else free_port()
        self.app = build_router(config)
        self.url = f"http://127.0.0.1:{config.port}"
        server_config = uvicorn.Config(self.app, host="127.0.0.1", port=config.port, log_level="warning")
        self._server = uvicorn.Server(server_config)
        self._thread = threading.Thread(target=self._server.run, name="router", daemon=True)

    @property
    def router(self) -> Router:
        return self.app.state.router

    def start(self, timeout: float = 30.0) -> RouterThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("router did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)

    def __enter__(self) -> RouterThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
    text = httpx.get(f"{url}/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] != name:
            continue
        if all(f'{key}="{val}"' in series for key, val in (labels or {}).items()):
            total += float(value)
    return total


def wait_for(condition, timeout: float = 20.0, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval)
