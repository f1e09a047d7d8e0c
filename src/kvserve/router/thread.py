"""Serve a router from a thread of this process (tests, benchmarks, embedding): its policy and pool
stay inspectable, and `stop()` shuts it down cleanly."""

from __future__ import annotations

import threading
import time

import uvicorn

from kvserve.router.app import Router
from kvserve.router.config import RouterConfig
from kvserve.router.serve import build_router
from kvserve.server.launcher import free_port


class RouterThread:
    """`kvserve router` for `config` on a loopback port (a free one unless `config.port` is set)."""

    def __init__(self, config: RouterConfig, port: int | None = None) -> None:
        config.port = port or free_port(config.host)
        self.app = build_router(config)
        self.url = f"http://{config.host}:{config.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=config.host, port=config.port,
                                                     log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="kvserve-router", daemon=True)

    @property
    def router(self) -> Router:
        return self.app.state.router

    def start(self, timeout: float = 30.0) -> RouterThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the router did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)

    def __enter__(self) -> RouterThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
