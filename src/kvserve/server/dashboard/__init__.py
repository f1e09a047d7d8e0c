"""The live cache dashboard: a static page plus the snapshot and stream routes it reads.

    install(app, state, enabled=True)   # adds /dashboard, /v1/cache/snapshot, /v1/cache/stream

Whether it is on (`dashboard_enabled`): `--dashboard` forces it on, `--no-dashboard` off; by default it
is on when API keys are configured (every view then needs a key, and a tenant sees only its own cache)
or when the server listens on a loopback address only, and off otherwise: without keys anyone who
reaches the port would see every tenant's prompts.
"""

from __future__ import annotations

import ipaddress

from fastapi import FastAPI

from kvserve.server.dashboard.live import LiveHub
from kvserve.server.dashboard.routes import DashboardState, router
from kvserve.server.dashboard.series import Series
from kvserve.server.dashboard.snapshot import Renderer, SnapshotLimits
from kvserve.server.state import ServerState

__all__ = ["dashboard_enabled", "install"]


def dashboard_enabled(flag: bool | None, host: str, has_api_keys: bool) -> bool:
    """The `--dashboard / --no-dashboard` decision; None means "by default" (see the module docstring)."""
    if flag is not None:
        return flag
    return has_api_keys or is_loopback(host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: it may resolve to anything


def install(app: FastAPI, state: ServerState, enabled: bool) -> None:
    """Add the dashboard's routes to `app`; when not `enabled` they answer 404 naming `--dashboard`."""
    tokenizer = state.engine.tokenizer
    decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    renderer = Renderer(state.model_name, SnapshotLimits(), decode)
    hub = LiveHub(state.engine, renderer, Series(state.metrics))
    app.state.dashboard = DashboardState(enabled, hub, renderer)
    app.include_router(router)
