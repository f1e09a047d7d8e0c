"""Per-app server state and the FastAPI dependencies that read it (auth, body parsing).

CPU-heavy request work (validating a large JSON body, chat templating, tokenizing, rendering a large
response) goes through `ServerState.off_loop`, a small thread pool, so one large input never stalls
the event loop that answers everyone else (health checks included).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from kvserve.events.publisher import KVEventPublisher
from kvserve.lora.adapter import LoRAAdapter
from kvserve.server.auth import ApiKeys, AuthError, Principal, authenticate, require_admin
from kvserve.server.errors import ApiError, from_validation_error
from kvserve.server.limits import ServerLimits
from kvserve.server.metrics import ServerMetrics
from kvserve.server.responses import TokenTexts
from kvserve.server.responses_api.store import ResponseStore
from kvserve.server.roles import RoleInfo
from kvserve.serving.async_engine import AsyncEngine

logger = logging.getLogger("uvicorn.error")
MAX_BODY_BYTES = 16 * 1024 * 1024  # a 128k-token prompt is ~1 MB of JSON; this only stops abuse
OFF_LOOP_BODY_BYTES = 64 * 1024  # bodies larger than this are validated on the worker pool
CLIENT_CLOSED_REQUEST = 499  # nginx's code: nobody reads it, but logs show what happened
ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")


@dataclass(slots=True)
class ReplicaInfo:
    """What a router needs to know about this worker (`GET /load`): how it hashes blocks, where it
    publishes KV events, and an id that changes when the process restarts (its cache is then empty)."""

    prefix_hash: str = "sha256"
    kv_events: KVEventPublisher | None = None
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    role: RoleInfo = field(default_factory=RoleInfo)  # --role: prefill | decode | mixed (server/roles.py)
    tier_blocks: int = 0  # blocks the host and disk tiers can hold together (0: no tiers)


@dataclass(slots=True)
class ServerState:
    """Everything the routes share: the engine, the served name, keys, limits and metrics."""

    engine: AsyncEngine
    model_name: str
    api_keys: ApiKeys | None
    max_queue: int
    metrics: ServerMetrics
    token_texts: TokenTexts
    limits: ServerLimits
    workers: ThreadPoolExecutor  # bounded: CPU-heavy input work, off the event loop
    served_model_names: tuple[str, ...] = ()  # every name requests may use; model_name is the first
    replica: ReplicaInfo = field(default_factory=ReplicaInfo)  # for a router: `GET /load`
    lora_adapters: dict[str, LoRAAdapter] = field(default_factory=dict)  # served adapters by name (event loop)
    response_store: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses (event loop)

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model_name,)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the worker pool and await it (exceptions propagate)."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, functools.partial(fn, *args))


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def principal(request: Request) -> Principal:
    """Dependency: the caller's principal (401 without a valid key when keys are configured). Async, as
    is `admin`: FastAPI runs a plain `def` dependency on its thread pool, a thread hop (and a thread) per
    request for a header lookup."""
    return _principal(request)


async def admin(request: Request) -> Principal:
    """Dependency: an admin principal (403 for a tenant key)."""
    caller = _principal(request)
    try:
        require_admin(caller)
    except AuthError as err:
        raise ApiError(err.status, str(err), code="forbidden", type_="permission_error") from err
    return caller


def _principal(request: Request) -> Principal:
    try:
        return authenticate(request.headers.get("authorization"), server_state(request).api_keys)
    except AuthError as err:
        raise ApiError(err.status, str(err), code="invalid_api_key", type_="authentication_error") from err


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    """Read and strictly validate a JSON body; 413 when too large, 408 when it takes longer than the
    body timeout, 400 naming the field otherwise. A client that hangs up mid-body is one log line."""
    state = server_state(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    try:
        async with asyncio.timeout(state.limits.body_timeout_s):
            body = await _read_body(request)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {state.limits.body_timeout_s:g} s",
                       code="request_timeout") from None
    except ClientDisconnect:
        client = f"{request.client.host}:{request.client.port} - " if request.client else ""
        logger.info("%sclient disconnected while sending %s %s", client, request.method, request.url.path)
        raise ApiError(CLIENT_CLOSED_REQUEST, "client disconnected", code="client_disconnected") from None
    try:
        if len(body) > OFF_LOOP_BODY_BYTES:
            return await state.off_loop(model.model_validate_json, body)
        return model.model_validate_json(body)
    except ValidationError as err:
        raise from_validation_error(err) from err


async def _read_body(request: Request) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _too_large()
    return bytes(body)


Caller = Annotated[Principal, Depends(principal)]
Admin = Annotated[Principal, Depends(admin)]


def _too_large() -> ApiError:
    return ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
