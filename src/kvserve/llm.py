"""LLM: the offline Python API over one engine."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.params import BeamSearchParams, SamplingParams
from kvserve.engine.request import Request, RequestOutput
from kvserve.lora.adapter import LoRARequest
from kvserve.prefix.namespace import make_namespace

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    """``LLM(model="smollm2-135m", **engine_args)``; engine_args are `EngineConfig` fields."""

    def __init__(self, model: str = "smollm2-135m", progress: bool = True, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), progress=progress)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self, prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None, use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs in input order.

        `params` is one SamplingParams for all prompts or one per prompt; `lora_request` likewise one
        adapter (or None: the base model) for all or one per prompt (needs `enable_lora=True`). All
        prompts are validated before any is queued, so one bad prompt queues nothing.
        """
        prompt_list = _as_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompt_list)
        if len(params) != len(prompt_list):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompt_list)} prompts")
        namespace = make_namespace(cache_salt)
        adapters = [self.engine.resolve_lora(lora) for lora in _per_prompt_lora(lora_request, len(prompt_list))]
        requests = [
            self.engine.make_request(prompt, p, namespace=namespace, lora=adapter)
            for prompt, p, adapter in zip(prompt_list, params, adapters, strict=True)
        ]
        return self._run_to_completion(requests, use_tqdm)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], beam_width: int, max_tokens: int,
        length_penalty: float = 1.0, early_stopping: bool | str = False,
        num_return_sequences: int | None = None, cache_salt: str | None = None, use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Beam search over every prompt, as Hugging Face `generate(num_beams=beam_width,
        do_sample=False, length_penalty=..., early_stopping=...)`; outputs in input order.

        Each output's `outputs` holds `num_return_sequences` (default beam_width) hypotheses, best
        first, with `score` = cumulative_logprob / len(token_ids) ** length_penalty.
        """
        params = BeamSearchParams(
            beam_width, max_tokens, length_penalty, early_stopping, num_return_sequences
        )
        namespace = make_namespace(cache_salt)
        requests = [self.engine.make_request(p, params, namespace=namespace) for p in _as_list(prompts)]
        return self._run_to_completion(requests, use_tqdm)

    def chat(
        self, messages: list[Message] | list[list[Message]], params: SamplingParams | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of messages) or to several (a list of such lists)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate(
            [self.render_chat(c) for c in conversations], params, cache_salt, lora_request=lora_request
        )

    def render_chat(self, messages: list[Message]) -> list[int]:
        """Chat template → token ids (special tokens in the template stay special)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer or chat template")
        if not messages:
            raise ValueError("messages is empty")
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, cache_salt: str | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's output after every new token (`delta_text` holds the new text).

        Closing the iterator early aborts the request and frees its blocks.
        """
        request = self.engine.make_request(prompt, params, namespace=make_namespace(cache_salt))
        self.engine.add(request)
        finished = False
        try:
            while not finished:
                for output in self.engine.step():
                    if output.request_id == request.request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.engine.abort_request(request.request_id)

    def stats(self) -> dict[str, float | int]:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def _run_to_completion(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        for request in requests:
            self.engine.add(request)
        pending = {request.request_id for request in requests}
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), disable=not use_tqdm, desc="generate") as progress:
            try:
                while pending:
                    for output in self.engine.step():
                        if output.finished and output.request_id in pending:
                            pending.discard(output.request_id)
                            results[output.request_id] = output
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
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    return list(prompts)
