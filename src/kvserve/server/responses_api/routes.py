"""`POST /v1/responses` (whole, or streamed as typed events), `GET` and `DELETE /v1/responses/{id}`.

A response runs as the chat request convert.py builds (same template, constraints, tools, limits and
errors). Streamed, it sends OpenAI's event sequence -- response.created, response.in_progress, then per
output item output_item.added ... output_item.done, and response.completed (response.incomplete when
max_output_tokens cut it) -- each `event: TYPE` with a JSON `data` carrying `type` and `sequence_number`.
Plain text streams as output_text.delta events as it is generated; with tools, whose calls are known
only once the output ends, every item is sent at the end. An engine failure mid-stream is a
response.failed event; a client that hangs up aborts its engine request, as on the chat endpoint.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvserve.engine.request import RequestOutput
from kvserve.server import inputs, responses
from kvserve.server.auth import Principal
from kvserve.server.constraints import ToolChoice, effective_tool_choice
from kvserve.server.errors import ApiError, from_validation_error
from kvserve.server.generation import ClientDisconnected, collect, submit
from kvserve.server.lora_routes import resolve_model
from kvserve.server.openai_routes import request_namespace
from kvserve.server.responses_api import convert
from kvserve.server.responses_api.protocol import Response as ResponseObject
from kvserve.server.responses_api.protocol import ResponsesRequest, new_id
from kvserve.server.state import CLIENT_CLOSED_REQUEST, Caller, ServerState, parse_body, server_state
from kvserve.serving.async_engine import EngineDeadError, RequestFailedError, RequestGroup

router = APIRouter()
logger = logging.getLogger("uvicorn.error")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(slots=True)
class Turn:
    """One response being generated: its request, its engine context, and what will be stored of it."""

    body: ResponsesRequest
    ctx: responses.ResponseContext
    tool_choice: ToolChoice | None
    tenant: str | None
    history: list[dict[str, Any]]  # the conversation before the output (instructions aside)
    message_id: str = field(default_factory=lambda: new_id("msg"))

    @property
    def streams_text(self) -> bool:
        return self.tool_choice in (None, "none")

    def finish(self, state: ServerState, finals: dict[int, RequestOutput], message_id: str | None) -> ResponseObject:
        """The finished response, stored when the request asked for it."""
        completion = responses.chat_completion(self.ctx, finals, logprobs=False, tool_choice=self.tool_choice)
        result = convert.response_of(self.body, self.ctx.id, self.ctx.created, completion, message_id)
        if self.body.store:
            state.response_store.put(self.tenant, result.model_dump(mode="json"),
                                     self.history + convert.output_messages(result.output))
        return result


@router.post("/v1/responses")
async def create_response(request: Request, caller: Caller) -> Response:
    state = server_state(request)
    body = await parse_body(request, ResponsesRequest)
    lora = resolve_model(state, body.model)
    history = _previous(state, caller, body.previous_response_id)
    try:
        chat = convert.chat_request(body, history, body.max_output_tokens)
    except ValidationError as err:
        raise from_validation_error(err) from err
    info, tokenizer = state.engine.info, state.engine.tokenizer
    inputs.check_chat_size(chat.messages, info)
    prompt_ids = await state.off_loop(inputs.chat_prompt_ids, tokenizer, chat)
    max_tokens = inputs.resolve_max_tokens(chat.max_tokens, [len(prompt_ids)], info, None, "input")
    template = getattr(tokenizer, "chat_template", None)
    params = inputs.engine_params(chat, max_tokens, None, template)
    ctx = responses.ResponseContext(new_id("resp"), body.model, 1, [len(prompt_ids)], state.token_texts)
    namespace = request_namespace(caller, body.cache_salt)
    group = await submit(state, ctx, [prompt_ids], params, namespace, "input", lora)
    turn = Turn(body, ctx, effective_tool_choice(chat) if chat.tools else None, caller.tenant,
                history + convert.input_messages(body))
    if body.stream:
        return StreamingResponse(_events(state, group, turn), media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        finals = await collect(group, request, state.metrics)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(turn.finish(state, finals, None).model_dump(mode="json"))


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str, caller: Caller) -> JSONResponse:
    stored = server_state(request).response_store.get(caller.tenant, response_id)
    if stored is None:
        raise _not_found(response_id, "response_id")
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str, caller: Caller) -> JSONResponse:
    if not server_state(request).response_store.delete(caller.tenant, response_id):
        raise _not_found(response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _previous(state: ServerState, caller: Principal, response_id: str | None) -> list[dict[str, Any]]:
    if response_id is None:
        return []
    stored = state.response_store.get(caller.tenant, response_id)
    if stored is None:
        raise _not_found(response_id, "previous_response_id")
    return list(stored.history)


def _not_found(response_id: str, param: str) -> ApiError:
    return ApiError(404, f"response {response_id!r} not found (responses live in this server's memory, "
                    "per tenant, while there is room)", param=param, code="response_not_found")


async def _events(state: ServerState, group: RequestGroup, turn: Turn) -> AsyncIterator[str]:
    sequence = itertools.count()

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(sequence), **data})}\n\n"

    start = ResponseObject(id=turn.ctx.id, created_at=turn.ctx.created, status="in_progress", model=turn.body.model,
                           **convert.echoed(turn.body)).model_dump(mode="json")
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    text_id = turn.message_id if turn.streams_text else None
    if text_id is not None:
        yield event("response.output_item.added", output_index=0,
                    item={**convert.message_item(text_id, "", "in_progress"), "content": []})
        yield event("response.content_part.added", item_id=text_id, output_index=0, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in group:
            state.metrics.observe_output(output)
            if output.finished:
                finals[index] = output
            for completion in output.completions if text_id is not None else ():
                if completion.delta_text:
                    yield event("response.output_text.delta", item_id=text_id, output_index=0, content_index=0,
                                delta=completion.delta_text, logprobs=[])
        result = turn.finish(state, finals, text_id)
        for index, item in enumerate(result.output):
            for line in _item_events(event, index, item, announced=text_id is not None and index == 0):
                yield line
        kind = "response.completed" if result.status == "completed" else "response.incomplete"
        yield event(kind, response=result.model_dump(mode="json"))
    except (EngineDeadError, RequestFailedError) as err:
        logger.error("%s failed: %s", turn.ctx.id, err)
        failed = ResponseObject(id=turn.ctx.id, created_at=turn.ctx.created, status="failed", model=turn.body.model,
                                error={"code": "server_error", "message": "the engine could not finish this "
                                       f"response ({turn.ctx.id}); retry later"}, **convert.echoed(turn.body))
        yield event("response.failed", response=failed.model_dump(mode="json"))
    finally:
        num_aborted = group.abort()
        if num_aborted:
            logger.info("%s: stream closed before the end; %d engine request(s) aborted", turn.ctx.id, num_aborted)
        state.metrics.observe_aborted(num_aborted, group.request_ids)


def _item_events(event: Callable[..., str], index: int, item: dict[str, Any], announced: bool) -> list[str]:
    """The events that close output item `index` (and open it first, unless the text stream already did)."""
    lines = []
    if item["type"] == "function_call":
        lines.append(event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                      "status": "in_progress"}))
        lines.append(event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=item["arguments"]))
        lines.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]))
    else:
        part = item["content"][0]
        if not announced:
            lines.append(event("response.output_item.added", output_index=index,
                               item={**item, "status": "in_progress", "content": []}))
            lines.append(event("response.content_part.added", item_id=item["id"], output_index=index,
                               content_index=0, part={**part, "text": ""}))
            lines.append(event("response.output_text.delta", item_id=item["id"], output_index=index,
                               content_index=0, delta=part["text"], logprobs=[]))
        lines.append(event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=[]))
        lines.append(event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part))
    lines.append(event("response.output_item.done", output_index=index, item=item))
    return lines
