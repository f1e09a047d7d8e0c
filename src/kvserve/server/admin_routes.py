"""Operational routes: health, Prometheus metrics, prefix-cache reset."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.server.errors import ApiError
from kvserve.server.generation import engine_unavailable
from kvserve.server.metrics import CONTENT_TYPE
from kvserve.server.state import Admin, server_state
from kvserve.serving.async_engine import EngineDeadError

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the engine loop runs; 503 once it crashed or is shutting down (load balancers drain)."""
    engine = server_state(request).engine
    if engine.is_alive:
        return JSONResponse({"status": "ok"})
    reason = "engine crashed" if engine.error is not None else "engine stopped"
    return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)


@router.get("/metrics")
async def metrics(request: Request, _: Admin) -> Response:
    """Prometheus text format. Admin-only with API keys: aggregate counters reveal other tenants' traffic."""
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request, _: Admin) -> JSONResponse:
    """Drop every cached block; 409 while requests hold blocks (retry when idle)."""
    try:
        reset = await server_state(request).engine.reset_prefix_cache()
    except EngineDeadError as err:
        raise engine_unavailable(err) from err
    if not reset:
        raise ApiError(409, "blocks are in use by running requests; retry when the server is idle",
                       code="cache_in_use")
    return JSONResponse({"success": True})
