"""Argument checks the ctypes binding (native.py) runs before any tensor's raw pointer reaches C: a loud,
specific ValueError instead of a crash or a silent wrong read."""

from __future__ import annotations

import torch

# Pool element types (csrc/simd.h KT, KVT_* codes): float32, bf16, fp8 e4m3fn (`--kv-cache-dtype fp8`).
KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}


def check_range(values: torch.Tensor, count: int, limit: int, name: str) -> None:
    if values.shape != (count,):
        raise ValueError(f"{name} must have shape ({count},), got {tuple(values.shape)}")
    if count and (int(values.min()) < 0 or int(values.max()) >= limit):
        raise ValueError(f"{name} out of range [0, {limit})")


def check_pool(key_blocks: torch.Tensor, value_blocks: torch.Tensor) -> int:
    """The pool's element-type code (KV_DTYPE_CODES) once both halves are contiguous CPU tensors of it."""
    for tensor, name in ((key_blocks, "key_blocks"), (value_blocks, "value_blocks")):
        check(tensor, key_blocks.dtype if key_blocks.dtype in KV_DTYPE_CODES else torch.float32, name)
    return KV_DTYPE_CODES[key_blocks.dtype]


def check(tensor: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor, got {tensor.dtype} on {tensor.device}")


def ok(status: int, kernel: str) -> None:
    if status != 0:
        reasons = {-1: "unsupported quantization type", -2: "unsupported shape", -3: "unknown ISA", -4: "KV dtype",
                   -5: "bf16 attention products need a bfloat16 KV pool",
                   -6: "the bf16 GEMM needs AMX-BF16 tiles, switched on (kernels/bf16pack.py)"}
        raise ValueError(f"native {kernel}: {reasons.get(status, f'error {status}')}")
