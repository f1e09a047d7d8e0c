"""The native library through ctypes: loading, the CPU's features, and which ISA each call runs.

Functions take raw pointers, so every wrapper here checks dtypes, contiguity and shapes first; a bad
argument is a ValueError, never a wild read.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.kernels import crossover, pair_products
from kvserve.kernels.cascade_plan import CASCADE_FIELDS, CascadeTensors, check_cascade_plan
from kvserve.kernels.i8pack import PACKED_BLOCK_BYTES, PackedI8Weight, packed_groups
from kvserve.kernels.native_checks import check, check_pool, check_range, ok
from kvserve.kernels.scratch import bind_scratch, scratch_call

ISA_CODES = {"avx2": 1, "avx512": 2}
FEATURE_BITS = {"avx2": 1, "avx512": 2, "avx512_vnni": 4, "avx512_bf16": 8, "amx_bf16": 16, "amx_int8": 32}
AMX_ENV = "KVSERVE_AMX"  # "0": never use AMX tiles (the tests compare both paths in one process)
ABI_VERSION = 7  # 7: fp8 KV pools; 6: bf16 prefill weights in the layer model; 5: attention products; 4: pool dtype

_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "kv_abi_version": [],
    "kv_cpu_features": [],
    "kv_set_num_threads": [ctypes.c_int],
    "kv_qmatmul": [ctypes.c_int, ctypes.c_int, _P, _I, _I, _P, _I, _I, _P, _I],
    "kv_qgemm": [ctypes.c_int, ctypes.c_int, _P, _I, _I, _P, _I, _I, _P, _I],
    "kv_qmatmul_i8": [ctypes.c_int, ctypes.c_int, _P, _I, _I, _P, _I, _I, _P, _I],
    "kv_pack_i8": [ctypes.c_int, ctypes.c_int, _P, _I, _I, _I, _P],
    "kv_quantize_i8": [ctypes.c_int, _P, _I, _I, _P, _P, _P],
    "kv_dequantize": [ctypes.c_int, ctypes.c_int, _P, _I, _I, _P, _I, _P],
    "kv_paged_attention": [_C, _C, _P, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _F, _P],
    "kv_rms_norm": [_C, _P, _P, _P, _I, _I, _F, _P],
    "kv_rope_kv_write": [_C, _C, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P],
    "kv_swiglu": [_C, _P, _I, _I, _P],
    "kv_layer_forward": [_C, _C, _P, _C, _P, _I, _P, _P, _P, _I, _I, _P, _I, _P, _I, _P, _P, _P, _P,
                         _P],
    "kv_layer_forward_spans": [_C, _C, _P, _C, _P, _I, _P, _P, _P, _I, _I, _P, _I, _P, _I, _P, _P, _P,
                               _P, _I, _I, _P, _P, _P, _P, _I, _P],
    "kv_cascade_attention": [_C, _C, _P, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _F, _C, _P],
    "kv_prefill_attention": [_C, _C, _P, _I, _I, _I, _P, _P, _I, _I, _P, _P, _P, _P, _I, _F, _C, _P],
}
# Optional too (older builds lack it): the int8 path's AMX tiles where they pay (1), for every packed weight
# type (2: measurements, tests), off (0) or unchanged (-1); returns the mode, -1 where the CPU or the kernel
# cannot run tiles.
_AMX_SIGNATURE = ("kv_amx_enable", [ctypes.c_int])
# Optional as well: the exact path's wide GEMM on AMX-BF16 tiles, on (1), off (0) or unchanged (-1); returns
# the state, -1 where the CPU or the kernel cannot.
_AMX_EXACT = "kv_amx_exact"
# Optional too (older builds lack it): from how many rows the AVX2 build's exact wide GEMM runs
# csrc/qgemm_wide.h instead of qgemm.h's tiles; rows >= 1 sets it; returns the value before.
_WIDE_ROWS = "kv_qgemm_wide_rows"


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read): for what the
    library does not report (it is not built) and for benchmark headers."""
    try:
        with open("/proc/cpuinfo") as info:
            return set(next((line for line in info if line.startswith("flags")), "").split())
    except OSError:
        return set()


def cpu_features(lib: ctypes.CDLL) -> set[str]:
    bits = lib.kv_cpu_features()
    return {name for name, bit in FEATURE_BITS.items() if bits & bit}


