"""RequestOutputs of groups: one completion per member, each with the delta its request took."""

from __future__ import annotations

from kvserve.engine.request import CompletionOutput, Request, RequestOutput, TokenLogprob


def plain_output(request: Request) -> RequestOutput:
    """A single sequence's output now (one completion); takes its delta."""
    return _request_output(request, [member_completion(0, request)], request.is_finished)


def member_completion(index: int, request: Request) -> CompletionOutput:
    """One member's completion so far; takes its delta."""
    delta_text, delta_tokens = request.take_delta()
    return CompletionOutput(
        index=index, text=request.output_text,
        token_ids=list(request.output_token_ids),
        finish_reason=request.finish_reason.value if request.finish_reason else None,
        cumulative_logprob=request.cumulative_logprob,
        token_logprobs=None if request.logprobs is None else list(request.logprobs),
        delta_text=delta_text, delta_token_ids=delta_tokens, stop_reason=request.stop_reason,
    )


def group_output(root: Request, completions: list[CompletionOutput], finished: bool) -> RequestOutput:
    """A group's RequestOutput (`root`: the request as submitted); top-level fields mirror the first
    completion."""
    return _request_output(root, completions, finished)


def _request_output(root: Request, completions: list[CompletionOutput], finished: bool) -> RequestOutput:
    first = completions[0] if completions else CompletionOutput(0, "", [], None)
    return RequestOutput(
        request_id=root.request_id,
        prompt=root.prompt,
        prompt_token_ids=root.prompt_token_ids,
        text=first.text,
        token_ids=first.token_ids,
        finished=finished,
        finish_reason=first.finish_reason if finished else None,
        num_cached_tokens=root.num_cached_tokens,
        cached_tokens_by_source=dict(root.cached_tokens_by_source),
        metrics=root.metrics,
        logprobs=first.token_logprobs,
        delta_text=first.delta_text,
        delta_token_ids=first.delta_token_ids,
        outputs=completions,
        prompt_token_logprobs=_complete_prompt_logprobs(root),
    )


def _complete_prompt_logprobs(root: Request) -> list[TokenLogprob] | None:
    """The prompt's scores once every prompt token after the first is scored (they never change after:
    the same list each time, not a copy), else None."""
    records = root.prompt_logprobs
    if records is None or len(records) < root.num_prompt_tokens - 1:
        return None
    return records
