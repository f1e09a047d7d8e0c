"""Engine outputs → OpenAI responses and stream chunks (chat and text completions), plus usage.

Each prompt is one engine request whose `completions` are its n choices: choice index
= prompt index × n + completion index.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from kvserve.engine.request import CompletionOutput, RequestOutput, TokenLogprob, vllm_logprobs
from kvserve.server.constraints import ToolChoice, parse_auto_tool_calls, tool_calls_from_text
from kvserve.server.protocol import (
    AssistantMessage,
    BeamInfo,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TokenLogprobOut,
    ToolCall,
    TopLogprob,
    Usage,
)

TokenNames = Callable[[int], str]  # token id -> how log-probs write it (TokenTexts, or token_id_text)


def token_id_text(token_id: int) -> str:
    """A token written as its id (vLLM's `return_tokens_as_token_ids`, and every token of a model without
    a tokenizer): identifies tokens whose text is not valid UTF-8 on its own."""
    return f"token_id:{token_id}"


class TokenTexts:
    """Token id → its text, cached (logprobs name every sampled and alternative token)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = (token_id_text(token_id) if self._tokenizer is None
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
    echo_texts: list[str] | None = None  # /v1/completions echo: each prompt's text, returned before its answer
    echo_only: bool = False  # echo with max_tokens 0: the generated token is not returned
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field goes into the response
    prompt_token_ids: list[list[int]] | None = None  # return_token_ids: each prompt's ids (None: not asked)
    ids_as_tokens: bool = False  # return_tokens_as_token_ids: log-prob tokens written as "token_id:N"
    prompt_ids_sent: set[int] = field(default_factory=set)  # streamed choices whose prompt ids went out
    engine_id: str = ""  # what the engine's request ids start with ("": `id`)

    @classmethod
    def new(
        cls, prefix: str, model: str, n: int, prompt_lens: list[int], token_texts: TokenTexts,
        client_id: str | None = None,
    ) -> ResponseContext:
        """`client_id` (vLLM's `request_id` / `X-Request-Id`): the response's id is `prefix-client_id`; the
        engine's ids add a random part, so equal ids from different callers never meet in the engine."""
        if client_id is None:
            return cls(f"{prefix}-{uuid.uuid4().hex}", model, n, prompt_lens, token_texts)
        context = cls(f"{prefix}-{client_id}", model, n, prompt_lens, token_texts)
        context.engine_id = f"{context.id}-{uuid.uuid4().hex[:12]}"
        return context

    @property
    def num_choices(self) -> int:
        return self.n * len(self.prompt_lens)

    def ask_for_token_ids(self, body: Any, prompts: list[list[int]]) -> None:
        """vLLM's `return_token_ids` and `return_tokens_as_token_ids`, as the request body sets them."""
        self.prompt_token_ids = prompts if body.return_token_ids else None
        self.ids_as_tokens = body.return_tokens_as_token_ids

    @property
    def logprob_texts(self) -> TokenNames:
        """How log-probs name tokens: their text, or "token_id:N" when asked."""
        return token_id_text if self.ids_as_tokens else self.token_texts

    def token_ids(self, completion: CompletionOutput, delta: bool = False) -> list[int] | None:
        """A choice's generated ids (its new ones when `delta`) when return_token_ids asks; else None."""
        if self.prompt_token_ids is None:
            return None
        if self.echo_only:
            return []
        return list(completion.delta_token_ids if delta else completion.token_ids)

    def prompt_ids_of(self, index: int, once: bool = False) -> list[int] | None:
        """Choice `index`'s prompt ids when asked; with `once` (streaming) only in its first chunk."""
        if self.prompt_token_ids is None or (once and index in self.prompt_ids_sent):
            return None
        self.prompt_ids_sent.add(index)
        return self.prompt_token_ids[index // self.n]

    def request_id(self, prompt_index: int) -> str:
        """The engine request id of one prompt (all its choices)."""
        return f"{self.engine_id or self.id}-{prompt_index}"


Choice = tuple[int, CompletionOutput]  # (choice index, completion)


def choices_of(ctx: ResponseContext, prompt_index: int, output: RequestOutput) -> list[Choice]:
    """`(choice index, completion)` for one prompt's output. A finished output with fewer than n
    completions (aborted before the samples forked or before any beam finished) is padded with empty
    ones, so every choice still ends with a finish_reason."""
    base = prompt_index * ctx.n
    completions = output.completions
    choices = [(base + c.index, c) for c in completions]
    if output.finished and len(completions) < ctx.n:
        present = {c.index for c in completions}
        reason = output.finish_reason or "abort"
        choices += [(base + i, CompletionOutput(i, "", [], reason)) for i in range(ctx.n) if i not in present]
    return choices


def final_choices(ctx: ResponseContext, finals: dict[int, RequestOutput]) -> list[Choice]:
    """Every choice of a finished HTTP request, by choice index."""
    choices = [choice for p, output in finals.items() for choice in choices_of(ctx, p, output)]
    return sorted(choices, key=lambda choice: choice[0])


def usage_of(ctx: ResponseContext, latest: dict[int, RequestOutput]) -> Usage:
    """Prompt and cached tokens count once per prompt (not per choice: its choices share one prefill);
    completion tokens are summed over the returned choices."""
    completion = 0 if ctx.echo_only else sum(len(c.token_ids) for output in latest.values() for c in output.completions)
    cached = sum(output.num_cached_tokens for output in latest.values())
    by_source: dict[str, int] = {}
    for output in latest.values():
        for source, tokens in output.cached_tokens_by_source.items():
            by_source[source] = by_source.get(source, 0) + tokens
    prompt = sum(ctx.prompt_lens)
    details = PromptTokensDetails(cached_tokens=cached, cached_tokens_by_source=by_source)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=details)


def delta_logprobs(completion: CompletionOutput) -> list[TokenLogprob]:
    """Logprobs of the tokens this output added (`delta_token_ids`)."""
    if not completion.token_logprobs or not completion.delta_token_ids:
        return []
    return completion.token_logprobs[len(completion.token_ids) - len(completion.delta_token_ids):]


def _beam_info(completion: CompletionOutput) -> BeamInfo | None:
    if completion.score is None or completion.cumulative_logprob is None:
        return None
    return BeamInfo(score=completion.score, cumulative_logprob=completion.cumulative_logprob,
                    token_ids=completion.token_ids)


# --- chat ----------------------------------------------------------------------------------------------


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenNames) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = texts(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    content = [
        TokenLogprobOut(**top(e.token_id, e.logprob).model_dump(), top_logprobs=[top(*alt) for alt in e.top])
        for e in entries
    ]
    return ChatLogprobs(content=content)


def chat_completion(
    ctx: ResponseContext, finals: dict[int, RequestOutput], logprobs: bool, tool_choice: ToolChoice | None = None
) -> ChatCompletion:
    choices = []
    for index, c in final_choices(ctx, finals):
        message, finish_reason = _assistant_message(c, tool_choice)
        choices.append(ChatChoice(
            index=index, message=message, finish_reason=finish_reason,
            logprobs=chat_logprobs(c.token_logprobs or [], ctx.logprob_texts) if logprobs else None,
            token_ids=ctx.token_ids(c),
        ))
    prompt_logprobs = prompt_logprobs_out(finals[0], ctx.token_texts) if ctx.prompt_logprobs and finals else None
    return ChatCompletion(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices,
                          usage=usage_of(ctx, finals), prompt_logprobs=prompt_logprobs,
                          prompt_token_ids=ctx.prompt_ids_of(0))


def _assistant_message(c: CompletionOutput, tool_choice: ToolChoice | None) -> tuple[AssistantMessage, str | None]:
    """The reply as text, or as OpenAI tool calls (finish_reason "tool_calls") when tools were chosen."""
    if tool_choice is None or tool_choice == "none" or c.finish_reason != "stop":
        return AssistantMessage(content=c.text), c.finish_reason
    if tool_choice == "auto":
        content, calls = parse_auto_tool_calls(c.text)
    else:
        content, calls = None, tool_calls_from_text(c.text, tool_choice)
    if not calls:
        return AssistantMessage(content=c.text), c.finish_reason
    return AssistantMessage(content=content, tool_calls=[ToolCall(**call) for call in calls]), "tool_calls"


def chat_role_chunks(ctx: ResponseContext) -> list[BaseModel]:
    """The first chunk of each choice announces the assistant role, as OpenAI's stream does."""
    return [
        ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model,
                            choices=[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))],
                            prompt_token_ids=ctx.prompt_ids_of(i, once=True))
        for i in range(ctx.num_choices)
    ]


