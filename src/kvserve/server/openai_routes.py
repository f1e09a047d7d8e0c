"""OpenAI-compatible routes: chat completions, text completions, models."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from kvserve.engine.request import RequestOutput
from kvserve.lora.adapter import LoRAAdapter
from kvserve.prefix.namespace import Namespace
from kvserve.server import inputs, responses
from kvserve.server.auth import Principal, cache_namespace
from kvserve.server.errors import bad_request
from kvserve.server.generation import ClientDisconnected, StreamFormat, collect, sse_stream, submit
from kvserve.server.lora_routes import lora_model_cards, resolve_model
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from kvserve.server.state import CLIENT_CLOSED_REQUEST, Caller, ServerState, parse_body, server_state
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


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, caller: Caller) -> Response:
    state = server_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    lora = _check_request(state, body)
    inputs.check_chat_size(body.messages, state.engine.info)
    prompt_ids = await state.off_loop(inputs.chat_prompt_ids, state.engine.tokenizer, body.messages)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = inputs.resolve_max_tokens(requested, [len(prompt_ids)], state.engine.info, None, "messages")
    params = inputs.engine_params(body, max_tokens, inputs.chat_logprobs(body))
    ctx = responses.ResponseContext.new(
        "chatcmpl", body.model, body.n, [len(prompt_ids)], state.token_texts
    )
    group = await submit(state, ctx, [prompt_ids], params, _namespace(caller, body.cache_salt), "messages", lora)
    fmt = StreamFormat(
        first_chunks=responses.chat_role_chunks,
        chunk=partial(responses.chat_chunk, logprobs=body.logprobs),
        usage_chunk=responses.chat_usage_chunk if body.include_usage else None,
    )
    final = partial(responses.chat_completion, ctx, logprobs=body.logprobs)
    return await _respond(request, state, group, ctx, fmt if body.stream else None, final)


@router.post("/v1/completions")
async def completions(request: Request, caller: Caller) -> Response:
    state = server_state(request)
    body = await parse_body(request, CompletionRequest)
    lora = _check_request(state, body)
    inputs.check_completion_size(body, state.engine.info)
    prompts = await state.off_loop(
        inputs.completion_prompt_ids, state.engine.tokenizer, body.prompt, state.engine.info.vocab_size
    )
    prompt_lens = [len(p) for p in prompts]
    max_tokens = inputs.resolve_max_tokens(
        body.max_tokens, prompt_lens, state.engine.info, inputs.DEFAULT_COMPLETION_MAX_TOKENS, "prompt"
    )
    params = inputs.engine_params(body, max_tokens, body.logprobs)
    ctx = responses.ResponseContext.new("cmpl", body.model, body.n, prompt_lens, state.token_texts)
    group = await submit(state, ctx, prompts, params, _namespace(caller, body.cache_salt), "prompt", lora)
    want_logprobs = body.logprobs is not None
    fmt = StreamFormat(
        first_chunks=lambda _: [],
        chunk=partial(responses.completion_chunk, logprobs=want_logprobs),
        usage_chunk=responses.completion_usage_chunk if body.include_usage else None,
    )
    final = partial(responses.text_completion, ctx, logprobs=want_logprobs)
    return await _respond(request, state, group, ctx, fmt if body.stream else None, final)


def _check_request(state: ServerState, body: ChatCompletionRequest | CompletionRequest) -> LoRAAdapter | None:
    """The adapter `model` names (None: the base model); 404 model_not_found for an unknown name."""
    lora = resolve_model(state, body.model)
    inputs.reject_unsupported(body)
    inputs.check_group_options(body)
    return lora


def _namespace(caller: Principal, cache_salt: str | None) -> Namespace:
    try:
        return cache_namespace(caller, cache_salt)
    except ValueError as err:
        raise bad_request(str(err), "cache_salt") from err


async def _respond(
    request: Request, state: ServerState, group: RequestGroup, ctx: responses.ResponseContext,
    stream_format: StreamFormat | None, final: Callable[[dict[int, RequestOutput]], BaseModel],
) -> Response:
    """SSE when `stream_format` is given; otherwise wait for every choice and answer `final(outputs)`."""
    if stream_format is not None:
        events = sse_stream(group, ctx, stream_format, state.metrics)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        finals = await collect(group, request, state.metrics)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # pydantic's JSON writes non-finite floats as null; json.dumps would emit invalid "-Infinity".
    # Off the loop: n choices with logprobs can be megabytes of JSON.
    body = await state.off_loop(lambda: final(finals).model_dump_json())
    return Response(body, media_type="application/json")
