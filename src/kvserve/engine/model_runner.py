"""ModelRunner: turns a SchedulerOutput into one flat batch, runs the model, returns sampling logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.prompt_logprobs import PromptSpan, prompt_spans, score_prompt_spans
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.kv.attention import AttentionMetadata, PrefillSpan
from kvserve.kv.cascade import plan_cascade
from kvserve.kv.pool import KVPool
from kvserve.lora.batch import LoRABatch
from kvserve.lora.registry import LoRARegistry
from kvserve.model.llama import LlamaModel


@dataclass(slots=True)
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # flat-batch row of the last token of each sequence that samples
    sampling: list[ScheduledRequest]  # the scheduled requests those rows belong to, same order
    lora: LoRABatch | None = None  # per-row adapter slots; None when no row uses an adapter
    prompt_spans: list[PromptSpan] | None = None  # rows whose logits score prompt tokens (prompt_logprobs)


class ModelRunner:
    def __init__(
        self, model: LlamaModel, kv_pool: KVPool, lora: LoRARegistry | None = None, cascade: bool = True
    ) -> None:
        self.model = model
        self.cascade = cascade  # group decodes that share leading blocks (kv/cascade.py)
        self.kv_pool = kv_pool
        self.lora = lora
        self.block_size = kv_pool.block_size
        self.device = model.device

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, keys and values) src -> dst; all sources are read first.
        Copy-on-write of forked sequences' shared tail blocks, run before the forward."""
        device = self.kv_pool.tensor.device
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
        self.kv_pool.tensor[:, :, dst] = self.kv_pool.tensor[:, :, src]

    def run(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, list[ScheduledRequest]]:
        """Forward the batch; returns float32 logits for each sequence that reached its last token.

        A step with more distinct adapters than `max_loras` slots runs as several forwards, each within
        the slots (rare: the usual step fits in one)."""
        parts = [scheduled] if self.lora is None else split_by_adapters(scheduled, self.lora.max_loras)
        if len(parts) == 1:
            return self._run_one(scheduled)
        results = [self._run_one(part) for part in parts]
        sampling = [item for _, part_sampling in results for item in part_sampling]
        logits = [part_logits for part_logits, part_sampling in results if part_sampling]
        return (torch.cat(logits) if logits else torch.empty(0)), sampling

    def _run_one(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, list[ScheduledRequest]]:
        batch = self.prepare(scheduled)
        hidden = self.model.forward(batch.input_ids, batch.positions, self.kv_pool, batch.meta, batch.lora)
        if batch.prompt_spans:
            score_prompt_spans(batch.prompt_spans, hidden, self.model.compute_logits)
        if not batch.sampling:
            return torch.empty(0), []
        return self.model.compute_logits(hidden[batch.sample_rows]), batch.sampling

    def prepare(self, scheduled: list[ScheduledRequest]) -> BatchInputs:
        # Single-token work (decodes) first, so the decode group is one contiguous slice. A decode that
        # carries drafts is a short prefill chunk over its cached context (engine/speculative.py).
        decodes = [item for item in scheduled if item.num_new_tokens == 1]
        prefills = [item for item in scheduled if item.num_new_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        spans: list[PromptSpan] = []
        for item in decodes + prefills:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            spans += prompt_spans(request, start, end, first_row=len(input_ids))
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            if item.draft:  # the last token and its drafts: every row's logits are checked in order
                input_ids.extend(item.draft)
                sample_rows.extend(range(len(input_ids) - len(item.draft) - 1, len(input_ids)))
                sampling.extend([item] * (len(item.draft) + 1))
            elif end == request.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampling.append(item)
        positions_tensor = torch.tensor(positions, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=self._slot_mapping(decodes + prefills, positions_tensor),
            num_decodes=len(decodes),
            decode_block_tables=None,
            decode_context_lens=None,
            decode_key_mask=None,
            prefills=self._prefill_spans(prefills, first_row=len(decodes)),
        )
        if decodes:
            self._fill_decode_metadata(meta, decodes)
        return BatchInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=positions_tensor,
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
            sampling=sampling,
            lora=self._lora_batch(decodes + prefills),
            prompt_spans=spans,
        )

    def _lora_batch(self, ordered: list[ScheduledRequest]) -> LoRABatch | None:
        """Per-row adapter slots (-1: base model), the adapters made resident first."""
        adapters = [item.request.lora for item in ordered if item.request.lora is not None]
        if self.lora is None or not adapters:
            return None
        slots = self.lora.activate(adapters)
        row_slots: list[int] = []
        for item in ordered:
            lora = item.request.lora
            row_slots.extend([-1 if lora is None else slots[lora.adapter_id]] * item.num_new_tokens)
        return LoRABatch.build(torch.tensor(row_slots, dtype=torch.long, device=self.device), self.lora.a, self.lora.b)

    def _slot_mapping(self, ordered: list[ScheduledRequest], positions: torch.Tensor) -> torch.Tensor:
        # slot = block_table[pos // block_size] * block_size + pos % block_size, for every new token.
        block_size = self.block_size
        block_ids: list[int] = []
        for item in ordered:
            table = item.request.block_table
            start = item.request.num_computed_tokens
            block_ids.extend([table[pos // block_size] for pos in range(start, start + item.num_new_tokens)])
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return blocks * block_size + positions % block_size

    def _prefill_spans(self, prefills: list[ScheduledRequest], first_row: int) -> list[PrefillSpan]:
        spans = []
        row = first_row
        for item in prefills:
            request = item.request
            context_len = request.num_computed_tokens + item.num_new_tokens
            num_blocks = -(-context_len // self.block_size)
            table = torch.tensor(request.block_table[:num_blocks], dtype=torch.long, device=self.device)
            spans.append(PrefillSpan(row, row + item.num_new_tokens, context_len, table))
            row += item.num_new_tokens
        return spans

    def _fill_decode_metadata(self, meta: AttentionMetadata, decodes: list[ScheduledRequest]) -> None:
        context_lens = [item.request.num_computed_tokens + 1 for item in decodes]
        max_blocks = -(-max(context_lens) // self.block_size)
        tables = [_padded(item.request.block_table, max_blocks) for item in decodes]
        lens = torch.tensor(context_lens, dtype=torch.long, device=self.device)
        key_positions = torch.arange(max_blocks * self.block_size, device=self.device)
        meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=self.device)
        meta.decode_context_lens = lens
        meta.decode_key_mask = (key_positions.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
        if self.cascade and len(decodes) > 1:
            tables = [item.request.block_table for item in decodes]
            plan = plan_cascade(tables, context_lens, self.block_size, device=self.device)
            if plan is not None:  # derived from these very tables and lengths: valid by construction
                plan.checked_with = (meta.decode_block_tables, lens)
            meta.decode_cascade = plan


def _padded(block_table: list[int], length: int) -> list[int]:
    """The first `length` entries, padded with block 0 (its keys are masked out)."""
    head = block_table[:length]
    return head + [0] * (length - len(head))


def split_by_adapters(scheduled: list[ScheduledRequest], max_loras: int) -> list[list[ScheduledRequest]]:
    """The step in parts of at most `max_loras` distinct adapters each (base-model rows join the first)."""
    parts: list[list[ScheduledRequest]] = [[]]
    seen: list[set[str]] = [set()]
    for item in scheduled:
        lora = item.request.lora
        if lora is not None and lora.adapter_id not in seen[-1] and len(seen[-1]) == max_loras:
            parts.append([])
            seen.append(set())
        if lora is not None:
            seen[-1].add(lora.adapter_id)
        parts[-1].append(item)
    return parts
