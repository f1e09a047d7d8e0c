"""The native layer loop: a whole forward (every decoder layer and the final norm) as one C call.

At 135M parameters a decode step's Python loop spends as long in ~15 torch ops and ctypes calls per layer
as in the matmuls themselves (benchmarks/step_profile.py). `LayerLoop` describes every layer's weights to
the C side once, at model load (ctypes structures pointing at the model's own tensors, kept alive by the
model), and each step passes only its tokens, slots, block tables and context lengths
(csrc/layer.h). It runs the same kernels in the same order as the Python loop with native kernels: decode
rows attend through paged attention (cascade attention with a shared-prefix plan), each prefill chunk through
csrc/prefill.h (query tiles against the pool's keys, fresh or after cached blocks), so up to
`QGEMM_MAX_ROWS` rows a step's logits are bit-identical to the Python loop's; beyond, that loop's
dequantize + torch GEMM differs from qgemm.h in summation order only.

It applies to: native kernels, float32 on the CPU (a float32 or bf16 KV pool), every layer projection
quantized (GGUF blocks), hidden and head sizes a multiple of the SIMD width, no LoRA in the step, and a step
of at most `MAX_ROWS` tokens or, with the engine's metadata, of up to `EXACT_MAX_STEP_ROWS` rows (float32
activations; `MAX_STEP_ROWS` where glibc's mmap threshold is pinned, as a server does: kernels/malloc.py)
or `MAX_STEP_ROWS` (int8, or bf16 prefill rows): decodes, prefill chunks, any mix. From 5 rows its exact
matmuls run the wide GEMM of csrc/qgemm.h (qgemm_wide.h on AVX2 from 48 rows); int8 activations run the int8
matmul at any row count; with `--prefill-dtype bfloat16` the prefill spans' rows run csrc/gemm_bf16.h.
Prefill, 1 thread, CPU time, whole request (benchmarks/results/kernels_prefill.md): exact 256-512 tokens
1.03-1.11x the Python loop, 1,024-2,048 0.85x (torch's GEMM on dequantized weights is faster there, hence the
exact bound); int8 512 tokens 1.07x, 2,048 1.22x (the same int8 kernel; the Python loop's fresh per-layer
buffers and ~15 calls per layer cost).
Longer steps run the Python loop; so does everything else.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from kvserve.kernels.cascade_plan import CASCADE_FIELDS, check_cascade_plan
from kvserve.kernels.i8pack import PackedI8Weight
from kvserve.kernels.malloc import mmap_threshold_pinned
from kvserve.kernels.native_checks import KV_DTYPE_CODES
from kvserve.kernels.ops import NATIVE_QMATMUL_MAX_ROWS, Kernels
from kvserve.kernels.quant import BF16, QuantWeight
from kvserve.kv.attention import AttentionMetadata, native_spans
from kvserve.kv.pool import KVPool

if TYPE_CHECKING:
    from kvserve.model.llama import LayerWeights, LlamaModel

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # llama.py's, in _Layer's order
MAX_ROWS = NATIVE_QMATMUL_MAX_ROWS
# Steps with the engine's metadata run here up to this many rows (decodes, prefill chunks, any mix) with int8
# activations; past it (a --max-num-batched-tokens above the default 2,048) the Python loop, whose per-layer
# buffers are smaller.
MAX_STEP_ROWS = 4096
# With float32 activations only up to this many: beyond it torch's GEMM on weights dequantized per call beats
# qgemm.h (1 thread, CPU time: the whole prefill ran 0.85x the Python loop's speed at 1,024 and 2,048 tokens,
# 1.03-1.11x at 256-512; the int8 matmul is the same kernel in both loops).
EXACT_MAX_STEP_ROWS = 512
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Matrix(ctypes.Structure):
    _fields_ = [("data", _P), ("qtype", _I), ("rows", _I), ("row_bytes", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_attention_norm", _P), ("qkv", _Matrix), ("o", _Matrix),
                ("gate_up", _Matrix), ("down", _Matrix), ("qkv16", _Matrix), ("o16", _Matrix),
                ("gate_up16", _Matrix), ("down16", _Matrix)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("intermediate", _I), ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("rope_cos", _P),
                ("rope_sin", _P), ("final_norm", _P), ("layers", ctypes.POINTER(_Layer)), ("attention", _I)]


def _matrix(weight: QuantWeight | PackedI8Weight) -> _Matrix:
    if isinstance(weight, PackedI8Weight):  # csrc/qmatmul_i8_packed.h: row_bytes is one 16-column group's
        return _Matrix(weight.data.data_ptr(), weight.code, weight.out_features, weight.group_bytes)
    return _Matrix(weight.data.data_ptr(), weight.qtype, weight.out_features, weight.row_bytes)


def _tiles(layer: LayerWeights, name: str) -> _Matrix:
    """`--prefill-dtype bfloat16`'s tiles of projection `name` (csrc/gemm_bf16.h), or a null matrix."""
    packed = layer.prefill_tiles(name)
    if packed is None:
        return _Matrix(None, -1, 0, 0)
    return _Matrix(packed.data.data_ptr(), -1, packed.out_features, 0)


