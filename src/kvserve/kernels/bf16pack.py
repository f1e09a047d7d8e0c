"""`--prefill-dtype bfloat16`: prefill rows' matmuls as bf16 x bf16 products on AMX-BF16 tiles.

A prefill is compute-bound: every weight is read once for hundreds of rows. On a CPU with AMX-BF16 the tiles
multiply bf16 pairs exactly and sum in float32 several times faster than anything with per-block scales (the
exact path's split products, csrc/qgemm_amx.h; the int8 path's VNNI or per-block AMX-INT8 epilogues), so this
mode keeps a bf16 copy of each layer projection, made once at load from the dequantized weights and laid out
as AMX's B tiles (`pack`; csrc/gemm_bf16.h), and runs the rows of prefill chunks through it with their
activations rounded to bf16. Decode rows keep the configured arithmetic (exact float32 or int8), so each
sequence's prompt runs in bf16 and its generated tokens as before, whatever else shares the step.

The result is the float32 matmul of the two rounded operands up to summation order: `reference.linear_bf16`
is the torch twin (any CPU), as `kernels="torch"` runs it. It is a bf16 model's arithmetic (what transformers
runs in bf16), not the exact path's. Memory: two bytes per projection weight beside the quantized ones
(~212 MB for the default 135M model).

Layout: for column tile j (16 weight rows, zero past out_features up to a multiple of 32) and k block b (32
inputs), 1 KiB at (j * in/32 + b) KiB, row t holding each of the 16 rows' inputs 2t and 2t + 1.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from kvserve.kernels.native import AMX_ENV, NativeLibrary
from kvserve.kernels.native_checks import check, ok

PANEL = 32  # weight rows per panel of the kernel's 2 x 2 tile blocking
BLOCK = 32  # inputs per k block (one tile row: 16 pairs)
_SWITCH, _GEMM, _SWIGLU = "kv_bf16_gemm", "kv_gemm_bf16", "kv_gemm_bf16_swiglu"
_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass(slots=True)
class PackedBf16Weight:
    """A projection ``[out_features, in_features]`` as bf16 B tiles (module docstring)."""

    data: torch.Tensor  # bfloat16 [padded_out / 16, in_features / 32, 16, 16, 2]
    in_features: int
    out_features: int


def pack(dense: torch.Tensor) -> PackedBf16Weight:
    """``dense [out, in]`` (any float dtype) rounded to bf16 (nearest even) and laid out as B tiles."""
    out_features, in_features = dense.shape
    if in_features % BLOCK:
        raise ValueError(f"bf16 prefill needs in_features divisible by {BLOCK}, got {in_features}")
    padded = -(-out_features // PANEL) * PANEL
    rows = torch.zeros(padded, in_features, dtype=torch.bfloat16)
    rows[:out_features] = dense.to(torch.bfloat16)
    tiles = rows.view(padded // 16, 16, in_features // BLOCK, 16, 2).permute(0, 2, 3, 1, 4)
    return PackedBf16Weight(tiles.contiguous(), in_features, out_features)


def unpack(weight: PackedBf16Weight) -> torch.Tensor:
    """The bf16 ``[out, in]`` rows `pack` laid out (tests; the twin of what the tiles read)."""
    data = weight.data
    rows = data.permute(0, 3, 1, 2, 4).reshape(data.shape[0] * 16, weight.in_features)
    return rows[: weight.out_features]


def enable(native: NativeLibrary) -> bool:
    """Turn the library's bf16 GEMM on where this CPU has AMX-BF16 and Linux grants the tile state (the AVX-512
    build; library-wide, as the other AMX switches; never with ``KVSERVE_AMX=0``); returns whether it is on."""
    switch = getattr(native.lib, _SWITCH, None)
    if switch is None or native.isa != "avx512" or "amx_bf16" not in native.features:
        return False
    if os.environ.get(AMX_ENV, "1") == "0":
        return False
    switch.argtypes, switch.restype = [ctypes.c_int], ctypes.c_int
    for name in (_GEMM, _SWIGLU):
        getattr(native.lib, name).argtypes = [ctypes.c_int, _P, _I, _I, _P, _I, _P, _I]
    return switch(1) > 0


def gemm(native: NativeLibrary, x: torch.Tensor, weight: PackedBf16Weight, swiglu: bool = False) -> torch.Tensor:
    """``bf16(x) @ W.T`` -> float32 ``[rows, out]`` on the tiles (`enable` first); `swiglu`: W is a gate_up
    projection (``out = 2I``, I a multiple of 16) and the result ``silu(gate) * up`` ``[rows, I]``, fused into
    the product's epilogue (the layer loop's path; equal to the product, then the native swiglu)."""
    check(x, torch.float32, "x")
    check(weight.data, torch.bfloat16, "weight")
    rows, width = x.shape
    if width != weight.in_features:
        raise ValueError(f"x has {width} features, weight expects {weight.in_features}")
    width_out = weight.out_features // 2 if swiglu else weight.out_features
    if swiglu and (weight.out_features % 32 or width_out % 16):
        raise ValueError(f"a fused SwiGLU needs 2I rows with I a multiple of 16, got {weight.out_features}")
    out = torch.empty(rows, width_out, dtype=torch.float32)
    ok(getattr(native.lib, _SWIGLU if swiglu else _GEMM)(
        native.code, x.data_ptr(), rows, width, weight.data.data_ptr(), width_out, out.data_ptr(), width_out,
    ), "gemm_bf16" + ("_swiglu" if swiglu else ""))
    return out
