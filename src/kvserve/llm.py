"""LLM: the offline Python API over one engine, with vLLM's signatures.

A vLLM user's script runs after changing its import: `generate(prompts, sampling_params, use_tqdm=)`
with strings, token-id lists or `{"prompt": ...}` / `{"prompt_token_ids": ...}` dicts; `chat(...)`;
`beam_search(prompts, BeamSearchParams(...))`; `get_tokenizer()`; every output's `outputs` a list of
`CompletionOutput` with vLLM's `logprobs` shape. kvserve's extras stay: `cache_salt`, `stream`,
`stats`, and the top-level `text` / `token_ids` / `num_cached_tokens` of each RequestOutput.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from tqdm import tqdm

from kvserve.engine.engine import LLMEngine
from kvserve.engine.params import BeamSearchParams, SamplingParams
from kvserve.engine.request import Request, RequestOutput, vllm_logprobs
from kvserve.engine_args import engine_config
from kvserve.lora.adapter import LoRAAdapter, LoRARequest
from kvserve.model.tokenizer import Tokenizer
from kvserve.prefix.namespace import make_namespace

Prompt = str | Sequence[int] | Mapping[str, Any]
Message = dict[str, Any]
PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


class LLM:
    """``LLM(model="smollm2-135m", **engine_args)``; engine_args are `EngineConfig` fields or vLLM's
    engine-argument names (engine_args.py)."""

    def __init__(self, model: str = "smollm2-135m", progress: bool = True, **engine_args: Any) -> None:
        self.engine = LLMEngine(engine_config(model, engine_args), progress=progress)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        return self.tokenizer

    def generate(
        self, prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None, *, use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs in input order.

        `sampling_params` is one SamplingParams for all prompts or one per prompt; `lora_request` likewise one
        adapter (or None: the base model) for all or one per prompt (needs `enable_lora=True`); `priority`
        one int per prompt, lower first (vLLM's; needs `schedule_policy="priority"`). All prompts are validated
        before any is queued, so one bad prompt queues nothing.
        """
        prompt_list = _as_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompt_list)
        if len(sampling_params) != len(prompt_list):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompt_list)} prompts")
        adapters = [self.engine.resolve_lora(lora) for lora in _per_prompt_lora(lora_request, len(prompt_list))]
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        requests = [self._make_request(prompt, p, cache_salt, adapter, rank) for prompt, p, adapter, rank
                    in zip(prompt_list, sampling_params, adapters, priorities, strict=True)]
        return self._run_to_completion(requests, use_tqdm)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams | int | None = None,
        max_tokens: int = 16, length_penalty: float = 1.0, early_stopping: bool | str = False,
        num_return_sequences: int | None = None, cache_salt: str | None = None,
        use_tqdm: bool | Callable[..., tqdm] = False, *, beam_width: int | None = None,
    ) -> list[RequestOutput]:
        """Beam search over every prompt, as vLLM's `beam_search(prompts, BeamSearchParams(...))`
        (kvserve's older form `beam_search(prompts, beam_width, max_tokens, ...)` still works); scored
        as Hugging Face `generate(num_beams=beam_width, do_sample=False, ...)`.

        Each output's `outputs` (alias `sequences`) holds `num_return_sequences` (default beam_width)
        hypotheses, best first, with `score` = cumulative_logprob / len(token_ids) ** length_penalty.
        """
        if not isinstance(params, BeamSearchParams):
            if (params is None) == (beam_width is None):
                raise TypeError("beam_search needs BeamSearchParams (or beam_width, kvserve's older form)")
            params = BeamSearchParams(
                beam_width=params if beam_width is None else beam_width, max_tokens=max_tokens,
                length_penalty=length_penalty,
                early_stopping=early_stopping, num_return_sequences=num_return_sequences,
            )
        requests = [self._make_request(p, params, cache_salt) for p in _as_list(prompts)]
        return self._run_to_completion(requests, use_tqdm)

    def chat(
        self, messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True, *, chat_template: str | None = None,
        add_generation_prompt: bool = True, continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of messages) or to several (a list of such lists)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        prompts = [self.render_chat(c, chat_template, add_generation_prompt, continue_final_message, **extra)
                   for c in conversations]
        return self.generate(prompts, sampling_params, cache_salt, use_tqdm=use_tqdm, lora_request=lora_request)

    def render_chat(
        self, messages: list[Message], chat_template: str | None = None, add_generation_prompt: bool = True,
        continue_final_message: bool = False, **template_kwargs: Any,
    ) -> list[int]:
        """Chat template → token ids (special tokens in the template stay special)."""
        tokenizer = self.get_tokenizer()
        if not messages:
            raise ValueError("messages is empty")
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            **template_kwargs,
        )
        if continue_final_message:  # end the prompt inside the last message, as transformers does
            last = messages[-1].get("content")
            if not isinstance(last, str) or not last or last not in text:
                raise ValueError("continue_final_message needs a last message with text content")
            text = text[: text.rindex(last) + len(last)]
        return tokenizer.encode(text)

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, cache_salt: str | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's output after every new token (`delta_text` holds the new text).

        Closing the iterator early aborts the request and frees its blocks.
        """
        request = self._make_request(prompt, params, cache_salt)
        self.engine.add(request)
        finished = False
        try:
            while not finished:
                for output in self.engine.step():
                    if output.request_id == request.request_id:
                        finished = output.finished
                        yield self._with_vllm_logprobs(output)
        finally:
            if not finished:
                self.engine.abort_request(request.request_id)

    def stats(self) -> dict[str, float | int]:
        return self.engine.stats()

    def reset_prefix_cache(self, tiers: bool = False) -> bool:
        """Drop every cached block (with `tiers`, the host and disk tiers' too); False while blocks are in use."""
        return self.engine.reset_prefix_cache(tiers)

    def _make_request(
        self, prompt: Prompt, params: SamplingParams | BeamSearchParams | None, cache_salt: str | None,
        lora: LoRAAdapter | None = None, priority: int = 0,
    ) -> Request:
        if isinstance(prompt, Mapping):
            unknown = set(prompt) - PROMPT_KEYS
            if unknown:
                raise ValueError(f"prompt dict keys {sorted(unknown)} are not supported (known: "
                                 f"{sorted(PROMPT_KEYS)})")
            if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
            cache_salt = prompt.get("cache_salt", cache_salt)
            prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
        return self.engine.make_request(prompt, params, namespace=make_namespace(cache_salt), lora=lora,
                                        priority=priority)

    def _with_vllm_logprobs(self, output: RequestOutput) -> RequestOutput:
        """Fill each completion's vLLM-shaped `logprobs`, and the prompt's (decoded tokens included)."""
        tokenizer = self.tokenizer
        decode = None if tokenizer is None else (lambda token: tokenizer.decode([token], False))
        for completion in output.outputs:
            if completion.token_logprobs is not None:
                completion.logprobs = vllm_logprobs(completion.token_logprobs, decode)
        if output.prompt_token_logprobs is not None:  # vLLM: None for the first prompt token
            output.prompt_logprobs = [None, *vllm_logprobs(output.prompt_token_logprobs, decode)]
        return output

    def _run_to_completion(
        self, requests: list[Request], use_tqdm: bool | Callable[..., tqdm]
    ) -> list[RequestOutput]:
        for request in requests:
            self.engine.add(request)
        pending = {request.request_id for request in requests}
        results: dict[str, RequestOutput] = {}
        bar = use_tqdm if callable(use_tqdm) else tqdm
        with bar(total=len(requests), disable=not use_tqdm, desc="Processed prompts") as progress:
            try:
                while pending:
                    for output in self.engine.step():
                        if output.finished and output.request_id in pending:
                            pending.discard(output.request_id)
                            results[output.request_id] = self._with_vllm_logprobs(output)
                            progress.update(1)
            finally:
                for request_id in pending:  # interrupted: leave nothing behind
                    self.engine.abort_request(request_id)
        return [results[request.request_id] for request in requests]


def _per_prompt_lora(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} LoRA requests for {count} prompts")
    return loras


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    return list(prompts)
