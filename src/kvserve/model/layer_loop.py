"""The native layer loop: a whole forward (every decoder layer and the final norm) as one C call.

At 135M parameters a decode step's Python loop spends as long in ~15 torch ops and ctypes calls per layer
as in the matmuls themselves (benchmarks/step_profile.py). `LayerLoop` describes every layer's weights to
the C side once, at model load (ctypes structures pointing at the model's own tensors, kept alive by the
model), and each step passes only its tokens, slots, block tables and context lengths
(csrc/layer.h). It runs the same kernels in the same order as the Python loop with native kernels, so
decode steps are bit-identical to it; prefill rows attend through the pool (paged attention) where the
Python loop runs torch's SDPA on a fresh prompt: logits agree within 1e-4 relative.

It applies to: native kernels, float32 on the CPU, every layer projection quantized (GGUF blocks), hidden
and head sizes a multiple of the SIMD width, no LoRA in the step, and a step of at most `MAX_ROWS` tokens or
of up to `MAX_STEP_ROWS` rows whose prefill tokens number at most `MAX_MIXED_PREFILL_TOKENS`: decode-only
steps and the mixed steps of a loaded server (a dozen or more decodes beside a newcomer's short chat
prefill: that step is most of the newcomer's TTFT). From 5 rows its exact matmuls run the wide GEMM of
csrc/qgemm.h, as `Kernels.linear` does; int8 activations run the int8 matmul at any row count. Each prefill
row attends through the pool to its first `ctx_lens[t]` tokens (cached blocks, then its chunk causally;
every row's K/V is written before any row attends), row by row. Whole step beside 16 decodes, 1 thread: a
chunk of 128 tokens after 1,024 cached ones took 1.5x the Python loop's time (its gather + flash SDPA), one
of 64 (where the Python loop also reads the pool in place) 0.93x, a fresh 48-token prompt 0.92x
(benchmarks/decode_step.py --mixed).
Longer prefills run the Python loop; so does everything else.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from kvserve.kernels.cascade_plan import CASCADE_FIELDS, check_cascade_plan
from kvserve.kernels.ops import NATIVE_QMATMUL_MAX_ROWS, Kernels
from kvserve.kernels.quant import QuantWeight
from kvserve.kv.attention import IN_PLACE_PREFILL_MAX_TOKENS, AttentionMetadata
from kvserve.kv.pool import KVPool

if TYPE_CHECKING:
    from kvserve.model.llama import LlamaModel

MAX_ROWS = NATIVE_QMATMUL_MAX_ROWS
MAX_STEP_ROWS = 256  # wider steps (decodes, plus short prefills) up to this many rows, matmuls through qgemm.h
# A step over MAX_ROWS takes the loop only while its prefill tokens are at most this many: each prefill row
# attends through the pool row by row (no query tiling); past kv/attention.py's IN_PLACE_PREFILL_MAX_TOKENS
# a chunk continuing a long context loses to the Python loop's flash SDPA (benchmarks/decode_step.py --mixed).
MAX_MIXED_PREFILL_TOKENS = IN_PLACE_PREFILL_MAX_TOKENS
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Matrix(ctypes.Structure):
    _fields_ = [("data", _P), ("qtype", _I), ("rows", _I), ("row_bytes", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_attention_norm", _P), ("qkv", _Matrix), ("o", _Matrix),
                ("gate_up", _Matrix), ("down", _Matrix)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("intermediate", _I), ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("rope_cos", _P),
                ("rope_sin", _P), ("final_norm", _P), ("layers", ctypes.POINTER(_Layer))]


def _matrix(weight: QuantWeight) -> _Matrix:
    return _Matrix(weight.data.data_ptr(), weight.qtype, weight.out_features, weight.row_bytes)


class LayerLoop:
    """The C-side description of one `LlamaModel` and the per-step call."""

    def __init__(self, model: LlamaModel, kernels: Kernels) -> None:
        config = model.config
        self.model = model
        self.native = kernels.native
        self.act_quant = int(kernels.activation_quant == "int8")  # csrc/layer.h's layer_qmatmul picks qmatmul_i8
        self._layers = (_Layer * len(model.layers))(*[
            _Layer(layer.input_norm.data_ptr(), layer.post_attention_norm.data_ptr(), _matrix(layer.qkv_proj),
                   _matrix(layer.o_proj), _matrix(layer.gate_up_proj), _matrix(layer.down_proj))
            for layer in model.layers
        ])
        self._model = _Model(
            len(model.layers), config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.intermediate_size, config.rms_norm_eps, model.scale, model.rope_cos.data_ptr(),
            model.rope_sin.data_ptr(), model.final_norm.data_ptr(), ctypes.cast(self._layers, ctypes.POINTER(_Layer)),
        )

    @classmethod
    def build(cls, model: LlamaModel) -> LayerLoop | None:
        """A loop for `model`, or None when it does not apply (see the module docstring)."""
        kernels, config = model.kernels, model.config
        if kernels.native is None or model.dtype != torch.float32 or model.device.type != "cpu":
            return None
        width = 16 if kernels.isa == "avx512" else 8
        if config.hidden_size % width or config.head_dim % width or config.num_heads % config.num_kv_heads:
            return None
        projections = [getattr(layer, name) for layer in model.layers
                       for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
        if not all(isinstance(weight, QuantWeight) for weight in projections):
            return None
        return cls(model, kernels)

    def applies(self, num_tokens: int, key_blocks: torch.Tensor, meta: AttentionMetadata | None = None) -> bool:
        if key_blocks.dtype != torch.float32 or num_tokens <= 0:
            return False
        if num_tokens <= MAX_ROWS:
            return True
        if meta is None or num_tokens > MAX_STEP_ROWS:
            return False
        return sum(span.end - span.start for span in meta.prefills) <= MAX_MIXED_PREFILL_TOKENS

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: KVPool, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[num_tokens, hidden]``, as `LlamaModel.forward`."""
        model = self.model
        hidden = model.kernels.embedding(input_ids, model.embed_tokens).float().contiguous()
        num_tokens = hidden.shape[0]
        tables, context_lens = _row_tables(meta, num_tokens)
        pool = kv_pool.tensor
        slots, positions = meta.slot_mapping.contiguous(), positions.contiguous()
        config = model.config
        if pool.shape[0] != config.num_layers or pool.shape[4:] != (config.num_kv_heads, config.head_dim):
            raise ValueError(f"KV pool {tuple(pool.shape)} does not match the model")
        _check_step(pool, positions, slots, tables, context_lens, model.rope_cos.shape[0], num_tokens)
        out = torch.empty_like(hidden)
        layer_stride = pool[0].numel()
        cascade = _cascade_arguments(meta, tables, context_lens, kv_pool.block_size, num_tokens)
        status = self.native.lib.kv_layer_forward(
            self.native.code, ctypes.byref(self._model), self.act_quant, hidden.data_ptr(), num_tokens,
            positions.data_ptr(), slots.data_ptr(), pool.data_ptr(), layer_stride, kv_pool.block_size,
            tables.data_ptr(), tables.shape[1], context_lens.data_ptr(), *cascade, out.data_ptr(),
        )
        if status != 0:
            raise ValueError(f"native layer loop failed with status {status}")
        return out


