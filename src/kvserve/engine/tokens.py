"""Appending a sampled token: log-probs, incremental text, and the stop checks that may end a request."""

from __future__ import annotations

from kvserve.engine.detokenizer import append_new_text, find_stop_string
from kvserve.engine.request import FinishReason, Request, TokenLogprob
from kvserve.model.tokenizer import Tokenizer


def append_sampled_token(
    request: Request, token_id: int, logprob: TokenLogprob | None, now: float,
    tokenizer: Tokenizer | None, max_model_len: int,
) -> FinishReason | None:
    """Append the token (and its log-prob); returns why the request stops now, or None.

    Before `min_tokens` outputs no stop string counts (EOS and stop ids were masked by the sampler).
    A stop string or stop token id is kept in `request.stop_reason`."""
    request.append_token(token_id)
    if request.grammar is not None:
        request.grammar.accept(token_id)
    if request.metrics.first_token_time is None:
        request.metrics.first_token_time = now
    if logprob is not None and request.logprobs is not None:
        request.logprobs.append(logprob)
    if _update_text(request, tokenizer):
        return FinishReason.STOP
    return _stop_reason(request, token_id, max_model_len)


def _update_text(request: Request, tokenizer: Tokenizer | None) -> bool:
    """Extend the output text; True (and text truncated) when a stop string appeared."""
    if tokenizer is None:
        return False
    params = request.params
    previous_length = len(request.output_text)
    request.output_text += append_new_text(
        tokenizer, request.output_token_ids, request.detokenizer, params.skip_special_tokens
    )
    if not params.stop or request.num_output_tokens < params.min_tokens:
        return False
    index = find_stop_string(request.output_text, params.stop, previous_length)
    if index is None:
        return False
    found = next(s for s in params.stop if request.output_text.startswith(s, index))
    request.stop_reason = found
    end = index + len(found) if params.include_stop_str_in_output else index
    request.output_text = request.output_text[:end]
    return True


def _stop_reason(request: Request, token_id: int, max_model_len: int) -> FinishReason | None:
    params = request.params
    if not params.ignore_eos and token_id in request.eos_token_ids:
        return FinishReason.STOP
    if token_id in params.stop_token_ids:
        request.stop_reason = token_id
        return FinishReason.STOP
    if request.grammar is not None and request.grammar.is_terminated:
        return FinishReason.STOP
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