def best_isa(features: set[str]) -> str | None:
    """The widest ISA this CPU runs, or None when it lacks even AVX2/FMA. The AVX-512 build is compiled with
    VNNI (its int8 kernels are vpdpbusd throughout), so an AVX-512 CPU without VNNI (Skylake-X) gets AVX2."""
    if "avx512" in features and "avx512_vnni" in features:
        return "avx512"
    return "avx2" if "avx2" in features else None


@dataclass(slots=True)
class NativeLibrary:
    lib: ctypes.CDLL
    isa: str
    features: frozenset[str]
    qgemm_min_rows: dict[int, int] = field(default_factory=dict)  # weight type -> wide GEMM from (crossover.py)

    @classmethod
    def load(cls, path: Path, isa: str | None = None) -> NativeLibrary:
        """Load `path`; `isa` forces "avx2" or "avx512" (must be supported), None picks the best."""
        lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
        bind_scratch(lib)
        for name in (_AMX_SIGNATURE[0], _AMX_EXACT):
            if (amx_switch := getattr(lib, name, None)) is not None:
                amx_switch.argtypes = _AMX_SIGNATURE[1]
                amx_switch.restype = ctypes.c_int
        if (wide_rows := getattr(lib, _WIDE_ROWS, None)) is not None:
            wide_rows.argtypes, wide_rows.restype = [_I], _I
        if lib.kv_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path}: ABI version {lib.kv_abi_version()}, expected {ABI_VERSION}")
        lib.kv_set_num_threads(torch.get_num_threads())
        features = cpu_features(lib)
        chosen = isa or best_isa(features)
        if chosen is None:
            raise RuntimeError("this CPU has no AVX2/FMA; the native kernels need at least that")
        if chosen not in ISA_CODES:
            raise ValueError(f"unknown ISA {chosen!r}; choose one of {sorted(ISA_CODES)}")
        if chosen not in features:
            raise RuntimeError(f"ISA {chosen} requested but this CPU supports only {sorted(features)}")
        library = cls(lib, chosen, frozenset(features))
        crossover.apply(library)
        pair_products.apply(library)
        tiles = os.environ.get(AMX_ENV, "1") != "0"
        library.set_amx(tiles)
        library.set_amx_exact(tiles)
        return library

    def _amx_switch(self, name: str = _AMX_SIGNATURE[0], feature: str = "amx_int8"):
        """The library's AMX switch `name` where this handle can use it (the AVX-512 build on a CPU with
        `feature`, a library that has the switch), else None."""
        if self.isa != "avx512" or feature not in self.features:
            return None
        return getattr(self.lib, name, None)

    def set_amx_exact(self, on: bool) -> bool:
        """Run the exact wide GEMM (from 16-64 rows; csrc/qgemm_amx.h: activations split into three bf16 parts,
        exact up to summation order) and the bf16 attention products (csrc/prefill_amx.h) on AMX-BF16 tiles
        where this CPU and Linux allow; returns whether it is on. Library-wide, as `set_amx`."""
        switch = self._amx_switch(_AMX_EXACT, "amx_bf16")
        return switch is not None and switch(1 if on else 0) > 0

    @property
    def amx_exact(self) -> bool:
        """Whether this handle's exact wide GEMMs run on AMX-BF16 tiles now."""
        switch = self._amx_switch(_AMX_EXACT, "amx_bf16")
        return switch is not None and switch(-1) > 0

    def wide_gemm_rows(self, rows: int | None = None) -> int:
        """From how many rows the AVX2 build's exact `qgemm` runs csrc/qgemm_wide.h (the weights as the vector
        side) instead of qgemm.h's tiles (AVX-512 always runs qgemm.h's); `rows` sets it, library-wide (a huge
        value keeps qgemm.h's tiles: benchmarks and tests compare both). Returns the value before the call, 0
        for a library without qgemm_wide.h."""
        if rows is not None and rows < 1:
            raise ValueError(f"rows must be at least 1, got {rows}")
        switch = getattr(self.lib, _WIDE_ROWS, None)
        if switch is None and rows is not None:
            raise RuntimeError("this native library predates qgemm_wide.h (no kv_qgemm_wide_rows)")
        return 0 if switch is None else switch(rows or 0)

    def set_amx(self, on: bool, every_type: bool = False) -> bool:
        """Use AMX tiles for the int8 path's matmuls of 16+ rows (csrc/qmatmul_amx.h; bit-identical to the
        VNNI kernel) where this CPU and Linux (which must grant the tile state) allow: for Q8_0 weights, where
        they are faster, or with `every_type` for Q4_0/Q4_1 too (measurements and tests: there they are not).
        Returns whether they are on. The switch is the library's: it holds for every AVX-512 handle on it in
        this process (the AVX2 build never runs tiles)."""
        switch = self._amx_switch()
        return switch is not None and switch((2 if every_type else 1) if on else 0) > 0

    @property
    def amx(self) -> bool:
        """Whether this handle's int8 matmuls run on AMX tiles now (for Q8_0 weights at least)."""
        switch = self._amx_switch()
        return switch is not None and switch(-1) > 0

    @property
    def code(self) -> int:
        return ISA_CODES[self.isa]

    def release_scratch(self, min_idle_s: float = 0.0) -> int:
        """Unmap the kernels' scratch arenas (csrc/scratch.h) idle for at least `min_idle_s` seconds (0: all
        not in use right now); returns the bytes unmapped. The next call maps what it needs again."""
        return scratch_call(self.lib, "kv_scratch_release", int(min_idle_s * 1000)) or 0

    def scratch_mapped(self) -> int:
        """Bytes the scratch arenas hold mapped now (grown to each thread's largest step, kept between calls)."""
        return scratch_call(self.lib, "kv_scratch_mapped") or 0

    def qmatmul(self, x: torch.Tensor, data: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
        """``x [rows, in] @ W.T`` -> float32 ``[rows, out]``; W is ``data`` (uint8 blocks, one row per output)."""
        return self._quant_matmul("kv_qmatmul", x, data, qtype, in_features)

    def qgemm(self, x: torch.Tensor, data: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
        """As `qmatmul`, for many rows: each weight panel is dequantized once per call (csrc/qgemm.h)."""
        return self._quant_matmul("kv_qgemm", x, data, qtype, in_features)

    def qmatmul_i8(self, x: torch.Tensor, data: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
        """As `qmatmul`, with the rows of x quantized to int8 blocks first (`reference.qlinear_i8`)."""
        return self._quant_matmul("kv_qmatmul_i8", x, data, qtype, in_features)

    def pack_i8(self, data: torch.Tensor, qtype: int, in_features: int) -> PackedI8Weight:
        """GGUF rows ``data [out, row_bytes]`` pre-arranged for the int8 kernels (kernels/i8pack.py)."""
        check(data, torch.uint8, "weight")
        if qtype not in PACKED_BLOCK_BYTES:
            raise ValueError(f"no packed int8 layout for quantization type id {qtype}")
        out_features = data.shape[0]
        packed = torch.empty(packed_groups(out_features), in_features // 32 * PACKED_BLOCK_BYTES[qtype],
                             dtype=torch.uint8)
        ok(self.lib.kv_pack_i8(self.code, qtype, data.data_ptr(), out_features, data.shape[1], in_features,
                                packed.data_ptr()), "pack_i8")
        return PackedI8Weight(packed, qtype, in_features, out_features)

    def qmatmul_i8_packed(self, x: torch.Tensor, weight: PackedI8Weight) -> torch.Tensor:
        """`qmatmul_i8` on a packed weight (kernels/i8pack.py)."""
        check(x, torch.float32, "x")
        check(weight.data, torch.uint8, "weight")
        rows, width = x.shape
        if width != weight.in_features:
            raise ValueError(f"x has {width} features, weight expects {weight.in_features}")
        out = torch.empty(rows, weight.out_features, dtype=torch.float32)
        ok(self.lib.kv_qmatmul_i8(
            self.code, weight.code, x.data_ptr(), rows, width, weight.data.data_ptr(), weight.out_features,
            weight.group_bytes, out.data_ptr(), out.shape[1],
        ), "qmatmul_i8 (packed)")
        return out

    def _quant_matmul(
        self, entry: str, x: torch.Tensor, data: torch.Tensor, qtype: int, in_features: int
    ) -> torch.Tensor:
        check(x, torch.float32, "x")
        check(data, torch.uint8, "weight")
        rows, width = x.shape
        if width != in_features:
            raise ValueError(f"x has {width} features, weight expects {in_features}")
        out = torch.empty(rows, data.shape[0], dtype=torch.float32)
        ok(getattr(self.lib, entry)(
            self.code, qtype, x.data_ptr(), rows, width, data.data_ptr(), data.shape[0], data.shape[1],
            out.data_ptr(), out.shape[1],
        ), entry.removeprefix("kv_"))
        return out

    def quantize_i8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The activation quantization of `qmatmul_i8`: (int8 q [rows, k], d and s [rows, k/32])."""
        check(x, torch.float32, "x")
        rows, width = x.shape
        q = torch.empty(rows, width, dtype=torch.int8)
        d = torch.empty(rows, width // 32, dtype=torch.float32)
        s = torch.empty_like(d)
        ok(self.lib.kv_quantize_i8(self.code, x.data_ptr(), rows, width, q.data_ptr(), d.data_ptr(), s.data_ptr()),
            "quantize_i8")
        return q, d, s

    def dequantize(self, data: torch.Tensor, qtype: int, in_features: int, rows: torch.Tensor | None) -> torch.Tensor:
        check(data, torch.uint8, "weight")
        if rows is not None:
            rows = rows.reshape(-1).to(torch.int64).contiguous()
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= data.shape[0]):
                raise ValueError(f"row ids out of range [0, {data.shape[0]})")
        count = data.shape[0] if rows is None else rows.numel()
        out = torch.empty(count, in_features, dtype=torch.float32)
        ok(self.lib.kv_dequantize(
            self.code, qtype, data.data_ptr(), data.shape[1], in_features,
            None if rows is None else rows.data_ptr(), count, out.data_ptr(),
        ), "dequantize")
        return out

    def paged_attention(
        self, queries: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor,
        block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """As `reference.paged_attention`; block_tables ``[T, max_blocks]`` or one shared ``[max_blocks]``."""
        check(queries, torch.float32, "queries")
        kvt = check_pool(key_blocks, value_blocks)
        check(block_tables, torch.int64, "block_tables")
        check(context_lens, torch.int64, "context_lens")
        num_rows, num_heads, head_dim = queries.shape
        num_blocks, block_size, num_kv_heads, _ = key_blocks.shape
        stride = 0 if block_tables.dim() == 1 else block_tables.shape[1]
        width = block_tables.shape[-1]
        if context_lens.shape != (num_rows,) or (stride and block_tables.shape[0] != num_rows):
            raise ValueError("context_lens / block_tables do not match the number of query rows")
        if num_rows and (int(context_lens.max()) > width * block_size or int(context_lens.min()) < 1):
            raise ValueError("a context length is < 1 or exceeds its block table")
        out = torch.empty_like(queries)
        ok(self.lib.kv_paged_attention(
            self.code, kvt, queries.data_ptr(), num_rows, num_heads, num_kv_heads, head_dim,
            key_blocks.data_ptr(), value_blocks.data_ptr(), block_size, block_tables.data_ptr(), stride,
            context_lens.data_ptr(), scale, out.data_ptr(),
        ), "paged_attention")
        return out

    def cascade_attention(
        self, queries: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor,
        block_tables: torch.Tensor, context_lens: torch.Tensor, plan: CascadeTensors, scale: float,
        bf16_products: bool = False,
    ) -> torch.Tensor:
        """As `reference.cascade_attention` (the plan's tensors checked against the rows and tables).
        `bf16_products` (a bf16 pool): the shared parts on prefill.h's tiles round queries and probabilities
        to bf16 (csrc/prefill.h, ATTN_BF16)."""
        check(queries, torch.float32, "queries")
        kvt = check_pool(key_blocks, value_blocks)
        for tensor, name in ((block_tables, "block_tables"), (context_lens, "context_lens"),
                             *((getattr(plan, n), n) for n in CASCADE_FIELDS)):
            check(tensor, torch.int64, name)
        num_rows, num_heads, head_dim = queries.shape
        block_size, num_kv_heads = key_blocks.shape[1], key_blocks.shape[2]
        check_cascade_plan(plan, block_tables, context_lens, block_size, num_rows)
        out = torch.empty_like(queries)
        ok(self.lib.kv_cascade_attention(
            self.code, kvt, queries.data_ptr(), num_rows, num_heads, num_kv_heads, head_dim, key_blocks.data_ptr(),
            value_blocks.data_ptr(), block_size, block_tables.data_ptr(), block_tables.shape[1],
            context_lens.data_ptr(), plan.group_shared_blocks.shape[0], plan.group_offsets.data_ptr(),
            plan.group_rows.data_ptr(), plan.group_shared_blocks.data_ptr(), plan.row_shared_blocks.data_ptr(),
            scale, int(bf16_products), out.data_ptr(),
        ), "cascade_attention")
        return out

    def prefill_attention(
        self, queries: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor, spans: torch.Tensor,
        block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None, bf16_products: bool = False,
    ) -> torch.Tensor:
        """Prefill chunks attending causally through the pool (csrc/prefill.h). ``spans [S, 3]`` int64 rows
        (first query row, tokens, context length once written): the span's row i sits at position
        ``context - tokens + i``; ``block_tables [S, max_blocks]``. Writes the spans' rows of `out`
        (``[T, heads, D]``, a new tensor when None; other rows untouched) and returns it. Equals
        `paged_attention` with one row per token over its span's table up to summation order; with
        `bf16_products` (a bf16 pool) `reference.paged_attention`'s bf16 products (csrc/prefill.h, ATTN_BF16)."""
        check(queries, torch.float32, "queries")
        kvt = check_pool(key_blocks, value_blocks)
        check(spans, torch.int64, "spans")
        check(block_tables, torch.int64, "block_tables")
        num_rows, num_heads, head_dim = queries.shape
        block_size, num_kv_heads = key_blocks.shape[1], key_blocks.shape[2]
        if out is None:
            out = torch.empty_like(queries)
        check(out, torch.float32, "out")
        if out.shape != queries.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, queries {tuple(queries.shape)}")
        if (spans.dim() != 2 or spans.shape[1] != 3 or block_tables.dim() != 2
                or block_tables.shape[0] != spans.shape[0]):
            raise ValueError("spans must be [S, 3] (start, tokens, context) with one block_tables row each")
        capacity = block_tables.shape[1] * block_size
        for start, tokens, context in spans.tolist():
            if tokens < 1 or start < 0 or start + tokens > num_rows or not tokens <= context <= capacity:
                raise ValueError("a span is empty, outside the query rows, or its context exceeds its block table")
        spans_t = spans.t().contiguous()  # [3, S]: starts, lengths, contexts
        ok(self.lib.kv_prefill_attention(
            self.code, kvt, queries.data_ptr(), num_heads, num_kv_heads, head_dim, key_blocks.data_ptr(),
            value_blocks.data_ptr(), block_size, spans.shape[0], spans_t[0].data_ptr(), spans_t[1].data_ptr(),
            spans_t[2].data_ptr(), block_tables.data_ptr(), block_tables.shape[1], scale, int(bf16_products),
            out.data_ptr(),
        ), "prefill_attention")
        return out

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `reference.rms_norm`; with a residual the sum is written into a fresh copy of x."""
        check(x, torch.float32, "x")
        check(weight, torch.float32, "weight")
        if residual is not None:
            check(residual, torch.float32, "residual")
            x = x.clone()
        out = torch.empty_like(x)
        ok(self.lib.kv_rms_norm(
            self.code, x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
            x.shape[0], x.shape[1], eps, out.data_ptr(),
        ), "rms_norm")
        return out, x

    def rope_kv_write(
        self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor, slots: torch.Tensor,
    ) -> torch.Tensor:
        """As `reference.rope_kv_write`: rotated queries ``[T, heads, D]``; keys/values written to the pool."""
        for tensor, name in ((qkv, "qkv"), (cos, "cos"), (sin, "sin")):
            check(tensor, torch.float32, name)
        kvt = check_pool(key_blocks, value_blocks)
        check(positions, torch.int64, "positions")
        check(slots, torch.int64, "slots")
        head_dim = cos.shape[1]
        rows = qkv.shape[0]
        if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads}+2*{num_kv_heads} heads of {head_dim}")
        if key_blocks.shape[-2:] != (num_kv_heads, head_dim) or value_blocks.shape != key_blocks.shape:
            raise ValueError("key/value blocks do not match the number of KV heads and the head size")
        check_range(positions, rows, cos.shape[0], "positions")
        check_range(slots, rows, key_blocks.numel() // (num_kv_heads * head_dim), "slots")
        queries = torch.empty(rows, num_heads, head_dim, dtype=torch.float32)
        ok(self.lib.kv_rope_kv_write(
            self.code, kvt, qkv.data_ptr(), rows, num_heads, num_kv_heads, head_dim, positions.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), queries.data_ptr(), key_blocks.data_ptr(), value_blocks.data_ptr(),
            slots.data_ptr(),
        ), "rope_kv_write")
        return queries

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [T, 2 * I]`` -> ``[T, I]``."""
        check(gate_up, torch.float32, "gate_up")
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"gate_up must be [rows, 2 * intermediate], got {tuple(gate_up.shape)}")
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=torch.float32)
        ok(self.lib.kv_swiglu(self.code, gate_up.data_ptr(), gate_up.shape[0], out.shape[1], out.data_ptr()), "swiglu")
        return out
