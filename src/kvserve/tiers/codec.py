"""Block payloads: one block's K and V across all layers, with a header that pins its layout.

The pool is ``[layers, 2, blocks, block_size, kv_heads, head_dim]``, so block ``b`` is
``pool[:, :, b]`` of shape ``[layers, 2, block_size, kv_heads, head_dim]``. A payload is

    magic    4 bytes  b"KVB" + KV_LAYOUT_VERSION (one byte)
    dtype    1 byte   code from _DTYPE_CODES
    ndim     1 byte
    shape    ndim × u32 (little-endian)
    padding  zeros up to a multiple of 16 bytes (so the data can be viewed in place as any dtype)
    data     the block's elements, C order, native little-endian

`decode` refuses a payload whose version, dtype or shape differ from what the reader expects, so a
payload is never read back into another layout even if a key were shared by mistake.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.tiers.store import KV_LAYOUT_VERSION

_MAGIC = b"KVB" + bytes([KV_LAYOUT_VERSION])
_ALIGN = 16
_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.uint8: 4, torch.float8_e4m3fn: 5,
}


class BlockFormatError(ValueError):
    """A payload that is not a block of the layout the reader expects."""


@dataclass(frozen=True, slots=True)
class BlockCodec:
    """Encoder/decoder for the blocks of one pool (fixed dtype and block shape)."""

    dtype: torch.dtype
    shape: tuple[int, ...]  # [layers, 2, block_size, kv_heads, head_dim]

    @classmethod
    def for_pool(cls, pool_tensor: torch.Tensor) -> BlockCodec:
        layers, two, _, block_size, kv_heads, head_dim = pool_tensor.shape
        return cls(pool_tensor.dtype, (layers, two, block_size, kv_heads, head_dim))

    @property
    def header(self) -> bytes:
        if self.dtype not in _DTYPE_CODES:
            raise BlockFormatError(f"dtype {self.dtype} has no block code")
        dims = struct.pack(f"<{len(self.shape)}I", *self.shape)
        header = _MAGIC + bytes([_DTYPE_CODES[self.dtype], len(self.shape)]) + dims
        return header + bytes(-len(header) % _ALIGN)

    @property
    def data_bytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()

    @property
    def payload_bytes(self) -> int:
        return len(self.header) + self.data_bytes

    def encode(self, block: torch.Tensor) -> bytes:
        """Header ‖ bytes of `block` (any device; copied to host)."""
        if block.dtype != self.dtype or tuple(block.shape) != self.shape:
            raise BlockFormatError(f"block {block.dtype} {tuple(block.shape)} != codec {self.dtype} {self.shape}")
        data = block.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        return self.header + data

    def decode(self, payload: bytes | memoryview) -> torch.Tensor:
        """The block tensor (CPU) of a payload; BlockFormatError when the header or size differ."""
        header = self.header
        if len(payload) != len(header) + self.data_bytes:
            raise BlockFormatError(f"payload of {len(payload)} bytes, expected {len(header) + self.data_bytes}")
        if bytes(payload[: len(header)]) != header:
            raise BlockFormatError("payload header differs (layout version, dtype or shape)")
        data = bytearray(payload[len(header) :])  # writable copy: frombuffer shares memory
        return torch.frombuffer(data, dtype=torch.uint8).view(self.dtype).view(self.shape)

    def encode_blocks(self, pool_tensor: torch.Tensor, block_ids: Sequence[int]) -> list[bytes]:
        """Payloads of pool blocks `block_ids`, one gather + one device→host copy for the batch."""
        if not block_ids:
            return []
        index = torch.tensor(list(block_ids), device=pool_tensor.device)
        gathered = pool_tensor.index_select(2, index).movedim(2, 0).to("cpu").contiguous()
        return [self.encode(gathered[i]) for i in range(len(block_ids))]

    def write_blocks(self, pool_tensor: torch.Tensor, block_ids: Sequence[int], blocks: Sequence[torch.Tensor]) -> None:
        """Copy decoded `blocks` into pool blocks `block_ids` (non-blocking from pinned memory on CUDA)."""
        for block_id, block in zip(block_ids, blocks, strict=True):
            pool_tensor[:, :, block_id].copy_(block, non_blocking=block.is_pinned())
