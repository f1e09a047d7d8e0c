"""`Kernels`: one object the model calls for its hot ops, backed by the native library or by torch.

``Kernels.create("native")`` builds/loads the C++ library and picks the widest ISA the CPU runs
(AVX-512 over AVX2; ``KVSERVE_ISA=avx2`` forces the narrower path, which the tests use). If the library
cannot be built or loaded, or the CPU lacks AVX2/FMA, it logs one warning and uses the torch kernels:
never a crash. ``Kernels.create("torch")`` is the pure-torch reference (`reference.py`) throughout.

``activation_quant="int8"`` makes every matmul with a quantized (`QuantWeight`) weight quantize its
activation rows to int8 blocks and dot them with the weight blocks in integer arithmetic (native:
`qmatmul_i8`, at every batch size; torch: its twin `reference.qlinear_i8`); the native model keeps those
weights packed for it (`prepare_int8`, kernels/i8pack.py; on a CPU with AMX-INT8 its Q8_0 matmuls of 16+ rows run
on AMX tiles, csrc/qmatmul_amx.h), bit-identical results. Dense weights are unaffected;
the engine refuses the option without quantized weights. "none" keeps fp32 activations, the exact path.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kernels import bf16pack, reference
from kvserve.kernels.bf16pack import PackedBf16Weight
from kvserve.kernels.cascade_plan import CascadeTensors, check_cascade_plan
from kvserve.kernels.crossover import DEFAULT_MIN_ROWS
from kvserve.kernels.i8pack import PACKED_BLOCK_BYTES, PackedI8Weight
from kvserve.kernels.native import AMX_ENV, NativeLibrary, cpu_flags
from kvserve.kernels.native_checks import KV_DTYPE_CODES
from kvserve.kernels.quant import BLOCK_QTYPES, QuantWeight

KERNEL_BACKENDS = ("native", "torch")
ACTIVATION_QUANTS = ("none", "int8")  # int8: quantized weights see int8 activation blocks (llama.cpp's Q8_1)
# bfloat16: prefill and shared-prefix attention round queries and probabilities to bf16 against a bf16 KV pool
# (csrc/prefill.h's ATTN_BF16; AVX512-BF16 pair products where the CPU has them); decode rows stay float32.
ATTENTION_DTYPES = ("float32", "bfloat16")
# bfloat16: the rows of prefill chunks run their matmuls as bf16 x bf16 products on AMX-BF16 tiles, on a bf16
# copy of the weights (kernels/bf16pack.py); decode rows keep `activation_quant`'s arithmetic.
PREFILL_DTYPES = ("float32", "bfloat16")
ISA_ENV = "KVSERVE_ISA"
# Up to this many activation rows the per-row kernel (csrc/impl.h) runs the layer loop's matmuls.
NATIVE_QMATMUL_MAX_ROWS = 16
# Which quantized matmul `Kernels.linear` runs by row count (benchmarks/qgemm.py measures the crossovers):
# the per-row kernel converts each weight block once per 4 rows and wins below QGEMM_MIN_ROWS (or the CPU's
# measured crossover for the weight type, kernels/crossover.py); the wide
# GEMM (csrc/qgemm.h; qgemm_wide.h on AVX2 from 48 rows) dequantizes each weight panel once per call and wins
# from there up to QGEMM_MAX_ROWS; beyond, dequantizing the whole weight for torch's GEMM does (on AVX2 the two
# are even from 512 to 2,048 rows) -- except for very large weights (the 49k-row lm head), where a float32 copy
# costs more than it saves.
QGEMM_MIN_ROWS = DEFAULT_MIN_ROWS  # where no measured crossover applies (one definition: crossover.py)
QGEMM_MAX_ROWS = 256
ALWAYS_NATIVE_ELEMENTS = 8 * 1024 * 1024

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Kernels:
    backend: str  # what actually runs: "native" or "torch"
    native: NativeLibrary | None = None
    activation_quant: str = "none"  # one of ACTIVATION_QUANTS
    attention_dtype: str = "float32"  # one of ATTENTION_DTYPES
    prefill_dtype: str = "float32"  # one of PREFILL_DTYPES

    def __post_init__(self) -> None:
        if self.activation_quant not in ACTIVATION_QUANTS:
            raise ValueError(f"activation_quant must be one of {ACTIVATION_QUANTS}, got {self.activation_quant!r}")
        if self.attention_dtype not in ATTENTION_DTYPES:
            raise ValueError(f"attention_dtype must be one of {ATTENTION_DTYPES}, got {self.attention_dtype!r}")
        if self.prefill_dtype not in PREFILL_DTYPES:
            raise ValueError(f"prefill_dtype must be one of {PREFILL_DTYPES}, got {self.prefill_dtype!r}")

    @classmethod
    def create(cls, requested: str = "native", isa: str | None = None, activation_quant: str = "none",
               attention_dtype: str = "float32", prefill_dtype: str = "float32") -> Kernels:
        if requested not in KERNEL_BACKENDS:
            raise ValueError(f"kernels must be one of {KERNEL_BACKENDS}, got {requested!r}")
        modes = {"activation_quant": activation_quant, "attention_dtype": attention_dtype,
                 "prefill_dtype": prefill_dtype}
        if requested == "torch":
            return cls("torch", **modes)
        try:
            from kvserve.kernels.build import build

            library = NativeLibrary.load(build(), isa or os.environ.get(ISA_ENV) or None)
        except (RuntimeError, OSError, ValueError, AttributeError) as err:
            logger.warning("native kernels unavailable, using the torch kernels instead: %s", err)
            return cls("torch", **modes)
        logger.info("native kernels: %s (CPU features: %s)", library.isa, ", ".join(sorted(library.features)))
        if prefill_dtype == "bfloat16" and not bf16pack.enable(library):
            raise ValueError(
                f"prefill_dtype='bfloat16' runs on AMX-BF16 tiles, not usable here (ISA {library.isa}, features: "
                f"{', '.join(sorted(library.features))}; Linux >= 5.16 must grant the tile state, and {AMX_ENV}=0 "
                "turns tiles off); kernels='torch' runs its arithmetic anywhere, slowly")
        return cls("native", library, **modes)

    @property
    def bf16_products(self) -> bool:
        """Whether prefill and shared-prefix attention run bf16 products (ATTENTION_DTYPES)."""
        return self.attention_dtype == "bfloat16"

    @property
    def bf16_prefill(self) -> bool:
        """Whether prefill rows' matmuls run bf16 x bf16 (PREFILL_DTYPES)."""
        return self.prefill_dtype == "bfloat16"

    @property
    def isa(self) -> str | None:
        return self.native.isa if self.native else None

    def describe(self) -> str:
        backend = f"native ({self.isa})" if self.native else "torch"
        exact_tiles = self.native is not None and self.native.amx_exact  # AMX-BF16: also the attention products
        attention = ""
        if self.bf16_products:
            attention = ", bf16 attention products" + (" on AMX tiles" if exact_tiles else "")
        if self.bf16_prefill:
            attention += ", bf16 prefill matmuls" + (" on AMX tiles" if self.native is not None else "")
        if self.activation_quant == "none":
            return backend + (", wide matmuls on AMX tiles" if exact_tiles else "") + attention
        tiles = " on AMX tiles" if self.native is not None and self.native.amx else ""
        return f"{backend}, {self.activation_quant} activations{tiles}{attention}"

    def native_bf16(self) -> bool:
        """Whether this CPU computes bf16 natively (AVX512_BF16 or AMX); without it bf16 runs emulated."""
        features = self.native.features if self.native is not None else cpu_flags()
        return bool({"avx512_bf16", "amx_bf16"} & features)

    def resolve_dtype(self, dtype: str, weights: str) -> str:
        """``auto``: bfloat16 only for dense weights on a CPU with native bf16, else float32 (quantized
        weights run with float32 activations). An explicit bf16 on a CPU without it is `stores_bf16`'s
        case with the native kernels; with the torch kernels it runs emulated, slowly: warn."""
        if dtype == "auto":
            return "bfloat16" if weights == "dense" and self.native_bf16() else "float32"
        if dtype == "bfloat16" and not self.native_bf16() and self.native is None:
            logger.warning("bfloat16 requested but this CPU has no native bf16 (avx512_bf16/amx) and the native "
                           "kernels are off: expect it to run many times slower than float32")
        return dtype

    def stores_bf16(self, dtype: str, device: str, weights: str = "dense") -> bool:
        """Whether bfloat16 is a storage format only: the native kernels keep dense matrices as bf16 rows
        (quant.BF16) and widen them to fp32 in registers, with activations and the KV cache in fp32 -- on a
        CPU without native bf16 arithmetic, and with quantized (`native`) weights on any CPU, whose kernels
        compute in fp32 whatever the activations' dtype. Emulated bf16 arithmetic (torch's) ran 4-60x slower
        than fp32 on an AVX2 EPYC (decode 3.7 against 16.9 tok/s, prefill 5.5 against 327); torch's native
        bf16 with quantized weights decoded 4.4x slower than fp32 on an AMX Xeon (32.6 against 143.9 tok/s:
        a cast at every matmul, attention in torch), with no faster prefill (BENCHMARKS.md, "Every
        configuration"). Dense weights on a CPU with native bf16 keep torch's bf16 (AMX GEMMs: prefill 2.3x
        fp32's there, decode 1.7x slower)."""
        return (dtype == "bfloat16" and self.native is not None and torch.device(device).type == "cpu"
                and (weights != "dense" or not self.native_bf16()))

    # --- matmuls -----------------------------------------------------------------------------------

    def packs_int8(self) -> bool:
        """Whether int8-path weights are pre-arranged at load: int8 activations on the native kernels."""
        return self.activation_quant == "int8" and self.native is not None

    def prepare_int8(self, weight: QuantWeight) -> QuantWeight | PackedI8Weight:
        """`weight` in the layout this backend's int8 matmul reads fastest (kernels/i8pack.py): packed where
        `packs_int8`, else unchanged. Only the int8 matmul can read the result: keep the GGUF blocks too if
        anything else (an embedding lookup, an fp32 matmul) needs them."""
        if not self.packs_int8() or weight.qtype not in PACKED_BLOCK_BYTES:
            return weight
        return self.native.pack_i8(weight.data, weight.qtype, weight.in_features)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantWeight | PackedI8Weight) -> torch.Tensor:
        """``x @ W.T``; a dense weight is stored transposed (``[in, out]``), so that is ``x @ weight``."""
        if isinstance(weight, PackedI8Weight):
            if not self.packs_int8():
                raise ValueError("a packed int8 weight needs int8 activations on the native kernels")
            return self.native.qmatmul_i8_packed(x.float().contiguous(), weight).to(x.dtype)
        if not isinstance(weight, QuantWeight):
            return x @ weight
        if self.activation_quant == "int8" and weight.qtype in BLOCK_QTYPES:
            if self.native is None:
                return reference.qlinear_i8(x, weight).to(x.dtype)
            x32 = x.float().contiguous()
            return self.native.qmatmul_i8(x32, weight.data, weight.qtype, weight.in_features).to(x.dtype)
        if self.native is None:
            return reference.qlinear(x, weight).to(x.dtype)
        x32 = x.float().contiguous()
        rows = x32.shape[0]
        if rows < self.native.qgemm_min_rows.get(weight.qtype, QGEMM_MIN_ROWS):  # the CPU's crossover
            out = self.native.qmatmul(x32, weight.data, weight.qtype, weight.in_features)
        elif (rows <= QGEMM_MAX_ROWS or weight.out_features * weight.in_features >= ALWAYS_NATIVE_ELEMENTS
              or self.native.amx_exact):  # on AMX tiles the wide GEMM beats torch's at every row count
            out = self.native.qgemm(x32, weight.data, weight.qtype, weight.in_features)
        else:
            out = F.linear(x32, self.dequantize(weight))
        return out.to(x.dtype)

    def prepare_bf16(self, weight: torch.Tensor | QuantWeight) -> PackedBf16Weight | None:
        """The bf16 tiles `linear_prefill` reads (native, `bf16_prefill`), from a quantized weight (as stored,
        ``[out, in]``) or a dense one (transposed, ``[in, out]``); None elsewhere: the twin rounds per call."""
        if not self.bf16_prefill or self.native is None:
            return None
        return bf16pack.pack(self._rows(weight))

    def linear_prefill(self, x: torch.Tensor, weight: torch.Tensor | QuantWeight,
                       packed: PackedBf16Weight | None) -> torch.Tensor:
        """``bf16(x) @ bf16(W).T`` in float32 (`bf16_prefill`): on the tiles with `packed`, else the torch twin on
        `weight` (quantized ``[out, in]`` or dense ``[in, out]``)."""
        if packed is not None and self.native is not None:
            return bf16pack.gemm(self.native, x.float().contiguous(), packed).to(x.dtype)
        if isinstance(weight, PackedI8Weight):
            raise ValueError("the bf16 prefill twin needs the weight's GGUF blocks, not the int8 packing")
        return reference.linear_bf16(x, self._rows(weight)).to(x.dtype)

    def _rows(self, weight: torch.Tensor | QuantWeight) -> torch.Tensor:
        """A projection as ``[out, in]`` rows: quantized ones dequantized, dense ones (stored ``[in, out]``) viewed."""
        return self.dequantize(weight) if isinstance(weight, QuantWeight) else weight.t()

    def dequantize(self, weight: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.native is None:
            return reference.dequantize(weight, rows)
        return self.native.dequantize(weight.data, weight.qtype, weight.in_features, rows)

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor | QuantWeight) -> torch.Tensor:
        if isinstance(weight, QuantWeight):
            return self.dequantize(weight, ids)
        return F.embedding(ids, weight)

    # --- attention and norms -----------------------------------------------------------------------

    def supports_paged_attention(self, queries: torch.Tensor, key_blocks: torch.Tensor) -> bool:
        width = 16 if self.isa == "avx512" else 8
        return (
            self.native is not None and queries.dtype == torch.float32 and key_blocks.dtype in KV_DTYPE_CODES
            and queries.device.type == "cpu" and queries.shape[-1] % width == 0
        )

    def paged_attention(
        self, queries: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor,
        block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """Query rows attend over their block tables in the pool (see `reference.paged_attention`)."""
        if self.supports_paged_attention(queries, key_blocks):
            return self.native.paged_attention(
                queries.contiguous(), key_blocks, value_blocks, block_tables.contiguous(), context_lens, scale
            )
        tables = block_tables if block_tables.dim() == 2 else block_tables.expand(queries.shape[0], -1)
        out = reference.paged_attention(queries, key_blocks, value_blocks, tables, context_lens, scale)
        return out.to(queries.dtype)

    def cascade_attention(
        self, queries: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor,
        block_tables: torch.Tensor, context_lens: torch.Tensor, plan: CascadeTensors, scale: float,
    ) -> torch.Tensor:
        """Decode rows attend over their block tables, each group's shared leading blocks read once for all
        its members (see `reference.cascade_attention`); the result equals `paged_attention`'s."""
        if self.supports_paged_attention(queries, key_blocks):
            return self.native.cascade_attention(
                queries.contiguous(), key_blocks, value_blocks, block_tables.contiguous(), context_lens, plan, scale,
                self.bf16_products,
            )
        check_cascade_plan(plan, block_tables, context_lens, key_blocks.shape[1], queries.shape[0])
        out = reference.cascade_attention(queries, key_blocks, value_blocks, block_tables, context_lens, plan, scale,
                                          self.bf16_products)
        return out.to(queries.dtype)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * rms_norm(x + residual), x + residual)."""
        width = 16 if self.isa == "avx512" else 8
        if (
            self.native is not None and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.dim() == 2 and x.shape[1] % width == 0 and x.is_contiguous()
        ):
            return self.native.rms_norm(x, weight, eps, residual)
        return reference.rms_norm(x, weight, eps, residual)

    # --- fused per-layer glue ----------------------------------------------------------------------

    def rope_kv_write(
        self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor, slots: torch.Tensor,
    ) -> torch.Tensor:
        """RoPE on q and k of the fused projection ``qkv [T, (heads + 2 * kv_heads) * D]`` and the KV write
        into pool `slots`, in one call; returns the rotated queries ``[T, heads, D]``."""
        if self.native is not None and key_blocks.dtype in KV_DTYPE_CODES and all(
            t.dtype == torch.float32 and t.device.type == "cpu" for t in (qkv, cos)
        ) and key_blocks.device.type == "cpu":
            return self.native.rope_kv_write(
                qkv.contiguous(), num_heads, num_kv_heads, positions.contiguous(), cos, sin, key_blocks,
                value_blocks, slots.contiguous(),
            )
        return reference.rope_kv_write(
            qkv, num_heads, num_kv_heads, positions, cos, sin, key_blocks, value_blocks, slots
        )

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [T, 2 * I]``."""
        if self.native is not None and gate_up.dtype == torch.float32 and gate_up.device.type == "cpu":
            return self.native.swiglu(gate_up.contiguous())
        return reference.swiglu(gate_up)
