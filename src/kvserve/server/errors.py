"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx for caller mistakes.

Every route raises `ApiError`; the handlers installed here turn it (and FastAPI's / Starlette's own
errors) into that body, so a caller never sees a bare 500 for bad input.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.server.request_fields import CHAT, COMPLETION, RESPONSES

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # seconds, on every 429 / 503

# Leading words of engine ValueErrors -> the request field they are about.
_PARAM_OF_ENGINE_FIELD = {
    "max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "logprobs": "logprobs", "stop": "stop", "prompt": "prompt", "request": "max_tokens",
    "cache_salt": "cache_salt", "n": "n", "best_of": "best_of", "beam_width": "beam_width",
    "length_penalty": "length_penalty", "early_stopping": "early_stopping", "num_return_sequences": "n",
    "logit_bias": "logit_bias", "min_tokens": "min_tokens",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "structured_outputs": "structured_outputs",
    "seed": "seed", "stop_token_ids": "stop_token_ids", "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words", "truncate_prompt_tokens": "truncate_prompt_tokens", "priority": "priority",
}


class ApiError(Exception):
    """An error answered to the caller as an OpenAI error body with `status`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())

    def headers(self) -> dict[str, str] | None:
        """401 names the scheme; 429 and 503 say when to come back (clients and proxies back off)."""
        if self.status == 401:
            return {"WWW-Authenticate": "Bearer"}
        if self.status in (429, 503):
            return {"Retry-After": str(RETRY_AFTER_S)}
        return None


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def from_engine_value_error(err: ValueError, prompt_param: str = "prompt") -> ApiError:
    """A 400 for an engine validation error, naming the field its message starts with."""
    message = str(err)
    first_word = message.split(" ", 1)[0].rstrip(":")
    param = _PARAM_OF_ENGINE_FIELD.get(first_word)
    if param == "prompt":
        param = prompt_param
    return bad_request(message, param)


def from_validation_error(err: ValidationError | RequestValidationError) -> ApiError:
    """A 400 naming the first offending field of a pydantic error (e.g. `max_tokens`).

    A value matching no shape of a union field reads "messages[0].content: expected a string or a list
    of content parts, got an integer" rather than one line per rejected shape.
    """
    errors = [{**e, "loc": tuple(p for p in e.get("loc", ()) if p != "body")} for e in err.errors()]
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = first["loc"]
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    if not loc:
        return bad_request(f"request body must be a JSON object: {first.get('msg')}")
    param = str(loc[0])
    if first.get("type") == "extra_forbidden":
        return bad_request(unsupported_field_message(loc), param)
    union = _union_error(errors)
    if union is not None:
        return bad_request(union, param)
    message = f"{_format_loc(list(loc))}: {first.get('msg')}"
    if str(first.get("type", "")).endswith("_type"):
        message += f", got {_describe(first.get('input'))}"
    return bad_request(message, param)


_SHAPES = {
    "str": "a string", "list[TextPart]": "a list of content parts", "list[str]": "a list of strings",
    "list[int]": "a list of token ids", "list[list[int]]": "a list of token-id lists", "int": "an integer",
    "float": "a number", "bool": "true or false", "literal['never']": '"never"', "none": "null",
}


def _union_error(errors: list[dict]) -> str | None:
    """One readable line when the first error's field is a union that rejected every shape."""
    first_loc = errors[0]["loc"]
    same_field = [e["loc"] for e in errors if e["loc"][:1] == first_loc[:1]]
    if len(same_field) < 2:
        return None
    prefix = _common_prefix(same_field)
    shapes = [loc[len(prefix)] for loc in same_field if len(loc) > len(prefix)]
    if len(set(shapes)) < 2 or not all(isinstance(shape, str) for shape in shapes):
        return None
    value = next((e.get("input") for e in errors if e["loc"] == (*prefix, shapes[0])), errors[0].get("input"))
    names = [_SHAPES.get(shape, shape) for shape in dict.fromkeys(shapes)]
    expected = names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" or {names[-1]}"
    return f"{_format_loc(list(prefix))}: expected {expected}, got {_describe(value)}"


def _common_prefix(locs: list[tuple]) -> tuple:
    prefix = locs[0]
    for loc in locs[1:]:
        size = 0
        while size < min(len(prefix), len(loc)) and prefix[size] == loc[size]:
            size += 1
        prefix = prefix[:size]
    return prefix


def _describe(value: object) -> str:
    """The JSON type of a rejected value, in words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return f"a list containing {_describe(value[0])}" if value else "an empty list"
    return "an object"


def unsupported_field_message(loc: list) -> str:
    """Why a field the request model lacks is refused (request_fields.py), or that it is unknown."""
    name = str(loc[-1])
    refused = CHAT.get(name) or COMPLETION.get(name) or RESPONSES.get(name) if len(loc) == 1 else None
    if refused is not None:
        return f"{name} is not supported: {refused.reason}"
    return f"{_format_loc(list(loc))} is not supported: unknown field"


def _format_loc(loc: list) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through the OpenAI error body."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return ApiError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return ApiError(500, "internal server error", type_="server_error").response()
