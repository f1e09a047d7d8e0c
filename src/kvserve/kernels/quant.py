"""GGUF block-quantized weights kept in their stored form: the bytes of each row plus the block format.

A `QuantWeight` is a ``[out_features, in_features]`` matrix whose rows are runs of 32-weight blocks
(ggml's layout): Q8_0 = fp16 scale d + 32 int8 (w = d*q); Q4_1 = fp16 d, fp16 m + 16 bytes of nibbles
(w = d*q + m; the low nibble of byte j is weight j, the high nibble weight j+16); Q4_0 = fp16 d + nibbles
(w = d*(q - 8)). Rows can be permuted and concatenated as bytes, which is all loading needs.

BF16 (ggml id 30) rides the same container without being a quantization: dense bfloat16 weights as rows of
raw bf16 values (64 bytes per 32), which the native float kernels widen to fp32 in registers. That is how a
CPU without native bf16 arithmetic runs ``--dtype bfloat16``: bf16 in memory, fp32 in the arithmetic.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

BLOCK = 32
# ggml type id -> (name, bytes per 32-weight block)
QTYPES: dict[int, tuple[str, int]] = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 8: ("Q8_0", 34), 30: ("BF16", 64)}
BF16 = 30
BLOCK_QTYPES = frozenset({2, 3, 8})  # the block quantizations: kept as stored from a GGUF, read by the int8 kernels


@dataclass(slots=True)
class QuantWeight:
    data: torch.Tensor  # uint8 [out_features, row_bytes]
    qtype: int  # ggml type id, a key of QTYPES
    in_features: int

    def __post_init__(self) -> None:
        if self.qtype not in QTYPES:
            raise ValueError(f"unsupported quantization type id {self.qtype}")
        if self.in_features % BLOCK:
            raise ValueError(f"in_features {self.in_features} is not a multiple of {BLOCK}")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != self.row_bytes:
            raise ValueError(
                f"{self.type_name} data must be uint8 [rows, {self.row_bytes}], got {self.data.dtype} "
                f"{tuple(self.data.shape)}"
            )

    @property
    def type_name(self) -> str:
        return QTYPES[self.qtype][0]

    @property
    def row_bytes(self) -> int:
        return self.in_features // BLOCK * QTYPES[self.qtype][1]

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        return self.data.numel()


def concat_rows(weights: list[QuantWeight]) -> QuantWeight | None:
    """Stack matrices with the same format and width (fused q/k/v, gate/up); None if they differ. Matrices
    stored back to back in one storage (a lone o_proj or down_proj, gate then up) become one view of it: they
    stay in the file's mapping (shared with the page cache and every process that maps the file) instead of
    private copies."""
    first = weights[0]
    if any(w.qtype != first.qtype or w.in_features != first.in_features for w in weights):
        return None
    if _back_to_back(weights):
        rows = sum(w.data.shape[0] for w in weights)
        return QuantWeight(first.data.as_strided((rows, first.data.shape[1]), first.data.stride()), first.qtype,
                           first.in_features)
    return QuantWeight(torch.cat([w.data for w in weights], dim=0).contiguous(), first.qtype, first.in_features)


def _back_to_back(weights: list[QuantWeight]) -> bool:
    """Whether the matrices are contiguous slices of one storage, each starting where the previous ends."""
    storage = weights[0].data.untyped_storage().data_ptr()
    return all(w.data.is_contiguous() and w.data.untyped_storage().data_ptr() == storage for w in weights) and all(
        current.data.storage_offset() == previous.data.storage_offset() + previous.data.numel()
        for previous, current in itertools.pairwise(weights)
    )


def bf16_weight(dense: torch.Tensor) -> QuantWeight:
    """A dense ``[out, in]`` matrix rounded to bfloat16 (as ``tensor.to(torch.bfloat16)`` rounds) and kept
    as BF16 rows: half the bytes of fp32, read by the native kernels at fp32 arithmetic."""
    if dense.dim() != 2:
        raise ValueError(f"a BF16 weight is a matrix, got shape {tuple(dense.shape)}")
    rows, cols = dense.shape
    raw = dense.detach().to(torch.bfloat16).contiguous().view(torch.uint8).reshape(rows, cols * 2)
    return QuantWeight(raw, BF16, cols)
