"""LLMEngine.step(): schedule -> run the model -> groups decide -> sample -> stop checks -> outputs.

Every submitted request is a `SequenceGroup` (engine/groups/): a plain request is a group of one,
a parallel (n / best_of) request forks its members at the first token, a beam-search request keeps
its beams. After the forward each group gets its members' logits rows and answers with decisions
(fork, sample, extend, drop, finish); the engine applies them through the scheduler's and the block
manager's public methods (order: groups/base.py). Every sampled token takes the same path.

With `KVSERVE_DEBUG_CHECKS=1` (the test suite sets it) every step ends with the allocator, prefix
cache and block-table checks (`Scheduler.check_invariants`).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from collections.abc import Callable, Sequence

import torch

from kvserve.config import EngineConfig
from kvserve.engine.background import BACKGROUND_DROPPED
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.failures import FailureStreak, StepFailures, failed_output, run_attributed
from kvserve.engine.groups import Decision, Drop, Extend, Finish, Fork, Sample, SequenceGroup, make_group
from kvserve.engine.groups.single import SingleSequence
from kvserve.engine.kv_tiers import make_engine_tiers
from kvserve.engine.limits import check_block_cap
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.params import BeamSearchParams, SamplingParams
from kvserve.engine.prefix_admission import make_prefix_hold
from kvserve.engine.request import FinishReason, Request, RequestError, RequestOutput, TokenLogprob
from kvserve.engine.sampler import add_cumulative_logprobs, sample
from kvserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from kvserve.engine.setup import (
    check_activation_quant,
    eos_token_ids,
    make_busy_chunking,
    make_kv_pool,
    model_weights,
    resolve_admitted_prefill_cap,
    resolve_long_prefill_threshold,
    resolve_max_model_len,
)
from kvserve.engine.speculative import make_speculator
from kvserve.engine.stats import engine_stats
from kvserve.engine.step_cost import make_auto_row_cap
from kvserve.engine.step_threads import StepThreads
from kvserve.engine.structured import GrammarCompiler
from kvserve.engine.tokens import append_sampled_token
from kvserve.engine.validation import check_fits, check_priority, prompt_ids_of, validate_token_params
from kvserve.kernels.ops import Kernels
from kvserve.kv.block_allocator import BlockAllocator
from kvserve.lora.adapter import LoRAAdapter, LoRARequest
from kvserve.lora.registry import LoRARegistry
from kvserve.model.llama import LlamaModel
from kvserve.model.registry import load_model
from kvserve.prefix.factory import make_prefix_cache
from kvserve.prefix.namespace import Namespace, with_adapter

DEBUG_CHECKS_ENV = "KVSERVE_DEBUG_CHECKS"
logger = logging.getLogger(__name__)


class LLMEngine:
    """The serving loop over one model and one KV pool. Not thread-safe: drive it from one thread."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self._threads = StepThreads()  # warns when a thread other than this one steps it (openmp.py)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(config.model, progress=progress, weights=config.weights)
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        check_activation_quant(config, loaded.weights)
        kernels = Kernels.create(config.kernels, activation_quant=config.activation_quant,
                                  attention_dtype=config.attention_dtype, prefill_dtype=config.prefill_dtype)
        dtype, loaded.weights, bf16_weights = model_weights(kernels, config, loaded.weights)
        self.model = LlamaModel(loaded.config, loaded.weights, dtype, config.device, kernels)
        tensor_shapes = {name: tuple(tensor.shape) for name, tensor in loaded.weights.items()}
        weights_path = loaded.path
        del loaded
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.kv_pool = make_kv_pool(config, self.model_config, self.model.dtype, self.model.device)
        allocator = BlockAllocator(self.kv_pool.num_blocks)
        prefix_cache = make_prefix_cache(
            config.prefix_cache, allocator, config.block_size, config.prefix_hash, config.eviction
        )
        self.block_manager = BlockManager(allocator, prefix_cache, config.block_size, config.prefix_hash)
        self.long_prefill_token_threshold = resolve_long_prefill_threshold(config, self.max_model_len)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.schedule_policy,
            self.long_prefill_token_threshold, config.max_step_rows or 0, config.max_group_rows,
            config.long_prefill_always, resolve_admitted_prefill_cap(config, self.long_prefill_token_threshold),
        )
        self.auto_row_cap = make_auto_row_cap(config.max_step_rows, config.device, self.scheduler.rotation,
                                              config.max_num_seqs)
        self.lora = LoRARegistry(self.model_config, config.max_loras, config.max_lora_rank, self.model.dtype,
                                 self.model.device) if config.enable_lora else None
        self.runner = ModelRunner(self.model, self.kv_pool, self.lora, cascade=not config.disable_cascade_attn)
        self.tiers = make_engine_tiers(config, self.model_config, tensor_shapes, weights_path, self.block_manager,
                                       self.kv_pool.tensor, bf16_weights)
        self.scheduler.tiers, self.scheduler.busy = self.tiers, make_busy_chunking(config)
        self.scheduler.speculator = self.speculator = make_speculator(config.speculative_config, self.max_model_len)
        self.scheduler.prefix_hold = make_prefix_hold(config)
        self.groups: dict[str, SequenceGroup] = {}  # open requests, by id as submitted
        self.debug_checks = os.environ.get(DEBUG_CHECKS_ENV, "0") not in ("", "0")
        self._seed_rng = random.Random(config.seed)
        self._request_counter = itertools.count()
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_config)
        self._grammars: GrammarCompiler | None = None  # built on the first structured-output request
        self.finish_listeners: list[Callable[[Request], None]] = []  # e.g. the request log
        self._failure_streak = FailureStreak()

    # --- requests ------------------------------------------------------------------------------------

    def make_request(
        self, prompt: str | Sequence[int], params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None, namespace: Namespace = (), lora: LoRAAdapter | None = None, priority: int = 0,
    ) -> Request:
        """Validate and build a request without queueing it; raises ValueError naming the problem.

        `namespace` comes from `make_namespace` (prefix/namespace.py), the one constructor; `lora` (from
        `resolve_lora`) adds its adapter id to it, so its blocks are keyed by the adapter too."""
        params = params or SamplingParams()
        params.validate()
        if lora is not None:
            if self.lora is None:
                raise ValueError("LoRA adapters are not enabled on this engine (enable_lora)")
            namespace = with_adapter(namespace, lora.adapter_id)
        prompt_ids = prompt_ids_of(self.tokenizer, prompt, params, self.model_config.vocab_size, self.max_model_len)
        check_fits(len(prompt_ids), params.max_tokens, self.max_model_len, self.block_manager.block_size,
                   self.block_manager.num_blocks)
        check_block_cap(len(prompt_ids), params, self.block_manager, self.config.max_blocks_per_request,
                        self.max_model_len)
        request_id = request_id if request_id is not None else f"req-{next(self._request_counter)}"
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        beam_params = params if isinstance(params, BeamSearchParams) else None
        sampling = beam_params.sampling_params() if beam_params is not None else params
        validate_token_params(sampling, self.model_config.vocab_size, self.tokenizer)
        request = Request(
            request_id, prompt_ids, sampling, namespace=namespace,
            prompt=prompt if isinstance(prompt, str) else None, eos_token_ids=self.eos_token_ids,
            beam_params=beam_params, lora=lora, priority=check_priority(priority, self.config.schedule_policy),
        )
        if sampling.structured_outputs is not None:  # sampling hook: the grammar masks every row
            request.grammar = self._grammar_compiler().matcher(sampling.structured_outputs)
        if not sampling.is_greedy:
            request.seed = sampling.seed if sampling.seed is not None else self._seed_rng.getrandbits(63)
            request.generator = torch.Generator(device="cpu").manual_seed(request.seed)
        return request

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; this model has none")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                             sorted(self.eos_token_ids))
        return self._grammars

    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        """Load and register an adapter under `name`; ValueError naming the problem, nothing registered."""
        return self._loras().load(name, path)

    def unload_lora(self, name: str) -> bool:
        """Forget an adapter's name (requests already running under it finish under it)."""
        return self.lora is not None and self.lora.remove(name)

    def resolve_lora(self, lora_request: LoRARequest | None) -> LoRAAdapter | None:
        """The adapter of a `LoRARequest`, loading it from `lora_path` the first time its name is seen."""
        return None if lora_request is None else self._loras().resolve(lora_request)

    def _loras(self) -> LoRARegistry:
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled on this engine (enable_lora)")
        return self.lora

    def add(self, request: Request) -> str:
        """Queue a request built by `make_request`."""
        if request.request_id in self.groups:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        group = make_group(request, request.beam_params, request.seed, self.tokenizer)
        request.speculate = self.speculator is not None and isinstance(group, SingleSequence)
        self.groups[request.request_id] = group
        self.scheduler.add(request)
        return request.request_id

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | BeamSearchParams | None = None,
                    request_id: str | None = None, namespace: Namespace = ()) -> str:
        """`make_request` then `add`."""
        return self.add(self.make_request(prompt, params, request_id, namespace))

    @property
    def requests(self) -> dict[str, Request]:
        """Open requests by id as submitted (each group's root sequence)."""
        return {request_id: group.root for request_id, group in self.groups.items()}

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output, or None if unknown."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for sequence in group.sequences():
            if not sequence.is_finished:
                self._finish(sequence, FinishReason.ABORT)
        group.mark_aborted()
        output = group.output()
        self._close(group)
        return output

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of the requests that produced a token (or failed).

        A request whose work raises is aborted with an error output (engine/failures.py); an exception outside
        any request's work (scheduling, block copies, invariant checks) propagates: the loop cannot go on."""
        self._threads.check()
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        outputs = self._run(scheduler_output) if scheduler_output.scheduled else []
        dropped = self.scheduler.take_dropped()  # background copies that would evict (engine/background.py)
        outputs += [self._fail_group(r.group_id, RequestError(BACKGROUND_DROPPED)) for r in dropped]
        if self.auto_row_cap is not None:
            self.auto_row_cap.observe(scheduler_output.scheduled, time.perf_counter() - started)
        if self.debug_checks:
            self.scheduler.check_invariants()
        return outputs

    def _run(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        if scheduler_output.blocks_to_copy:
            self.runner.copy_blocks(scheduler_output.blocks_to_copy)
        failures = StepFailures()
        logits, sampling = run_attributed(self.runner.run, scheduler_output.scheduled, failures)
        for item in scheduler_output.scheduled:
            if not item.draft:  # a drafted request advances by what its check accepts (_verify)
                failures.guard(item.request.group_id, lambda item=item: self._advance(item))
        rows: dict[str, list[tuple[Request, int]]] = {}  # by group, in batch order
        drafted: dict[str, tuple[ScheduledRequest, list[int]]] = {}  # plain requests that carried drafts
        for row, item in enumerate(sampling):
            if item.request.group_id in failures:
                continue
            if item.draft:
                drafted.setdefault(item.request.group_id, (item, []))[1].append(row)
            else:
                rows.setdefault(item.request.group_id, []).append((item.request, row))
        for group_id, (item, draft_rows) in drafted.items():
            failures.guard(group_id, lambda i=item, r=draft_rows: self._verify(i, logits[r]))
        groups = [self.groups[group_id] for group_id in rows]
        decided = []
        for group in groups:
            decisions = failures.guard(group.request_id, lambda g=group: g.decide(rows[g.request_id], logits))
            if decisions is not None:
                decided.append((group, decisions))
        self._apply(decided, logits, failures)
        groups += [self.groups[group_id] for group_id in drafted]
        outputs = self._collect([g for g in groups if g.request_id not in failures], failures)
        outputs += [self._fail_group(group_id, error) for group_id, error in failures.errors.items()]
        num_groups = len({item.request.group_id for item in scheduler_output.scheduled})
        self._failure_streak.record(num_groups, len(failures.errors))
        return outputs

    def _advance(self, item: ScheduledRequest) -> None:
        item.request.num_computed_tokens += item.num_new_tokens
        self.block_manager.publish_full_blocks(item.request)

    def _verify(self, item: ScheduledRequest, logits: torch.Tensor) -> None:
        """Check a drafted step's rows (engine/speculative.py); finish the request if a token ends it."""
        now = time.monotonic()
        append = lambda r, t, lp: append_sampled_token(r, t, lp, now, self.tokenizer, self.max_model_len)  # noqa: E731
        publish = self.block_manager.publish_full_blocks
        reason = self.speculator.verify(item.request, item.draft, logits, append, publish)
        if reason is not None:
            self._finish(item.request, reason)

    def _apply(self, decided: list[tuple[SequenceGroup, list[Decision]]], logits: torch.Tensor,
               failures: StepFailures) -> None:
        """Apply the groups' decisions in groups/base.py's order: forks, tokens, drops, finishes; a group
        whose decisions raise fails alone."""
        for group, decisions in decided:
            failures.guard(group.request_id, lambda g=group, d=decisions: self._apply_forks(d))
        self._sample(decided, logits, failures)
        for group, decisions in decided:
            failures.guard(group.request_id, lambda g=group, d=decisions: self._apply_rest(g, d))

    def _apply_forks(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            if isinstance(decision, Fork):
                self.scheduler.add_fork(decision.parent, decision.child)

    def _apply_rest(self, group: SequenceGroup, decisions: list[Decision]) -> None:
        for decision in decisions:
            if isinstance(decision, Extend):
                decision.member.append_token(decision.token_id)
                decision.member.cumulative_logprob = decision.cumulative_logprob
        for decision in decisions:
            if isinstance(decision, Drop):
                self.scheduler.finish(decision.member)
        if any(isinstance(decision, Finish) for decision in decisions):
            for sequence in group.sequences():
                if not sequence.is_finished:
                    self.scheduler.finish(sequence)

    def _sample(self, decided: list[tuple[SequenceGroup, list[Decision]]], logits: torch.Tensor,
                failures: StepFailures) -> None:
        """The one sampling path: every sampled token of the step from one `sample()` call (group by
        group if that raises), then appended and stop-checked member by member."""
        samples = [d for group, decisions in decided if group.request_id not in failures
                   for d in decisions if isinstance(d, Sample)]
        if not samples:
            return
        try:
            drawn = self._draw(samples, logits)
        except Exception as exc:  # noqa: BLE001 - attributed below, group by group
            logger.warning("batched sampling failed (%r); sampling group by group", exc)
            drawn = []
            by_group: dict[str, list[Sample]] = {}
            for decision in samples:
                by_group.setdefault(decision.member.group_id, []).append(decision)
            for group_id, group_samples in by_group.items():
                drawn += failures.guard(group_id, lambda s=group_samples: self._draw(s, logits)) or []
        now = time.monotonic()
        for member, token_id, logprob in drawn:
            failures.guard(member.group_id, lambda m=member, t=token_id, lp=logprob: self._append(m, t, lp, now))

    def _draw(self, samples: list[Sample], logits: torch.Tensor) -> list[tuple[Request, int, TokenLogprob | None]]:
        rows = [decision.row for decision in samples]
        if rows != list(range(len(logits))):
            logits = logits[rows]
        members = [decision.member for decision in samples]
        token_ids, logprobs = sample(logits, members)
        tracked = [i for i, decision in enumerate(samples) if decision.track_logprob]
        add_cumulative_logprobs(logits, members, token_ids, tracked)
        return list(zip(members, token_ids, logprobs, strict=True))

    def _append(self, member: Request, token_id: int, logprob: TokenLogprob | None, now: float) -> None:
        reason = append_sampled_token(member, token_id, logprob, now, self.tokenizer, self.max_model_len)
        if reason is not None:
            self._finish(member, reason)

    def _collect(self, groups: list[SequenceGroup], failures: StepFailures) -> list[RequestOutput]:
        outputs = []
        for group in groups:
            output = failures.guard(group.request_id, group.output)
            if group.request_id in failures:
                continue
            if group.finished:
                self._close(group)
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail_group(self, group_id: str, error: BaseException) -> RequestOutput:
        """Abort every sequence of a failed group (its blocks come back) and close it with an error."""
        group = self.groups[group_id]
        members = {id(s): s for s in [*group.sequences(), *self.scheduler.sequences_of(group_id)]}
        for sequence in members.values():
            if not sequence.is_finished:
                self._finish(sequence, FinishReason.ERROR)
        output = failed_output(group.root, error)
        self._close(group)
        return output

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.finish_reason = reason
        request.metrics.finished_time = time.monotonic()
        self.scheduler.finish(request)
        for listener in self.finish_listeners:
            listener(request)

    def _close(self, group: SequenceGroup) -> None:
        group.root.metrics.finished_time = time.monotonic()
        del self.groups[group.request_id]

    # --- introspection -------------------------------------------------------------------------------

    def stats(self) -> dict[str, float | int]:
        """Pool, scheduler, prefix-cache, tier and speculative-decoding counters (see README for each field)."""
        return engine_stats(self.block_manager, self.scheduler, self.tiers)

    def reset_prefix_cache(self, tiers: bool = False) -> bool:
        """Drop every cached block on the device (not demoted to the lower tiers); with `tiers` host and disk
        are emptied too (not the shared remote store). Refused (False) while any block is in use."""
        if self.tiers is None:
            return self.block_manager.reset_prefix_cache()
        return self.tiers.reset_prefix_cache(local_tiers=tiers)

    def close(self) -> None:
        """Stop the tiers' background threads (queued writes are flushed first)."""
        if self.tiers is not None:
            self.tiers.close()
