"""Per-app server state and the FastAPI dependencies that read it (auth, body parsing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from kvserve.server.auth import ApiKeys, AuthError, Principal, authenticate, require_admin
from kvserve.server.errors import ApiError, from_validation_error
from kvserve.server.metrics import ServerMetrics
from kvserve.server.responses import TokenTexts
from kvserve.serving.async_engine import AsyncEngine

MAX_BODY_BYTES = 16 * 1024 * 1024  # a 128k-token prompt is ~1 MB of JSON; this only stops abuse
ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass(slots=True)
class ServerState:
    """Everything the routes share: the engine, the served name, keys, limits and metrics."""

    engine: AsyncEngine
    model_name: str
    api_keys: ApiKeys | None
    max_queue: int
    metrics: ServerMetrics
    token_texts: TokenTexts
    served_model_names: tuple[str, ...] = ()  # every name requests may use; model_name is the first

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model_name,)


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def principal(request: Request) -> Principal:
    """Dependency: the caller's principal (401 without a valid key when keys are configured)."""
    try:
        return authenticate(request.headers.get("authorization"), server_state(request).api_keys)
    except AuthError as err:
        raise ApiError(err.status, str(err), code="invalid_api_key", type_="authentication_error") from err


def admin(request: Request) -> Principal:
    """Dependency: an admin principal (403 for a tenant key)."""
    caller = principal(request)
    try:
        require_admin(caller)
    except AuthError as err:
        raise ApiError(err.status, str(err), code="forbidden", type_="permission_error") from err
    return caller


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    """Read and strictly validate a JSON body; 413 when too large, 400 naming the field otherwise."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _too_large()
    try:
        return model.model_validate_json(bytes(body))
    except ValidationError as err:
        raise from_validation_error(err) from err


Caller = Annotated[Principal, Depends(principal)]
Admin = Annotated[Principal, Depends(admin)]


def _too_large() -> ApiError:
    return ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
