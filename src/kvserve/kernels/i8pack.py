"""Quantized weights pre-arranged once, at load, for the int8-activation matmul (AVX-512 and AVX2).

The GGUF-layout int8 kernel gathers 16 weight rows into vpdpbusd's layout on every call (every decode step,
every prefill row pass). `PackedI8Weight` holds that layout instead, built once by the native `kv_pack_i8`
(csrc/qmatmul_i8_packed.h; `pack_reference` is its pure-torch twin): for each group of 16 output columns
and each 32-weight block, the quants as 4-byte pieces (piece j of column c at byte ``j*64 + c*4``; Q4
nibbles stay packed), the 16 fp16 scales d, then Q4_1's 16 fp16 m or Q8_0's 16 int16 ``sum(q)``. Columns
past ``out_features`` are zero. It is its own type, passed to C with ``qtype | PACKED_FLAG``, so no other
kernel (fp32 matmuls, dequantize, the GGUF-layout int8 kernels) can read it as GGUF blocks: they refuse it.

The engine packs with ``activation_quant="int8"`` on the native kernels (`Kernels.prepare_int8`). AVX-512's
outputs are bit-identical to its GGUF-layout kernel's; the AVX2 packed kernel reads the same layout as 8-column
halves with the same integer block sums and float epilogue, so it gives the AVX-512 bits too (its GGUF-layout
kernel, which sums 8 lanes a block, does not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kernels.quant import BLOCK, QTYPES, QuantWeight

PACKED_FLAG = 0x100  # csrc QT_I8_PACKED
GROUP_COLS = 16
PACKED_BLOCK_BYTES = {2: 288, 3: 320, 8: 576}  # Q4_0, Q4_1, Q8_0: per 16 columns x one 32-weight block
_QUANT_BYTES = {2: 256, 3: 256, 8: 512}


def packed_groups(out_features: int) -> int:
    return (out_features + GROUP_COLS - 1) // GROUP_COLS


@dataclass(slots=True)
class PackedI8Weight:
    data: torch.Tensor  # uint8 [groups, in_features / 32 * PACKED_BLOCK_BYTES[qtype]]
    qtype: int  # the GGUF type id it was packed from
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        if self.qtype not in PACKED_BLOCK_BYTES:
            raise ValueError(f"no packed int8 layout for quantization type id {self.qtype}")
        expected = (packed_groups(self.out_features), self.group_bytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected or not self.data.is_contiguous():
            raise ValueError(f"packed {self.type_name} data must be contiguous uint8 {expected}, got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def type_name(self) -> str:
        return QTYPES[self.qtype][0]

    @property
    def group_bytes(self) -> int:
        """Bytes of one 16-column group (the C kernels' row_bytes for this layout)."""
        return self.in_features // BLOCK * PACKED_BLOCK_BYTES[self.qtype]

    @property
    def code(self) -> int:
        """The qtype the C kernels take for this layout."""
        return self.qtype | PACKED_FLAG

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        return self.data.numel()


def pack_reference(weight: QuantWeight) -> PackedI8Weight:
    """The pure-torch twin of the native packing: the same bytes."""
    if weight.qtype not in PACKED_BLOCK_BYTES:
        raise ValueError(f"no packed int8 layout for {weight.type_name}")
    n, nb, block = weight.out_features, weight.in_features // BLOCK, QTYPES[weight.qtype][1]
    groups, qbytes = packed_groups(n), _QUANT_BYTES[weight.qtype]
    rows = torch.zeros(groups * GROUP_COLS, nb, block, dtype=torch.uint8)
    rows[:n] = weight.data.view(n, nb, block)
    cols = rows.view(groups, GROUP_COLS, nb, block).permute(0, 2, 1, 3)  # [groups, nb, 16, block]
    qoff = 4 if weight.qtype == 3 else 2
    quants = cols[..., qoff:qoff + qbytes // 16]  # [groups, nb, 16, 16 or 32]
    pieces = quants.reshape(groups, nb, GROUP_COLS, qbytes // 64, 4).transpose(2, 3)  # [.., piece, col, 4]
    parts = [pieces.reshape(groups, nb, qbytes), cols[..., 0:2].reshape(groups, nb, 32)]
    if weight.qtype == 3:
        parts.append(cols[..., 2:4].reshape(groups, nb, 32))
    elif weight.qtype == 8:
        sums = quants.contiguous().view(torch.int8).to(torch.int32).sum(-1).to(torch.int16)  # [groups, nb, 16]
        parts.append(sums.contiguous().view(torch.uint8).reshape(groups, nb, 32))
    elif weight.qtype != 2:
        raise AssertionError(weight.qtype)
    data = torch.cat(parts, dim=-1).reshape(groups, -1).contiguous()
    return PackedI8Weight(data, weight.qtype, weight.in_features, n)