def chat_chunk(
    ctx: ResponseContext, index: int, completion: CompletionOutput, logprobs: bool
) -> BaseModel | None:
    """A chunk with what `completion` added; None when it added nothing visible and did not finish."""
    entries = delta_logprobs(completion) if logprobs else []
    token_ids = ctx.token_ids(completion, delta=True)
    if not completion.delta_text and not entries and not token_ids and completion.finish_reason is None:
        return None
    choice = ChatChunkChoice(
        index=index, delta=ChatDelta(content=completion.delta_text), finish_reason=completion.finish_reason,
        logprobs=chat_logprobs(entries, ctx.logprob_texts) if logprobs else None, token_ids=token_ids,
    )
    return ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model, choices=[choice])


def chat_usage_chunk(ctx: ResponseContext, usage: Usage) -> BaseModel:
    return ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model, choices=[], usage=usage)


# --- text completions ----------------------------------------------------------------------------------


def completion_logprobs(
    entries: Sequence[TokenLogprob], texts: TokenNames, offset: int = 0, first_token: int | None = None
) -> CompletionLogprobs:
    """OpenAI's text-completion log-probs; `first_token`: an echoed prompt's first token, which has no
    log-prob (nothing comes before it: null, as OpenAI and vLLM write it)."""
    tokens = ([] if first_token is None else [texts(first_token)]) + [texts(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    head: list[None] = [] if first_token is None else [None]
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=head + [e.logprob for e in entries], text_offset=offsets,
        top_logprobs=head + [{texts(t): lp for t, lp in e.top} for e in entries],
    )


def text_completion(ctx: ResponseContext, finals: dict[int, RequestOutput], logprobs: bool) -> Completion:
    choices = []
    for index, c in final_choices(ctx, finals):
        output = finals[index // ctx.n]
        choice = CompletionChoice(
            index=index, text=c.text, finish_reason=c.finish_reason,
            logprobs=completion_logprobs(c.token_logprobs or [], ctx.logprob_texts) if logprobs else None,
            kvserve=_beam_info(c),
            prompt_logprobs=prompt_logprobs_out(output, ctx.token_texts) if ctx.prompt_logprobs else None,
            prompt_token_ids=ctx.prompt_ids_of(index), token_ids=ctx.token_ids(c),
        )
        if ctx.echo_texts is not None:
            _echo(ctx, choice, output, c, logprobs)
        choices.append(choice)
    return Completion(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices,
                      usage=usage_of(ctx, finals))


def _echo(ctx: ResponseContext, choice: CompletionChoice, output: RequestOutput, c: CompletionOutput,
          logprobs: bool) -> None:
    """The prompt before the answer (the answer dropped for max_tokens 0), log-probs likewise."""
    generated = [] if ctx.echo_only else (c.token_logprobs or [])
    choice.text = ctx.echo_texts[choice.index // ctx.n] + ("" if ctx.echo_only else c.text)
    if ctx.echo_only:
        choice.finish_reason = "length"
    if logprobs:
        prompt = output.prompt_token_logprobs or []
        choice.logprobs = completion_logprobs([*prompt, *generated], ctx.logprob_texts,
                                              first_token=output.prompt_token_ids[0])


def prompt_logprobs_out(output: RequestOutput, texts: TokenTexts) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` as its server writes them: None for the first token, then per token
    a dict (token id -> logprob, rank, decoded_token) of the prompt token and the top N."""
    if output.prompt_token_logprobs is None:
        return None
    entries = vllm_logprobs(output.prompt_token_logprobs, texts)
    return [None, *({str(token): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
                     for token, lp in entry.items()} for entry in entries)]


def completion_chunk(
    ctx: ResponseContext, index: int, completion: CompletionOutput, logprobs: bool
) -> BaseModel | None:
    """As `chat_chunk`; a beam-search choice comes whole in one chunk (with its `kvserve` scores). With
    echo and max_tokens 0 the generated token is not sent: only the end, as "length"."""
    entries = delta_logprobs(completion) if logprobs and not ctx.echo_only else []
    text = "" if ctx.echo_only else completion.delta_text
    finish_reason = "length" if ctx.echo_only and completion.finish_reason else completion.finish_reason
    token_ids = ctx.token_ids(completion, delta=True)
    if not text and not entries and not token_ids and finish_reason is None:
        return None
    choice = CompletionChoice(
        index=index, text=text, finish_reason=finish_reason,
        logprobs=completion_logprobs(entries, ctx.logprob_texts) if logprobs else None,
        kvserve=_beam_info(completion), prompt_token_ids=ctx.prompt_ids_of(index, once=True), token_ids=token_ids,
    )
    return Completion(id=ctx.id, created=ctx.created, model=ctx.model, choices=[choice])


def echo_chunk(ctx: ResponseContext, index: int, output: RequestOutput, logprobs: bool) -> BaseModel:
    """A streamed choice's first chunk under echo: its prompt's text (and the prompt tokens' log-probs)."""
    scored = completion_logprobs(output.prompt_token_logprobs or [], ctx.logprob_texts,
                                 first_token=output.prompt_token_ids[0]) if logprobs else None
    choice = CompletionChoice(index=index, text=ctx.echo_texts[index // ctx.n], logprobs=scored,
                              prompt_token_ids=ctx.prompt_ids_of(index, once=True))
    return Completion(id=ctx.id, created=ctx.created, model=ctx.model, choices=[choice])


def completion_usage_chunk(ctx: ResponseContext, usage: Usage) -> BaseModel:
    return Completion(id=ctx.id, created=ctx.created, model=ctx.model, choices=[], usage=usage)
