"""Which exact quantized matmul runs a step's rows: the per-row kernel (csrc/impl.h) or the wide GEMM
(csrc/qgemm.h), by weight type, chosen for the CPU when the library loads.

The per-row kernel converts each weight block to floats once per 4 rows and is bound by that conversion;
the wide GEMM converts each weight panel once per call and is bound by float32 FMAs over tiles of 8, 16 or
32 rows. Where the wide GEMM wins therefore depends on how many FMAs the CPU retires per cycle. Measured
(`benchmarks/qgemm.py`, ms per layer of the default model, median of interleaved rounds): on an Intel Xeon
with two 512-bit FMA units the wide GEMM wins from 5 rows (the default); on a Zen 4, whose AVX-512 runs
on 256-bit units, the per-row kernel stays ahead up to 12 rows for Q4_1 (8 rows: 0.54 against 0.62 ms at 2
threads, 1.06 against 1.08 at 1; 16 rows: 0.95 against 0.89) and up to 5 for Q8_0 (6 rows at 1 thread:
1.07 against 1.04); end to end (`benchmarks/crossover.py`) steps of 14 rows still ran 1.17x faster on
the per-row kernel and 16 rows at par, hence Q4_1 from 16. Other CPUs keep the default until measured.
Both kernels are exact to the dequantized weights up to summation order, so the choice moves no token
beyond what summation order may.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from kvserve.kernels.quant import QTYPES

if TYPE_CHECKING:
    from kvserve.kernels.native import NativeLibrary

DEFAULT_MIN_ROWS = 5  # the C default too (csrc/kernels.cpp KV_QGEMM_MIN_ROWS_DEFAULT)
_CODES = {name: code for code, (name, _) in QTYPES.items()}
Q4_1, Q8_0 = _CODES["Q4_1"], _CODES["Q8_0"]  # GGUF type codes
# (vendor_id, cpu family) -> {weight type: first row count for the wide GEMM}. AMD family 25 with AVX-512
# is Zen 4 (Zen 3 has no AVX-512; Zen 5 is family 26, with full-width 512-bit units: not measured).
MEASURED = {("AuthenticAMD", 25): {Q4_1: 16, Q8_0: 6}}


def cpu_identity() -> tuple[str, int]:
    """(vendor_id, cpu family) from /proc/cpuinfo; ("", 0) where it cannot be read."""
    vendor, family = "", 0
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key.strip() == "cpu family" and not family:
                    family = int(value.strip() or 0)
                if vendor and family:
                    break
    except (OSError, ValueError):
        pass
    return vendor, family


def crossovers(isa: str, identity: tuple[str, int]) -> dict[int, int]:
    """The measured crossovers for this CPU's AVX-512 build; {} (the default everywhere) otherwise."""
    return dict(MEASURED.get(identity, {})) if isa == "avx512" else {}


def set_min_rows(library: NativeLibrary, qtype: int, rows: int) -> int:
    """Run weight type `qtype`'s matmuls of `rows`+ rows on the wide GEMM, in the layer loop and in
    `Kernels.linear` alike, for this handle's build (AVX2 or AVX-512: each keeps its own; benchmarks and tests
    compare both kernels); returns the value before."""
    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    switch = getattr(library.lib, "kv_qgemm_min_rows", None)
    if switch is None:
        raise RuntimeError("this native library predates per-type crossovers (no kv_qgemm_min_rows)")
    previous = switch(library.code, qtype, rows)  # the library's value (its default when never set)
    library.qgemm_min_rows[qtype] = rows  # mirrored for Kernels.linear: no ctypes call per matmul
    return previous


def apply(library: NativeLibrary) -> None:
    """Set the measured crossovers of this CPU on a freshly loaded library."""
    switch = getattr(library.lib, "kv_qgemm_min_rows", None)
    if switch is not None:
        switch.argtypes, switch.restype = [ctypes.c_int, ctypes.c_int, ctypes.c_int64], ctypes.c_int64
    for qtype, rows in crossovers(library.isa, cpu_identity()).items():
        set_min_rows(library, qtype, rows)