def _cascade_arguments(
    meta: AttentionMetadata, tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_tokens: int
) -> tuple[int, ...]:
    """The step's cascade groups as the C call takes them (checked first), or no groups: a decode-only step
    with a plan runs cascade attention in every layer, anything else plain paged attention."""
    plan = meta.decode_cascade
    if plan is None or meta.prefills or plan.num_groups == 0:
        return (0, None, None, None, None)
    for name in CASCADE_FIELDS:
        tensor = getattr(plan, name)
        if tensor.dtype != torch.int64 or not tensor.is_contiguous():
            raise ValueError(f"cascade plan field {name} must be contiguous int64")
    check_cascade_plan(plan, tables, context_lens, block_size, num_tokens)
    return (plan.num_groups, plan.group_offsets.data_ptr(), plan.group_rows.data_ptr(),
            plan.group_shared_blocks.data_ptr(), plan.row_shared_blocks.data_ptr())


def _row_tables(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One block table row and context length per token: decodes as they are, each prefill row its span's
    table with the context up to and including itself."""
    if not meta.prefills:
        return meta.decode_block_tables.contiguous(), meta.decode_context_lens.contiguous()
    width = max(len(span.block_table) for span in meta.prefills)
    if meta.num_decodes:
        width = max(width, meta.decode_block_tables.shape[1])
    tables = torch.zeros(num_tokens, width, dtype=torch.int64)
    context_lens = torch.empty(num_tokens, dtype=torch.int64)
    if meta.num_decodes:
        tables[: meta.num_decodes, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables
        context_lens[: meta.num_decodes] = meta.decode_context_lens
    for span in meta.prefills:
        tables[span.start : span.end, : len(span.block_table)] = span.block_table
        num_new = span.end - span.start
        context_lens[span.start : span.end] = torch.arange(span.context_len - num_new + 1, span.context_len + 1)
    return tables, context_lens


def _check_step(
    pool: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
    context_lens: torch.Tensor, max_positions: int, num_tokens: int,
) -> None:
    """Raw pointers go to C: every index it will follow is checked first (a ValueError, never a wild read)."""
    num_blocks, block_size = pool.shape[2], pool.shape[3]
    if not pool.is_contiguous() or pool.dtype != torch.float32:
        raise ValueError("the KV pool must be a contiguous float32 tensor")
    for values, name in ((positions, "positions"), (slots, "slots"), (context_lens, "context lens")):
        if values.dtype != torch.int64 or values.shape != (num_tokens,):
            raise ValueError(f"{name} must be int64 [{num_tokens}], got {values.dtype} {tuple(values.shape)}")
    checks = (
        (positions, max_positions, "positions"), (slots, num_blocks * block_size, "slots"),
        (tables, num_blocks, "block tables"),
    )
    for values, limit, name in checks:
        if int(values.min()) < 0 or int(values.max()) >= limit:
            raise ValueError(f"{name} out of range [0, {limit})")
    if int(context_lens.min()) < 1 or int(context_lens.max()) > tables.shape[1] * block_size:
        raise ValueError("a context length is < 1 or exceeds its block table")
