"""Engine outputs → OpenAI responses and stream chunks (chat and text completions), plus usage."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from kvserve.engine.request import RequestOutput, TokenLogprob
from kvserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprobOut,
    TopLogprob,
    Usage,
)


class TokenTexts:
    """Token id → its text, cached (logprobs name every sampled and alternative token)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self._tokenizer is None
                    else self._tokenizer.decode([token_id], skip_special_tokens=False))
            self._cache[token_id] = text
        return text


@dataclass(slots=True)
class ResponseContext:
    """What every response and chunk of one HTTP request shares."""

    id: str
    model: str
    n: int
    prompt_lens: list[int]
    token_texts: TokenTexts
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(
        cls, prefix: str, model: str, n: int, prompt_lens: list[int], token_texts: TokenTexts
    ) -> ResponseContext:
        return cls(f"{prefix}-{uuid.uuid4().hex}", model, n, prompt_lens, token_texts)

    @property
    def num_choices(self) -> int:
        return self.n * len(self.prompt_lens)

    def request_id(self, index: int) -> str:
        return f"{self.id}-{index}"


def usage_of(ctx: ResponseContext, latest: dict[int, RequestOutput]) -> Usage:
    """Prompt tokens count once per prompt (not per choice); cached tokens are the first choice's."""
    completion = sum(len(output.token_ids) for output in latest.values())
    first_choices = (p * ctx.n for p in range(len(ctx.prompt_lens)))
    cached = sum(latest[index].num_cached_tokens for index in first_choices if index in latest)
    prompt = sum(ctx.prompt_lens)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def delta_logprobs(output: RequestOutput) -> list[TokenLogprob]:
    """Logprobs of the tokens this output added (`delta_token_ids`)."""
    if not output.logprobs or not output.delta_token_ids:
        return []
    return output.logprobs[len(output.token_ids) - len(output.delta_token_ids):]


# --- chat ----------------------------------------------------------------------------------------------


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = texts(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    content = [
        TokenLogprobOut(**top(e.token_id, e.logprob).model_dump(), top_logprobs=[top(*alt) for alt in e.top])
        for e in entries
    ]
    return ChatLogprobs(content=content)


def chat_completion(ctx: ResponseContext, finals: dict[int, RequestOutput], logprobs: bool) -> ChatCompletion:
    choices = [
        ChatChoice(
            index=index, message=AssistantMessage(content=output.text), finish_reason=output.finish_reason,
            logprobs=chat_logprobs(output.logprobs or [], ctx.token_texts) if logprobs else None,
        )
        for index, output in sorted(finals.items())
    ]
    return ChatCompletion(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices,
                          usage=usage_of(ctx, finals))


def chat_role_chunks(ctx: ResponseContext) -> list[BaseModel]:
    """The first chunk of each choice announces the assistant role, as OpenAI's stream does."""
    return [
        ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model,
                            choices=[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
        for i in range(ctx.num_choices)
    ]


def chat_chunk(ctx: ResponseContext, index: int, output: RequestOutput, logprobs: bool) -> BaseModel | None:
    """A chunk with what `output` added; None when it added nothing visible and did not finish."""
    entries = delta_logprobs(output) if logprobs else []
    if not output.delta_text and not entries and not output.finished:
        return None
    choice = ChatChunkChoice(
        index=index, delta=ChatDelta(content=output.delta_text), finish_reason=output.finish_reason,
        logprobs=chat_logprobs(entries, ctx.token_texts) if logprobs else None,
    )
    return ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model, choices=[choice])


def chat_usage_chunk(ctx: ResponseContext, usage: Usage) -> BaseModel:
    return ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model, choices=[], usage=usage)


# --- text completions ----------------------------------------------------------------------------------


def completion_logprobs(
    entries: Sequence[TokenLogprob], texts: TokenTexts, offset: int = 0
) -> CompletionLogprobs:
    tokens = [texts(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[e.logprob for e in entries], text_offset=offsets,
        top_logprobs=[{texts(t): lp for t, lp in e.top} for e in entries],
    )


def text_completion(ctx: ResponseContext, finals: dict[int, RequestOutput], logprobs: bool) -> Completion:
    choices = [
        CompletionChoice(
            index=index, text=output.text, finish_reason=output.finish_reason,
            logprobs=completion_logprobs(output.logprobs or [], ctx.token_texts) if logprobs else None,
        )
        for index, output in sorted(finals.items())
    ]
    return Completion(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices,
                      usage=usage_of(ctx, finals))


def completion_chunk(
    ctx: ResponseContext, index: int, output: RequestOutput, logprobs: bool
) -> BaseModel | None:
    entries = delta_logprobs(output) if logprobs else []
    if not output.delta_text and not entries and not output.finished:
        return None
    choice = CompletionChoice(
        index=index, text=output.delta_text, finish_reason=output.finish_reason,
        logprobs=completion_logprobs(entries, ctx.token_texts) if logprobs else None,
    )
    return Completion(id=ctx.id, created=ctx.created, model=ctx.model, choices=[choice])


def completion_usage_chunk(ctx: ResponseContext, usage: Usage) -> BaseModel:
    return Completion(id=ctx.id, created=ctx.created, model=ctx.model, choices=[], usage=usage)
