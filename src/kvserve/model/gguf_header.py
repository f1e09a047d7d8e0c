"""A fast GGUF reader: metadata and tensor directory in one pass, arrays read in bulk.

`gguf.GGUFReader` builds a numpy view for every part of every field -- for a 49k-token vocabulary and
48k merges that is hundreds of thousands of small objects and most of a cold start. This reader walks
the same format (magic, version, counts; key/values; tensor infos; aligned data) with `struct` over a
read-only mmap, reads numeric arrays with one `np.frombuffer` each and string arrays with a tight loop,
and returns the same plain values `ReaderField.contents()` gives, plus tensor descriptors whose `.data`
is a view of a copy-on-write mapping shaped as GGUFReader shapes it. Every malformed or truncated input is a
ValueError naming the file.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")
_FLOAT_TYPES = {  # tensor types GGUFReader exposes with their element dtype; the rest are raw bytes
    gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@dataclass(slots=True)
class GGUFTensor:
    """What the loader needs of one tensor (the attributes it used from gguf.ReaderTensor)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: innermost dimension first
    n_bytes: int
    data_offset: int
    data: np.ndarray  # read-only view of the file


@dataclass(slots=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    mapping: mmap.mmap


class _Cursor:
    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer, self.pos, self.size, self.path = buffer, 0, len(buffer), path

    def need(self, count: int) -> None:
        if count < 0 or self.pos + count > self.size:
            raise ValueError(f"{self.path} is truncated or corrupt: needs {count} bytes at offset {self.pos}")

    def scalar(self, fmt: str) -> Any:
        width = struct.calcsize(fmt)
        self.need(width)
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += width
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        self.need(length)
        text = self.buffer[self.pos : self.pos + length].decode("utf-8")
        self.pos += length
        return text

    def strings(self, count: int) -> list[str]:
        """`count` length-prefixed strings: the vocabulary's hot loop, kept free of method calls."""
        buffer, pos, size = self.buffer, self.pos, self.size
        unpack = _LENGTH.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            end = pos + 8 + unpack(buffer, pos)[0]
            if end > size:
                self.pos = pos
                self.need(end - pos)
            append(buffer[pos + 8 : end].decode("utf-8"))
            pos = end
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise ValueError(f"{self.path} is corrupt: unknown metadata value type {kind}")

    def array(self) -> list[Any]:
        kind, count = self.scalar("<I"), self.scalar("<Q")
        if kind in _NUMPY:
            dtype = np.dtype(_NUMPY[kind])
            self.need(count * dtype.itemsize)
            values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return values.tolist()
        if kind == _STRING:
            self.need(count * 8)  # every string has at least its 8-byte length
            return self.strings(count)
        if kind == _ARRAY:
            self.need(count * 12)
            return [self.array() for _ in range(count)]
        raise ValueError(f"{self.path} is corrupt: unknown array element type {kind}")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse `path`'s metadata and tensor directory; ValueError (naming the file) on any malformation."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            # Copy-on-write: tensors are writable views (torch takes them without a copy), pages come from
            # the OS file cache when first read, and nothing is ever written back to the file.
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as err:  # ValueError: an empty file cannot be mapped
        raise ValueError(f"{path} is not a GGUF file: {err}") from err
    try:
        return _parse(_Cursor(mapping, path), mapping)
    except ValueError as err:
        raise ValueError(str(err) if str(path) in str(err) else f"{path} is corrupt: {err}") from err
    except (struct.error, UnicodeDecodeError, OverflowError, MemoryError, KeyError, IndexError) as err:
        raise ValueError(f"{path} is not a valid GGUF file (corrupt or truncated): {err!r}") from err


def _parse(cursor: _Cursor, mapping: mmap.mmap) -> GGUFFile:
    path = cursor.path
    cursor.need(24)
    if bytes(mapping[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (bad magic bytes)")
    cursor.pos = 4
    version, tensor_count, kv_count = cursor.scalar("<I"), cursor.scalar("<Q"), cursor.scalar("<Q")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version}")
    if kv_count * 12 > cursor.size or tensor_count * 24 > cursor.size:
        raise ValueError(f"{path} is corrupt: header claims {kv_count} keys and {tensor_count} tensors")
    # GGUFReader lists the header counts as pseudo-fields too; kept for identical metadata.
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
    for _ in range(kv_count):
        key = cursor.string()
        if key in metadata:
            raise ValueError(f"{path} is corrupt: duplicate metadata key {key!r}")
        metadata[key] = cursor.value(cursor.scalar("<I"))
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = int(metadata.get("general.alignment", 32))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path} is corrupt: general.alignment {alignment}")
    start = -(-cursor.pos // alignment) * alignment
    names: set[str] = set()
    tensors = []
    for name, dims, kind, offset in infos:
        if name in names:
            raise ValueError(f"{path} is corrupt: duplicate tensor {name!r}")
        names.add(name)
        tensors.append(_tensor(path, mapping, name, dims, kind, start + offset))
    return GGUFFile(path, metadata, tensors, mapping)


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    n_dims = cursor.scalar("<I")
    if n_dims > 4:
        raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
    dims = tuple(cursor.scalar("<Q") for _ in range(n_dims))
    return name, dims, cursor.scalar("<I"), cursor.scalar("<Q")


def _tensor(path: Path, mapping: mmap.mmap, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
    tensor_type = gguf.GGMLQuantizationType(kind)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    n_elems = math.prod(dims)  # Python ints: a corrupt dimension cannot overflow into a small count
    if not dims or n_elems <= 0 or n_elems % block_elems or dims[0] % block_elems:
        raise ValueError(f"tensor {name!r}: shape {dims} does not fit {tensor_type.name} blocks")
    n_bytes = n_elems // block_elems * block_bytes
    if offset + n_bytes > len(mapping):
        raise ValueError(f"{path} is truncated: tensor {name!r} needs bytes up to {offset + n_bytes}, "
                         f"file has {len(mapping)}")
    shape = tuple(reversed(dims))
    if tensor_type in _FLOAT_TYPES:
        dtype = np.dtype(_FLOAT_TYPES[tensor_type])
        data = np.frombuffer(mapping, dtype=dtype, count=n_elems, offset=offset).reshape(shape)
    else:
        shape = (*shape[:-1], shape[-1] // block_elems * block_bytes)
        data = np.frombuffer(mapping, dtype=np.uint8, count=n_bytes, offset=offset).reshape(shape)
    return GGUFTensor(name, tensor_type, dims, n_bytes, offset, data)
