"""What the router routes on: a request's prompt tokens and its tenant namespace.

The namespace is derived exactly as the server derives it (`server.auth.cache_namespace`): with the
workers' API key file the router looks the key up (by digest) to find the tenant; without one, the
workers run single-tenant and only `cache_salt` separates namespaces. The router must be given the
same key file as the workers: without it every tenant would look alike to the router, and
`cache_aware` could steer tenant B toward the replica warm with tenant A's identical prompt.

Prompts are tokenized as the worker will tokenize them (the chat template for chat requests), with
the model's tokenizer only -- no weights. Without a tokenizer, text prompts are keyed by their code
points (SGLang's router works on characters): good enough for an approximate tree, useless for the
exact block hashes of `kv_events`, which then falls back to load.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvserve.model.tokenizer import Tokenizer
from kvserve.server.auth import SINGLE_TENANT, ApiKeys, Principal, cache_namespace
from kvserve.server.errors import ApiError
from kvserve.server.inputs import chat_prompt_ids
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage
from kvserve.server.responses_api.convert import chat_request
from kvserve.server.responses_api.protocol import ResponsesRequest

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"


@dataclass(frozen=True, slots=True)
class RouteKey:
    """`tokens` None: the prompt could not be keyed (bad body, unknown key); route by load alone.
    `exact`: the tokens are the worker's own token ids (block hashes can be recomputed from them)."""

    tokens: tuple[int, ...] | None
    namespace: tuple[str, ...] | None
    exact: bool = False

    @property
    def usable(self) -> bool:
        return self.tokens is not None and self.namespace is not None and len(self.tokens) > 0


UNKEYED = RouteKey(tokens=None, namespace=None)


def namespace_marker(namespace: tuple[str, ...]) -> int:
    """A negative int naming the namespace: it starts every tree key, so tenants share no path."""
    digest = hashlib.sha256("\x1f".join(("ns", *namespace)).encode("utf-8")).digest()
    return -1 - int.from_bytes(digest[:8], "little")


class RequestKeyer:
    """Turn an OpenAI request body (already parsed JSON) + its Authorization header into a RouteKey."""

    def __init__(self, tokenizer: Tokenizer | None, api_keys: ApiKeys | None) -> None:
        self.tokenizer = tokenizer
        self.api_keys = api_keys

    def key(self, path: str, body: Any, authorization: str | None) -> RouteKey:
        if not isinstance(body, dict):
            return UNKEYED
        namespace = self._namespace(body.get("cache_salt"), authorization)
        if namespace is None:
            return UNKEYED
        tokens, exact = self._tokens(path, body)
        truncate = body.get("truncate_prompt_tokens")
        if tokens is not None and type(truncate) is int and truncate >= 1:
            tokens = tokens[-truncate:]  # what the worker keeps (vLLM's left truncation); -1 needs its context
        return RouteKey(tokens=tokens, namespace=namespace, exact=exact)

    def _namespace(self, cache_salt: Any, authorization: str | None) -> tuple[str, ...] | None:
        principal = self._principal(authorization)
        if principal is None or not (cache_salt is None or isinstance(cache_salt, str)):
            return None
        try:
            return cache_namespace(principal, cache_salt)
        except ValueError:
            return None  # the worker answers the 400

    def _principal(self, authorization: str | None) -> Principal | None:
        if self.api_keys is None:
            return SINGLE_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None  # the worker answers the 401
        return self.api_keys.lookup(key.strip())

    def _tokens(self, path: str, body: dict) -> tuple[tuple[int, ...] | None, bool]:
        if path == CHAT_PATH:
            return self._chat_tokens(body)
        if path == RESPONSES_PATH:
            return self._responses_tokens(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return tuple(prompt), True
        if isinstance(prompt, str) and prompt:
            if self.tokenizer is not None:  # as the worker will (a BOS with add_special_tokens, vLLM's field)
                return tuple(self.tokenizer.encode(prompt, body.get("add_special_tokens") is True)), True
            return tuple(ord(char) for char in prompt), False
        return None, False

    def _chat_tokens(self, body: dict) -> tuple[tuple[int, ...] | None, bool]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None, False
        try:
            parsed = [ChatMessage.model_validate(message) for message in messages]
        except ValidationError:
            return None, False
        if self._renders(body.get("chat_template")):
            try:
                return self._rendered(ChatCompletionRequest.model_validate(body))
            except ValidationError:
                return None, False
        return _code_points(parsed), False

    def _responses_tokens(self, body: dict) -> tuple[tuple[int, ...] | None, bool]:
        """A new response's prompt as the worker renders it (the chat request it amounts to). A continued
        one is not keyed: its history lives on the worker that holds it (affinity.py sends it there)."""
        if body.get("previous_response_id") is not None:
            return None, False
        try:
            chat = chat_request(ResponsesRequest.model_validate(body), [], None)
        except ValidationError:
            return None, False
        if self._renders(chat.chat_template):
            return self._rendered(chat)
        return _code_points(chat.messages), False

    def _renders(self, chat_template: object) -> bool:
        return self.tokenizer is not None and bool(self.tokenizer.chat_template or chat_template)

    def _rendered(self, chat: ChatCompletionRequest) -> tuple[tuple[int, ...] | None, bool]:
        """Rendered exactly as the worker renders it (template, tools, template kwargs)."""
        try:
            return tuple(chat_prompt_ids(self.tokenizer, chat)), True
        except ApiError:
            return None, False


def _code_points(messages: list[ChatMessage]) -> tuple[int, ...]:
    """Without a tokenizer: the conversation's text by code points (good enough for the approximate tree)."""
    return tuple(ord(char) for char in "\x1e".join(f"{m.role}\x1f{m.text()}" for m in messages))


def load_tokenizer(model: str) -> Tokenizer | None:
    """The model's tokenizer without its weights: GGUF metadata, or a HF directory's tokenizer.json."""
    from kvserve.model.gguf import open_gguf, read_metadata
    from kvserve.model.registry import resolve_model

    path = Path(resolve_model(model))
    if path.suffix == ".gguf":
        metadata = read_metadata(open_gguf(path))
        if "tokenizer.ggml.model" not in metadata:
            return None
        return Tokenizer.from_gguf_metadata(metadata)
    return Tokenizer.from_pretrained_dir(path)
