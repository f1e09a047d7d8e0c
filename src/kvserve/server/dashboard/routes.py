"""Dashboard routes: the page (`/dashboard`), one snapshot (`/v1/cache/snapshot`), the live stream.

The page itself is static and public; every byte of cache data goes through `Caller` (the API key, when
keys are configured), and what a caller sees is decided by `snapshot.namespace_filter`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib import resources

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.server.dashboard.live import LiveHub
from kvserve.server.dashboard.snapshot import Renderer
from kvserve.server.errors import ApiError
from kvserve.server.generation import engine_unavailable
from kvserve.server.state import Caller
from kvserve.serving.async_engine import EngineDeadError

router = APIRouter()
STATIC_FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
MAX_TOP = 2000
MAX_WAITING = 1000


@dataclass(slots=True)
class DashboardState:
    enabled: bool
    hub: LiveHub
    renderer: Renderer


def _dashboard(request: Request) -> DashboardState:
    state: DashboardState | None = getattr(request.app.state, "dashboard", None)
    if state is None or not state.enabled:
        raise ApiError(404, "the dashboard is off: start the server with --dashboard", code="dashboard_disabled")
    return state


@router.get("/dashboard", include_in_schema=False)
async def page(request: Request) -> Response:
    return _static(request, "index.html")


@router.get("/dashboard/{name}", include_in_schema=False)
async def static_file(request: Request, name: str) -> Response:
    return _static(request, name)


def _static(request: Request, name: str) -> Response:
    _dashboard(request)
    if name not in STATIC_FILES:
        raise ApiError(404, f"no dashboard file {name!r}", code="not_found")
    body = resources.files("kvserve.server.dashboard").joinpath("static", name).read_bytes()
    return Response(body, media_type=STATIC_FILES[name], headers={"Cache-Control": "no-cache"})


@router.get("/v1/cache/snapshot")
async def snapshot(
    request: Request, caller: Caller,
    top: int = Query(200, ge=1, le=MAX_TOP, description="tree nodes to send, largest first"),
    block_map: bool = Query(True, description="include the per-block map"),
    max_waiting: int = Query(200, ge=0, le=MAX_WAITING, description="waiting requests to list"),
) -> JSONResponse:
    """The cache as the dashboard draws it (see docs/dashboard.md for every field)."""
    state = _dashboard(request)
    renderer = replace(state.renderer, limits=replace(
        state.renderer.limits, top=top, block_map=block_map, max_waiting=max_waiting))
    try:
        return JSONResponse(await state.hub.snapshot(caller, renderer))
    except EngineDeadError as err:
        raise engine_unavailable(err) from err


@router.get("/v1/cache/stream")
async def stream(request: Request, caller: Caller) -> StreamingResponse:
    """Server-sent events: one `snapshot` event (the snapshot plus time series) about every second."""
    state = _dashboard(request)
    if not state.hub.engine_alive:
        raise engine_unavailable(EngineDeadError("engine stopped"))
    return StreamingResponse(state.hub.events(caller), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
