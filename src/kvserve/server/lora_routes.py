"""LoRA adapters over HTTP, as vLLM: `model: "<adapter name>"` selects one; load / unload at run time.

`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` reads and validates the adapter on the engine
thread (400 naming the problem, nothing loaded), `POST /v1/unload_lora_adapter {"lora_name"}` forgets
the name (requests already running under it finish under it). Both are admin routes when API keys are
set. Served adapters are listed in `/v1/models` with `parent` = the base model.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from kvserve.lora.adapter import LoRAAdapter
from kvserve.server.errors import ApiError, bad_request
from kvserve.server.generation import engine_unavailable
from kvserve.server.protocol import ModelCard
from kvserve.server.state import Admin, ServerState, parse_body, server_state
from kvserve.serving.async_engine import EngineDeadError

router = APIRouter()


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # accepted for vLLM clients; the name decides


def resolve_model(state: ServerState, name: str) -> LoRAAdapter | None:
    """None for a base model name, the adapter for an adapter name; 404 model_not_found otherwise."""
    if name in state.model_names:
        return None
    adapter = state.lora_adapters.get(name)
    if adapter is None:
        served = [*state.model_names, *state.lora_adapters]
        raise ApiError(404, f"model {name!r} does not exist; this server serves {served}", "model", "model_not_found")
    return adapter


def lora_model_cards(state: ServerState) -> list[ModelCard]:
    max_model_len = state.engine.info.max_model_len
    return [
        ModelCard(id=name, created=0, max_model_len=max_model_len, root=adapter.path, parent=state.model_name)
        for name, adapter in state.lora_adapters.items()
    ]


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request, _: Admin) -> PlainTextResponse:
    state = server_state(request)
    body = await parse_body(request, LoadLoRARequest)
    name = body.lora_name
    if name in state.model_names or name in state.lora_adapters:
        raise bad_request(f"the model name {name!r} is already in use", "lora_name")
    try:
        adapter = await state.engine.call(lambda engine: engine.load_lora(name, body.lora_path))
    except ValueError as err:
        raise bad_request(str(err), "lora_path") from err
    except EngineDeadError as err:
        raise engine_unavailable(err) from err
    state.lora_adapters[name] = adapter
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request, _: Admin) -> PlainTextResponse:
    state = server_state(request)
    body = await parse_body(request, UnloadLoRARequest)
    name = body.lora_name
    if state.lora_adapters.pop(name, None) is None:
        raise ApiError(404, f"LoRA adapter {name!r} is not loaded", "lora_name", "model_not_found")
    try:
        await state.engine.call(lambda engine: engine.unload_lora(name))
    except EngineDeadError as err:
        raise engine_unavailable(err) from err
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
