"""LLMEngine.step(): schedule → batch → model → sample → publish blocks → report outputs.

Parallel-sampling (n / best_of) and beam-search requests are groups of sequences sharing blocks
(parallel.py, beam_search.py); while any is alive, sampling goes through `_step_with_groups`.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence

import torch

from kvserve.config import EngineConfig, default_kv_cache_memory
from kvserve.engine.beam_search import BeamGroup, BeamSearchParams
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.detokenizer import (
    DetokenizerState,
    append_new_text,
    find_stop_string,
    streamable_length,
)
from kvserve.engine.fork import copy_blocks, enqueue_fork
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.parallel import ParallelGroup, add_cumulative_logprobs
from kvserve.engine.params import SamplingParams
from kvserve.engine.request import FinishReason, Request, RequestOutput, TokenLogprob
from kvserve.engine.sampler import sample
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.validation import namespace_for, validate_prompt_ids
from kvserve.kernels.ops import Kernels
from kvserve.kv.block_allocator import BlockAllocator
from kvserve.kv.pool import KVPool, KVPoolShape, num_blocks_for_memory
from kvserve.model.llama import LlamaModel
from kvserve.model.registry import load_model
from kvserve.prefix.factory import make_prefix_cache


class LLMEngine:
    """The serving loop over one model and one KV pool. Not thread-safe: drive it from one thread."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(config.model, progress=progress, weights=config.weights)
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        kernels = Kernels.create(config.kernels)
        dtype = getattr(torch, kernels.resolve_dtype(config.dtype, config.weights))
        self.model = LlamaModel(loaded.config, loaded.weights, dtype, config.device, kernels)
        del loaded
        self.max_model_len = self._resolve_max_model_len()
        self.kv_pool = KVPool(self._pool_shape(), self.model.dtype, self.model.device)
        allocator = BlockAllocator(self.kv_pool.num_blocks)
        prefix_cache = make_prefix_cache(
            config.prefix_cache, allocator, config.block_size, config.prefix_hash
        )
        self.block_manager = BlockManager(
            allocator, prefix_cache, config.block_size, config.prefix_cache != "off", config.prefix_hash
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.schedule_policy
        )
        self.runner = ModelRunner(self.model, self.kv_pool)
        self.requests: dict[str, Request] = {}  # by id as submitted (a group: its root sequence)
        self.groups: dict[str, ParallelGroup | BeamGroup] = {}
        self._detokenizers: dict[str, DetokenizerState] = {}
        self._seed_rng = random.Random(config.seed)
        self._request_counter = itertools.count()
        self.eos_token_ids = self._eos_token_ids()

    # --- set-up --------------------------------------------------------------------------------------

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's {limit} positions")
        return wanted

    def _pool_shape(self) -> KVPoolShape:
        mc, config = self.model_config, self.config
        num_blocks = config.num_blocks or num_blocks_for_memory(
            int(config.kv_cache_memory or default_kv_cache_memory()), mc.num_layers, config.block_size,
            mc.num_kv_heads, mc.head_dim, self.model.dtype,
        )
        return KVPoolShape(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)

    def _eos_token_ids(self) -> frozenset[int]:
        if self.tokenizer is not None:
            return frozenset(self.tokenizer.stop_token_ids)
        eos = self.model_config.eos_token_id
        return frozenset() if eos is None else frozenset([eos])

    # --- requests ------------------------------------------------------------------------------------

    def make_request(
        self, prompt: str | Sequence[int], params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None, cache_salt: str | None = None,
        namespace: tuple[str, ...] | None = None,
    ) -> Request:
        """Validate and build a request without queueing it; raises ValueError naming the problem."""
        params = params or SamplingParams()
        params.validate()
        text = prompt if isinstance(prompt, str) else None
        prompt_ids = self._encode(prompt)
        validate_prompt_ids(prompt_ids, self.model_config.vocab_size)
        self._check_fits(len(prompt_ids), params.max_tokens)
        request_id = request_id if request_id is not None else f"req-{next(self._request_counter)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        beam_params = params if isinstance(params, BeamSearchParams) else None
        if beam_params is not None:
            params = beam_params.sampling_params()
        request = Request(
            request_id, prompt_ids, params,
            namespace=namespace if namespace is not None else namespace_for(cache_salt),
            prompt=text, eos_token_ids=self.eos_token_ids,
        )
        seed = None
        if not params.is_greedy:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            request.generator = torch.Generator(device="cpu").manual_seed(seed)
        if beam_params is not None:
            request.group = BeamGroup(request, beam_params, self.tokenizer)
        elif params.num_samples > 1:
            request.group = ParallelGroup(request, params.n, params.num_samples, seed)
        return request

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prompt as token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        num_blocks_needed = self.block_manager.blocks_for_tokens(total)
        if num_blocks_needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs {num_blocks_needed} KV blocks but the whole pool has "
                f"{self.block_manager.num_blocks}; lower max_tokens or raise --kv-cache-memory"
            )

    def add(self, request: Request) -> str:
        """Queue a request built by `make_request`."""
        self.requests[request.request_id] = request
        self._detokenizers[request.request_id] = DetokenizerState()
        if request.group is not None:
            self.groups[request.request_id] = request.group
        self.scheduler.add(request)
        return request.request_id

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, **kwargs) -> str:
        return self.add(self.make_request(prompt, params, **kwargs))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output, or None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.group is not None:
            return self._abort_group(request.group)
        self._finish(request, FinishReason.ABORT)
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of the requests that produced a token."""
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            return []
        if scheduler_output.blocks_to_copy:
            copy_blocks(self.kv_pool, scheduler_output.blocks_to_copy)
        logits, sampling = self.runner.run(scheduler_output.scheduled)
        for item in scheduler_output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
            self.block_manager.publish_full_blocks(item.request)
        if not sampling:
            return []
        requests = [item.request for item in sampling]
        if self.groups:
            return self._step_with_groups(logits, requests)
        token_ids, logprobs = sample(logits, requests)
        now = time.monotonic()
        outputs = []
        for request, token_id, logprob in zip(requests, token_ids, logprobs, strict=True):
            self._append_token(request, token_id, logprob, now)
            outputs.append(self._output(request))
        return outputs

    def _append_token(
        self, request: Request, token_id: int, logprob: TokenLogprob | None, now: float
    ) -> None:
        request.append_token(token_id)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        if logprob is not None and request.logprobs is not None:
            request.logprobs.append(logprob)
        stop_string_hit = self._update_text(request)
        reason = FinishReason.STOP if stop_string_hit else self._stop_reason(request, token_id)
        if reason is not None:
            self._finish(request, reason)

    def _update_text(self, request: Request) -> bool:
        """Extend the output text; True (and text truncated) when a stop string appeared."""
        if self.tokenizer is None:
            return False
        state = self._detokenizers[request.request_id]
        previous_length = len(request.output_text)
        request.output_text += append_new_text(
            self.tokenizer, request.output_token_ids, state, request.params.skip_special_tokens
        )
        if not request.params.stop:
            return False
        index = find_stop_string(request.output_text, request.params.stop, previous_length)
        if index == -1:
            return False
        request.output_text = request.output_text[:index]
        return True

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.params
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.finish_reason = reason
        request.metrics.finished_time = time.monotonic()
        self.scheduler.finish(request)
        self._detokenizers.pop(request.request_id, None)
        if request.group is None:  # a group's entry goes when the whole group does (_close_group)
            del self.requests[request.request_id]

    def _output(self, request: Request) -> RequestOutput:
        finished = request.is_finished
        text_end = streamable_length(request.output_text, request.params.stop, finished)
        delta_text = request.output_text[request.num_sent_chars : text_end]
        delta_tokens = request.output_token_ids[request.num_sent_tokens :]
        request.num_sent_chars = max(request.num_sent_chars, text_end)
        request.num_sent_tokens = request.num_output_tokens
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=request.output_text,
            token_ids=list(request.output_token_ids),
            finished=finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            metrics=request.metrics,
            logprobs=request.logprobs,
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
        )

    # --- groups: parallel sampling and beam search -------------------------------------------------

    def _step_with_groups(self, logits: torch.Tensor, requests: list[Request]) -> list[RequestOutput]:
        """step()'s sampling while groups are alive: fork parallel roots at their first token, sample
        plain requests and members, hand beam rows to their groups and step the groups that are ready."""
        rows, to_sample, beam_groups = self._route_rows(logits, requests)
        outputs: list[RequestOutput] = []
        touched: dict[ParallelGroup | BeamGroup, None] = {}  # ordered set
        if to_sample:
            logits = logits[rows]
            token_ids, logprobs = sample(logits, to_sample)
            add_cumulative_logprobs(logits, to_sample, token_ids)
            now = time.monotonic()
            for request, token_id, logprob in zip(to_sample, token_ids, logprobs, strict=True):
                self._append_token(request, token_id, logprob, now)
                if request.group is None:
                    outputs.append(self._output(request))
                else:
                    touched[request.group] = None
        for group in beam_groups:
            if group.ready:
                group.step(self.scheduler)
                touched[group] = None
        for group in touched:
            output = group.output()
            if group.finished:
                self._close_group(group)
            if output is not None:
                outputs.append(output)
        return outputs

    def _route_rows(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> tuple[list[int], list[Request], list[BeamGroup]]:
        """Logits rows to sample (a parallel root's row once per member) and the beam groups fed."""
        rows: list[int] = []
        to_sample: list[Request] = []
        beam_groups: dict[BeamGroup, None] = {}
        for row, request in enumerate(requests):
            group = request.group
            if isinstance(group, BeamGroup):
                group.add_row(request, logits[row])
                beam_groups[group] = None
                continue
            members = [request]
            if group is not None and not group.forked:
                members = group.fork(self.block_manager)
                for child in members[1:]:
                    self._detokenizers[child.request_id] = DetokenizerState()
                    enqueue_fork(self.scheduler, request, child)
            rows.extend([row] * len(members))
            to_sample.extend(members)
        return rows, to_sample, list(beam_groups)

    def _abort_group(self, group: ParallelGroup | BeamGroup) -> RequestOutput | None:
        for sequence in group.sequences():
            if not sequence.is_finished:
                self._finish(sequence, FinishReason.ABORT)
        group.mark_aborted()
        output = group.output()
        self._close_group(group)
        return output

    def _close_group(self, group: ParallelGroup | BeamGroup) -> None:
        group.root.metrics.finished_time = time.monotonic()
        del self.groups[group.request_id]
        del self.requests[group.request_id]
        self._detokenizers.pop(group.request_id, None)

    # --- introspection -------------------------------------------------------------------------------

    def stats(self) -> dict[str, float | int]:
        """Pool, scheduler and prefix-cache counters (see README for each field)."""
        manager = self.block_manager
        cache = manager.prefix_cache
        counters = self.scheduler.counters
        num_blocks = manager.num_blocks
        used = manager.num_used_blocks()
        return {
            "num_blocks": num_blocks,
            "block_size": manager.block_size,
            "free_blocks": manager.allocator.num_free,
            "cached_blocks": cache.num_evictable_blocks,
            "used_blocks": used,
            "registered_blocks": cache.num_cached_blocks,
            "peak_used_blocks": manager.peak_used_blocks,
            "kv_cache_usage": used / num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "prefix_cache_queries": counters.queries,
            "prefix_cache_hits": counters.hits,
            "prefix_cache_hit_rate": counters.recent_hit_rate(),
            "prefix_cache_preempted_queries": counters.preempted_queries,
            "prefix_cache_preempted_hits": counters.preempted_hits,
            "evictions": cache.num_evictions,
        }

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; refused (False) while any block is in use."""
        return self.block_manager.reset_prefix_cache()
