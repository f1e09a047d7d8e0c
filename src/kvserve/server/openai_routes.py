"""OpenAI-compatible routes: chat completions, text completions, models."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from kvserve.engine.request import RequestOutput
from kvserve.lora.adapter import LoRAAdapter
from kvserve.prefix.namespace import Namespace
from kvserve.server import inputs, responses, roles
from kvserve.server.auth import Principal, cache_namespace
from kvserve.server.constraints import effective_tool_choice
from kvserve.server.errors import bad_request
from kvserve.server.generation import ClientDisconnected, StreamFormat, collect, sse_stream, submit
from kvserve.server.lora_routes import lora_model_cards, resolve_model
from kvserve.server.protocol import (
    CLIENT_ID_PATTERN,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from kvserve.server.state import CLIENT_CLOSED_REQUEST, Caller, ServerState, parse_body, server_state
from kvserve.server.tool_stream import ToolCallStreams
from kvserve.serving.async_engine import RequestGroup

router = APIRouter()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.get("/v1/models")
async def list_models(request: Request, _: Caller) -> JSONResponse:
    state = server_state(request)
    cards = [ModelCard(id=name, created=0, max_model_len=state.engine.info.max_model_len)
             for name in state.model_names]
    cards += lora_model_cards(state)
    return JSONResponse(ModelList(data=cards).model_dump())


def _openapi(request_model: type[BaseModel], response_model: type[BaseModel]) -> dict:
    """OpenAPI entries for a route that parses its body itself (parse_body: size limit, strict JSON):
    the request and response schemas, inlined (no shared components needed)."""
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": _inline(request_model)}}},
        "responses": {"200": {"description": "the completion, or its chunks as server-sent events", "content": {
            "application/json": {"schema": _inline(response_model)}, "text/event-stream": {}}}},
    }


def _inline(model: type[BaseModel]) -> dict:
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(definitions[node["$ref"].rsplit("/", 1)[1]])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(value) for value in node]
        return node

    return resolve(schema)


@router.post("/v1/chat/completions", openapi_extra=_openapi(ChatCompletionRequest, ChatCompletion))
async def chat_completions(request: Request, caller: Caller) -> Response:
    state = server_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    lora = _check_request(state, body)
    inputs.check_chat_size(body.messages, state.engine.info)
    prompt_ids = await state.off_loop(inputs.chat_prompt_ids, state.engine.tokenizer, body)
    prompt_ids = inputs.truncated(prompt_ids, body.truncate_prompt_tokens, state.engine.info)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = inputs.resolve_max_tokens(requested, [len(prompt_ids)], state.engine.info, None, "messages")
    template = body.chat_template or getattr(state.engine.tokenizer, "chat_template", None)
    params = inputs.engine_params(body, max_tokens, inputs.chat_logprobs(body), template)
    ctx = responses.ResponseContext.new(
        "chatcmpl", body.model, body.n, [len(prompt_ids)], state.token_texts, client_request_id(request, body)
    )
    ctx.prompt_logprobs = body.prompt_logprobs is not None
    ctx.ask_for_token_ids(body, [prompt_ids])
    namespace = request_namespace(caller, body.cache_salt)
    group = await submit(state, ctx, [prompt_ids], params, namespace, "messages", lora, body.priority,
                         roles.store_probe_wanted(request.headers),
                         roles.background_wanted(request.headers))
    tool_choice = effective_tool_choice(body) if body.tools else None
    calls_tools = tool_choice is not None and tool_choice != "none"
    fmt = StreamFormat(
        first_chunks=responses.chat_role_chunks,
        chunk=(ToolCallStreams(tool_choice, body.logprobs).chunk if calls_tools
               else partial(responses.chat_chunk, logprobs=body.logprobs)),
        usage_chunk=responses.chat_usage_chunk if body.include_usage else None,
    )
    final = partial(responses.chat_completion, ctx, logprobs=body.logprobs, tool_choice=tool_choice)
    return await _respond(request, state, group, ctx, fmt if body.stream else None, final, ([prompt_ids], namespace))


@router.post("/v1/completions", openapi_extra=_openapi(CompletionRequest, Completion))
async def completions(request: Request, caller: Caller) -> Response:
    state = server_state(request)
    body = await parse_body(request, CompletionRequest)
    lora = _check_request(state, body)
    inputs.check_completion_size(body, state.engine.info)
    prompts = await state.off_loop(
        inputs.completion_prompt_ids, state.engine.tokenizer, body.prompt, state.engine.info.vocab_size,
        body.add_special_tokens,
    )
    prompts = [inputs.truncated(p, body.truncate_prompt_tokens, state.engine.info) for p in prompts]
    prompt_lens = [len(p) for p in prompts]
    max_tokens = inputs.resolve_max_tokens(
        body.max_tokens, prompt_lens, state.engine.info, inputs.DEFAULT_COMPLETION_MAX_TOKENS, "prompt"
    )
    params = inputs.engine_params(body, max_tokens, body.logprobs)
    ctx = responses.ResponseContext.new("cmpl", body.model, body.n, prompt_lens, state.token_texts,
                                        client_request_id(request, body))
    ctx.prompt_logprobs = body.prompt_logprobs is not None
    ctx.ask_for_token_ids(body, prompts)
    if body.echo:
        sent = body.prompt if body.truncate_prompt_tokens is None else prompts  # truncated: echo what ran
        ctx.echo_texts = await state.off_loop(inputs.echo_texts, state.engine.tokenizer, sent, prompts)
        ctx.echo_only = body.max_tokens == 0
    namespace = request_namespace(caller, body.cache_salt)
    group = await submit(state, ctx, prompts, params, namespace, "prompt", lora, body.priority,
                         roles.store_probe_wanted(request.headers),
                         roles.background_wanted(request.headers))
    want_logprobs = body.logprobs is not None
    fmt = StreamFormat(
        first_chunks=lambda _: [],
        chunk=partial(responses.completion_chunk, logprobs=want_logprobs),
        usage_chunk=responses.completion_usage_chunk if body.include_usage else None,
        choice_opening=partial(responses.echo_chunk, logprobs=want_logprobs) if body.echo else None,
    )
    final = partial(responses.text_completion, ctx, logprobs=want_logprobs)
    return await _respond(request, state, group, ctx, fmt if body.stream else None, final, (prompts, namespace))


def _check_request(state: ServerState, body: ChatCompletionRequest | CompletionRequest) -> LoRAAdapter | None:
    """The adapter `model` names (None: the base model); 404 model_not_found for an unknown name."""
    lora = resolve_model(state, body.model)
    inputs.check_group_options(body)
    return lora


def client_request_id(request: Request, body: ChatCompletionRequest | CompletionRequest) -> str | None:
    """The caller's id for this request: the X-Request-Id header, else the body's `request_id` (vLLM's
    order); None: kvserve makes one. A header that is no such id is a 400 naming it."""
    header = request.headers.get("x-request-id")
    if header is None:
        return body.request_id
    if not 1 <= len(header) <= 256 or not re.fullmatch(CLIENT_ID_PATTERN, header):
        raise bad_request("X-Request-Id must be 1-256 characters of letters, digits and ._:@/+=-", "X-Request-Id")
    return header


def request_namespace(caller: Principal, cache_salt: str | None) -> Namespace:
    """The caller's cache namespace; a bad `cache_salt` is a 400 naming it."""
    try:
        return cache_namespace(caller, cache_salt)
    except ValueError as err:
        raise bad_request(str(err), "cache_salt") from err


async def _respond(
    request: Request, state: ServerState, group: RequestGroup, ctx: responses.ResponseContext,
    stream_format: StreamFormat | None, final: Callable[[dict[int, RequestOutput]], BaseModel],
    handoff: tuple[list[list[int]], Namespace],
) -> Response:
    """SSE when `stream_format` is given; otherwise wait for every choice and answer `final(outputs)`.
    A prefill worker (`--role prefill`) first waits for `handoff`'s prompt blocks to reach the store."""
    if stream_format is not None:
        events = sse_stream(group, ctx, stream_format, state.metrics)
        headers = {**SSE_HEADERS, "X-Request-Id": ctx.id}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    try:
        finals = await collect(group, request, state.metrics)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # pydantic's JSON writes non-finite floats as null; json.dumps would emit invalid "-Infinity".
    # Off the loop: n choices with logprobs can be megabytes of JSON.
    body = await state.off_loop(lambda: final(finals).model_dump_json())
    headers = await roles.handoff_headers(state.replica, state.engine.info.block_size, *handoff)
    return Response(body, media_type="application/json", headers={**headers, "X-Request-Id": ctx.id})
