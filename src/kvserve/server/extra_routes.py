"""vLLM's utility routes: `/tokenize`, `/detokenize`, `/version`, `/ping`, `/v1/models/{id}`.

Request and response shapes are vLLM's (`TokenizeCompletionRequest` / `TokenizeChatRequest`,
`TokenizeResponse`, `DetokenizeRequest`, `DetokenizeResponse`); fields kvserve does not implement
(`tools`, `mm_processor_kwargs`, ...) are refused with a 400 naming them, never ignored.
`/tokenize` counts exactly what `/v1/completions` and `/v1/chat/completions` would prefill: a prompt
without added special tokens, a conversation rendered by the chat template (`--chat-template` if given).
"""

from __future__ import annotations

from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from kvserve import __version__
from kvserve.server.errors import ApiError, bad_request
from kvserve.server.limits import max_prompt_bytes
from kvserve.server.lora_routes import lora_model_cards
from kvserve.server.protocol import ChatMessage, ModelCard
from kvserve.server.state import Caller, ServerState, parse_body, server_state

router = APIRouter()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeRequest(_Strict):
    """vLLM's two tokenize shapes in one model: exactly one of `prompt` or `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False  # as the generation routes, which add none (vLLM: True for a prompt)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize")
async def tokenize(request: Request, _: Caller) -> JSONResponse:
    state = server_state(request)
    body = await parse_body(request, TokenizeRequest)
    _check_model(state, body.model)
    tokenizer = _tokenizer(state)
    text = await state.off_loop(_text_of, tokenizer, body)
    limit = max_prompt_bytes(state.engine.info.max_model_len)
    if len(text.encode("utf-8", "surrogatepass")) > limit:
        raise bad_request(f"the text is longer than {limit} bytes, more than this model's context could hold",
                          "prompt" if body.prompt is not None else "messages")
    ids = await state.off_loop(tokenizer.encode, text, body.add_special_tokens)
    strs = [state.token_texts(token_id) for token_id in ids] if body.return_token_strs else None
    response = TokenizeResponse(count=len(ids), max_model_len=state.engine.info.max_model_len, tokens=ids,
                                token_strs=strs)
    return JSONResponse(response.model_dump(exclude_none=True))


@router.post("/detokenize")
async def detokenize(request: Request, _: Caller) -> JSONResponse:
    state = server_state(request)
    body = await parse_body(request, DetokenizeRequest)
    _check_model(state, body.model)
    vocab_size = state.engine.info.vocab_size
    bad = next((token for token in body.tokens if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab_size})", "tokens")
    text = await state.off_loop(_tokenizer(state).decode, body.tokens, False)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    """SageMaker-style liveness (as vLLM): 200 while the engine runs, 503 otherwise."""
    return Response(status_code=200 if server_state(request).engine.is_alive else 503)


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request, _: Caller) -> JSONResponse:
    state = server_state(request)
    adapters = {card.id: card for card in lora_model_cards(state)}
    if model_id in adapters:
        return JSONResponse(adapters[model_id].model_dump())
    _check_model(state, model_id)
    card = ModelCard(id=model_id, created=0, max_model_len=state.engine.info.max_model_len)
    return JSONResponse(card.model_dump())


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name not in state.model_names and name not in state.lora_adapters:
        raise ApiError(404, f"model {name!r} does not exist; this server serves {list(state.model_names)}",
                       "model", "model_not_found")


def _tokenizer(state: ServerState) -> Any:
    if state.engine.tokenizer is None:
        raise bad_request("this model has no tokenizer", "model")
    return state.engine.tokenizer


def _text_of(tokenizer: Any, body: TokenizeRequest) -> str:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.prompt is not None:
        return body.prompt
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt exclude each other",
                          "continue_final_message")
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template", "messages")
    conversation = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages or []]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=body.add_generation_prompt)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as err:
        raise bad_request(f"messages cannot be rendered by the chat template: {err}", "messages") from err
    if body.continue_final_message and conversation:
        text = _cut_after_final_message(text, conversation[-1]["content"])
    return text


def _cut_after_final_message(text: str, final: str) -> str:
    """Leave the last message open (vLLM's continue_final_message): drop what the template closed it with."""
    end = text.rfind(final)
    if end < 0 or not final:
        raise bad_request("continue_final_message: the final message is not in the rendered prompt", "messages")
    return text[: end + len(final)]
