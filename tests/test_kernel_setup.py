"""Building and choosing kernels, the fast GGUF reader and the lazily committed pool."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve.kernels.ops import Kernels
from kvserve.kv.pool import LAZY_POOL_BYTES, KVPool, KVPoolShape
from kvserve.model.gguf import open_gguf, read_metadata
from kvserve.model.gguf_header import read_gguf


def test_build_failure_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVSERVE_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="kvserve.kernels.ops"):
        kernels = Kernels.create("native")
    assert kernels.backend == "torch" and kernels.native is None
    assert "native kernels unavailable" in caplog.text


def test_auto_dtype_is_bf16_only_with_native_bf16():
    kernels = Kernels.create("native")
    expected = "bfloat16" if kernels.native_bf16() else "float32"
    assert kernels.resolve_dtype("auto", "dense") == expected
    assert kernels.resolve_dtype("auto", "native") == "float32"  # quantized weights: fp32 activations
    assert kernels.resolve_dtype("float16", "dense") == "float16"


def test_large_pool_is_lazy_zeroed_and_writable():
    shape = KVPoolShape(num_layers=2, num_blocks=LAZY_POOL_BYTES // (2 * 2 * 16 * 2 * 64 * 4) + 1, block_size=16,
                        num_kv_heads=2, head_dim=64)
    pool = KVPool(shape, torch.float32, "cpu")
    assert pool.nbytes() >= LAZY_POOL_BYTES and pool.tensor.is_contiguous()
    keys, values = pool.layer(1)
    assert keys.abs().sum() == 0 and values[-1].abs().sum() == 0  # zero pages, never garbage
    keys[3].fill_(2.0)
    assert pool.tensor[1, 0, 3].eq(2.0).all() and pool.tensor[1, 1, 3].eq(0).all()
    # Private anonymous memory, as the docstring says (Python's mmap defaults to MAP_SHARED: shmem pages).
    assert "sh" not in _vm_flags(pool.tensor.data_ptr())


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the /proc/self/smaps mapping that holds `address` ("sh": shared)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:  # a mapping's header: its address range
            low, high = (int(part, 16) for part in head[0].split("-"))
            inside = low <= address < high
        elif inside and head[0] == "VmFlags:":
            return head[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.model
def test_fast_reader_matches_gguf_reader():
    from kvserve.model.registry import resolve_model

    path = resolve_model("smollm2-135m")
    ours, theirs = read_gguf(path), open_gguf(path)
    expected = read_metadata(theirs)
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_bytes, mine.data_offset) == (
            reference.name, reference.tensor_type, int(reference.n_bytes), int(reference.data_offset))
        assert mine.data.shape == reference.data.shape and mine.data.dtype == reference.data.dtype
        assert np.array_equal(mine.data, reference.data)


def test_avx512_without_vnni_gets_avx2():
    """The AVX-512 build's int8 kernels are vpdpbusd throughout: a CPU without VNNI must not be given it."""
    from kvserve.kernels.native import best_isa

    assert best_isa({"avx2", "avx512", "avx512_vnni"}) == "avx512"
    assert best_isa({"avx2", "avx512"}) == "avx2"
    assert best_isa(set()) is None