class LayerLoop:
    """The C-side description of one `LlamaModel` and the per-step call."""

    def __init__(self, model: LlamaModel, kernels: Kernels) -> None:
        config = model.config
        self.model = model
        self.native = kernels.native
        self.act_quant = int(kernels.activation_quant == "int8")  # csrc/layer.h's layer_qmatmul picks qmatmul_i8
        # The most rows of a step with the engine's metadata: float32 steps beyond EXACT_MAX_STEP_ROWS go to
        # the Python loop, unless glibc's mmap threshold is pinned (a server: kernels/malloc.py), where that
        # loop's torch temporaries would each fault in fresh pages.
        exact = MAX_STEP_ROWS if mmap_threshold_pinned() else EXACT_MAX_STEP_ROWS
        # bf16 prefill: prefill rows never reach the exact wide GEMM, so steps are bounded as the int8 path's
        self.max_step_rows = MAX_STEP_ROWS if self.act_quant or kernels.bf16_prefill else exact
        self._layers = (_Layer * len(model.layers))(*[
            _Layer(layer.input_norm.data_ptr(), layer.post_attention_norm.data_ptr(),
                   *[_matrix(getattr(layer, name)) for name in PROJECTIONS],
                   *[_tiles(layer, name) for name in PROJECTIONS])
            for layer in model.layers
        ])
        self._model = _Model(
            len(model.layers), config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.intermediate_size, config.rms_norm_eps, model.scale, model.rope_cos.data_ptr(),
            model.rope_sin.data_ptr(), model.final_norm.data_ptr(), ctypes.cast(self._layers, ctypes.POINTER(_Layer)),
            int(kernels.bf16_products),  # csrc/prefill.h's ATTN_BF16 for prefill and shared-prefix attention
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
        projections = [getattr(layer, name) for layer in model.layers for name in PROJECTIONS]
        if not all(isinstance(weight, QuantWeight | PackedI8Weight) for weight in projections):
            return None
        if kernels.activation_quant != "none" and any(getattr(w, "qtype", None) == BF16 for w in projections):
            return None  # bf16 rows have no int8 kernel: the Python loop runs them in float32
        return cls(model, kernels)

    def applies(self, num_tokens: int, key_blocks: torch.Tensor, meta: AttentionMetadata | None = None) -> bool:
        if key_blocks.dtype not in KV_DTYPE_CODES or num_tokens <= 0:
            return False
        return num_tokens <= MAX_ROWS or (meta is not None and num_tokens <= self.max_step_rows)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: KVPool, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[num_tokens, hidden]``, as `LlamaModel.forward`."""
        model = self.model
        hidden = model.kernels.embedding(input_ids, model.embed_tokens).float().contiguous()
        num_tokens = hidden.shape[0]
        pool = kv_pool.tensor
        slots, positions = meta.slot_mapping.contiguous(), positions.contiguous()
        config = model.config
        if pool.shape[0] != config.num_layers or pool.shape[4:] != (config.num_kv_heads, config.head_dim):
            raise ValueError(f"KV pool {tuple(pool.shape)} does not match the model")
        out = torch.empty_like(hidden)
        layer_stride = pool[0].numel()
        if meta.prefills:
            self._forward_spans(hidden, num_tokens, positions, slots, pool, layer_stride, kv_pool.block_size, meta,
                                out)
            return out
        tables, context_lens = meta.decode_block_tables.contiguous(), meta.decode_context_lens.contiguous()
        _check_step(pool, positions, slots, tables, context_lens, model.rope_cos.shape[0], num_tokens)
        cascade = _cascade_arguments(meta, tables, context_lens, kv_pool.block_size, num_tokens)
        status = self.native.lib.kv_layer_forward(
            self.native.code, KV_DTYPE_CODES[pool.dtype], ctypes.byref(self._model), self.act_quant, hidden.data_ptr(),
            num_tokens,
            positions.data_ptr(), slots.data_ptr(), pool.data_ptr(), layer_stride, kv_pool.block_size,
            tables.data_ptr(), tables.shape[1], context_lens.data_ptr(), *cascade, out.data_ptr(),
        )
        if status != 0:
            raise ValueError(f"native layer loop failed with status {status}")
        return out

    def _forward_spans(
        self, hidden: torch.Tensor, num_tokens: int, positions: torch.Tensor, slots: torch.Tensor,
        pool: torch.Tensor, layer_stride: int, block_size: int, meta: AttentionMetadata, out: torch.Tensor,
    ) -> None:
        """A step with prefill chunks: decode rows attend through their tables, each chunk through prefill.h."""
        num_decodes = meta.num_decodes
        if num_decodes:
            tables, context_lens = meta.decode_block_tables.contiguous(), meta.decode_context_lens.contiguous()
        else:  # no decode rows: a placeholder table the checks accept and the kernel never reads
            tables, context_lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
        _check_step(pool, positions, slots, tables, context_lens, self.model.rope_cos.shape[0], num_decodes or 1,
                    num_tokens)
        if meta.native_spans is None:
            meta.native_spans = native_spans(meta.prefills, hidden.device)
        spans, span_tables = meta.native_spans
        _check_spans(spans, span_tables, num_decodes, num_tokens, pool.shape[2], block_size)
        spans_t = spans.t().contiguous()  # [3, S]: first rows, lengths, context lengths
        cascade = _cascade_arguments(meta, tables, context_lens, block_size, num_decodes) if num_decodes else (
            0, None, None, None, None)
        status = self.native.lib.kv_layer_forward_spans(
            self.native.code, KV_DTYPE_CODES[pool.dtype], ctypes.byref(self._model), self.act_quant, hidden.data_ptr(),
            num_tokens,
            positions.data_ptr(), slots.data_ptr(), pool.data_ptr(), layer_stride, block_size,
            tables.data_ptr(), tables.shape[1], context_lens.data_ptr(), *cascade, num_decodes, spans.shape[0],
            spans_t[0].data_ptr(), spans_t[1].data_ptr(), spans_t[2].data_ptr(), span_tables.data_ptr(),
            span_tables.shape[1], out.data_ptr(),
        )
        if status != 0:
            raise ValueError(f"native layer loop failed with status {status}")


def _cascade_arguments(
    meta: AttentionMetadata, tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_tokens: int
) -> tuple[int, ...]:
    """The step's cascade groups among its decode rows as the C call takes them (checked first), or no groups:
    decode rows with a plan run cascade attention in every layer (beside prefill chunks too, as the Python
    loop does), otherwise plain paged attention."""
    plan = meta.decode_cascade
    if plan is None or plan.num_groups == 0:
        return (0, None, None, None, None)
    for name in CASCADE_FIELDS:
        tensor = getattr(plan, name)
        if tensor.dtype != torch.int64 or not tensor.is_contiguous():
            raise ValueError(f"cascade plan field {name} must be contiguous int64")
    check_cascade_plan(plan, tables, context_lens, block_size, num_tokens)
    return (plan.num_groups, plan.group_offsets.data_ptr(), plan.group_rows.data_ptr(),
            plan.group_shared_blocks.data_ptr(), plan.row_shared_blocks.data_ptr())


def _check_step(
    pool: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
    context_lens: torch.Tensor, max_positions: int, num_rows: int, num_tokens: int | None = None,
) -> None:
    """Raw pointers go to C: every index it will follow is checked first (a ValueError, never a wild read).
    `num_rows`: the rows of `tables` / `context_lens` (every token's, unless prefill spans cover the rest)."""
    num_tokens = num_rows if num_tokens is None else num_tokens
    num_blocks, block_size = pool.shape[2], pool.shape[3]
    if not pool.is_contiguous() or pool.dtype not in KV_DTYPE_CODES:
        raise ValueError(f"the KV pool must be a contiguous float32 or bfloat16 tensor, got {pool.dtype}")
    for values, name, count in ((positions, "positions", num_tokens), (slots, "slots", num_tokens),
                                (context_lens, "context lens", num_rows)):
        if values.dtype != torch.int64 or values.shape != (count,):
            raise ValueError(f"{name} must be int64 [{count}], got {values.dtype} {tuple(values.shape)}")
    if tables.dtype != torch.int64 or tables.dim() != 2 or tables.shape[0] != num_rows:
        raise ValueError(f"block tables must be int64 [{num_rows}, width], got {tables.dtype} {tuple(tables.shape)}")
    checks = (
        (positions, max_positions, "positions"), (slots, num_blocks * block_size, "slots"),
        (tables, num_blocks, "block tables"),
    )
    for values, limit, name in checks:
        if int(values.min()) < 0 or int(values.max()) >= limit:
            raise ValueError(f"{name} out of range [0, {limit})")
    if int(context_lens.min()) < 1 or int(context_lens.max()) > tables.shape[1] * block_size:
        raise ValueError("a context length is < 1 or exceeds its block table")


def _check_spans(
    spans: torch.Tensor, tables: torch.Tensor, num_decodes: int, num_tokens: int, num_blocks: int, block_size: int
) -> None:
    """The prefill spans tile rows [num_decodes, num_tokens) in order, each within its block table."""
    if spans.dtype != torch.int64 or tables.dtype != torch.int64 or not tables.is_contiguous():
        raise ValueError("prefill spans and their block tables must be contiguous int64")
    if spans.dim() != 2 or spans.shape[1] != 3 or tables.dim() != 2 or tables.shape[0] != spans.shape[0]:
        raise ValueError("prefill spans must be [S, 3] (start, tokens, context) with one block table row each")
    if int(tables.min()) < 0 or int(tables.max()) >= num_blocks:
        raise ValueError(f"prefill block tables out of range [0, {num_blocks})")
    row, capacity = num_decodes, tables.shape[1] * block_size
    for start, tokens, context in spans.tolist():
        if start != row or tokens < 1 or not tokens <= context <= capacity:
            raise ValueError("prefill spans must follow the decode rows in order, each non-empty within its table")
        row += tokens
    if row != num_tokens:
        raise ValueError(f"prefill spans end at row {row}, the step has {num_tokens}")
