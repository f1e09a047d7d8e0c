"""Operational routes: health, load (for a router), Prometheus metrics, prefix-cache reset."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.events.format import AllBlocksCleared
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


@router.get("/load")
async def load(request: Request, _: Admin) -> JSONResponse:
    """Load and cache layout for a router: running / waiting requests (background ones apart), KV usage,
    block size, hash function, KV-event endpoints, how many blocks the host and disk tiers can hold
    (`tier_blocks`), and this process's instance id. Admin-only with API keys, like `/metrics` (load
    reveals other tenants' traffic)."""
    state = server_state(request)
    stats = state.engine.stats()
    publisher = state.replica.kv_events
    return JSONResponse({
        "running": state.engine.num_running, "waiting": state.engine.num_waiting,
        "background": state.engine.num_background,  # idle copies (engine/background.py), not in the two above
        "kv_usage": stats["kv_cache_usage"], "num_blocks": stats["num_blocks"], "free_blocks": stats["free_blocks"],
        "block_size": state.engine.info.block_size, "prefix_hash": state.replica.prefix_hash,
        "kv_events_endpoint": publisher.endpoint if publisher else None,
        "kv_events_replay_endpoint": publisher.replay_endpoint if publisher else None,
        "instance": state.replica.instance,
        "role": state.replica.role.role, "remote_tier": state.replica.role.remote_tier(),
        "remote_store": state.replica.role.remote_store(), "tier_blocks": state.replica.tier_blocks,
    })


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request, _: Admin, tiers: bool = False) -> JSONResponse:
    """Drop every cached block on the device; with `?tiers=true` empty the host and disk tiers too (the
    shared remote store stays). 409 while requests hold blocks (retry when idle)."""
    try:
        reset = await server_state(request).engine.reset_prefix_cache(tiers=tiers)
    except EngineDeadError as err:
        raise engine_unavailable(err) from err
    if not reset:
        raise ApiError(409, "blocks are in use by running requests; retry when the server is idle",
                       code="cache_in_use")
    publisher = server_state(request).replica.kv_events
    if publisher is not None:
        publisher.publish([AllBlocksCleared()])
    return JSONResponse({"success": True})
