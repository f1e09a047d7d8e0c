"""The compute roofline beside membw.py's memory one: how many vector operations a second this CPU retires.

CPUs the project lands on differ in more than their flags: a Zen 1 core splits every 256-bit operation in
two, a Zen 3 or Intel core does not. What bounds a kernel there is not visible in `lscpu`, and this VM has no
hardware counters, so this measures it: a small C loop (built here with g++) keeps 12 independent chains of
one operation in flight and counts them per nanosecond, with 1 and 2 threads -- 256-bit FMA, mul, add and
int32 -> float conversion, 128-bit FMA, and the int8 path's `vpmaddubsw`; on an AVX-512 CPU also the 512-bit
FMA, AVX512-BF16's `vdpbf16ps` and VNNI's `vpdpbusd` (the peaks of bf16 attention products and of the int8
matmuls; turn_bound.py uses them) -- plus the clock, from a chain of dependent one-cycle integer adds (on a
shared VM it moves between runs: the per-ns rates are the figures to trust). Then the floors they imply for
the default model's single-request decode, 1 thread: the exact path's Q4_1 kernel issues, per 32 weights and
output, 8 256-bit FMAs (4 to dequantize, d*q + m, and 4 for the dot) and 4 int32 -> float conversions
(csrc/simd.h `q4_1_block`, csrc/impl.h `dot_tile`), so its matmuls cannot run faster than blocks x 8 / (FMA
rate), nor blocks x 4 / (conversion rate); benchmarks/decode_step.py's "matmuls, cache-resident weights" row
is the measured figure to set beside them (the gap is what the floors leave out: the nibble unpacking, loads,
and instruction issue).

    python benchmarks/fp_rate.py
    python benchmarks/fp_rate.py --out fp_rate_zen1   # another CPU's results beside the first
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compile_c_loop, markdown_table, write_result  # noqa: E402
from kvserve.kernels.native import cpu_flags  # noqa: E402
from membw import step_bytes  # noqa: E402

LOOPS = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>

// 12 chains of OP in 12 named registers (an array indexed in a loop would live in memory).
#define CHAINS(T, INIT, OP)                                                                         \
    {                                                                                               \
        T v0 = INIT, v1 = INIT, v2 = INIT, v3 = INIT, v4 = INIT, v5 = INIT, v6 = INIT, v7 = INIT,   \
          v8 = INIT, v9 = INIT, v10 = INIT, v11 = INIT;                                             \
        for (int64_t i = 0; i < iterations; ++i) {                                                  \
            v0 = OP(v0); v1 = OP(v1); v2 = OP(v2); v3 = OP(v3); v4 = OP(v4); v5 = OP(v5);           \
            v6 = OP(v6); v7 = OP(v7); v8 = OP(v8); v9 = OP(v9); v10 = OP(v10); v11 = OP(v11);       \
            asm volatile("" : "+x"(v0), "+x"(v1), "+x"(v2), "+x"(v3), "+x"(v4), "+x"(v5), "+x"(v6),  \
                         "+x"(v7), "+x"(v8), "+x"(v9), "+x"(v10), "+x"(v11));                       \
        }                                                                                           \
        float out[8];                                                                               \
        __builtin_memcpy(out, &v3, sizeof(float));                                                  \
        sink += out[0];                                                                             \
    }

#define FMA8(a) _mm256_fmadd_ps(a, m8, c8)
#define MUL8(a) _mm256_mul_ps(a, m8)
#define ADD8(a) _mm256_add_ps(a, c8)
#define CVT8(a) _mm256_castsi256_ps(_mm256_cvtps_epi32(_mm256_cvtepi32_ps(_mm256_castps_si256(a))))
#define FMA4(a) _mm_fmadd_ps(a, m4, c4)
#define MADDUBS(a) _mm256_maddubs_epi16(ones, a)

// Operations per nanosecond over all `threads` threads (each runs the same loop). CVT8 is a round trip
// (int32 -> float -> int32), counted as two operations.
extern "C" double op_rate(int which, int64_t iterations, int threads) {
    const auto start = std::chrono::steady_clock::now();
    double sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        const __m256 m8 = _mm256_set1_ps(0.999f), c8 = _mm256_set1_ps(0.001f);
        const __m128 m4 = _mm_set1_ps(0.999f), c4 = _mm_set1_ps(0.001f);
        const __m256i ones = _mm256_set1_epi8(1);
        if (which == 0) CHAINS(__m256, c8, FMA8)
        if (which == 1) CHAINS(__m256, c8, MUL8)
        if (which == 2) CHAINS(__m256, c8, ADD8)
        if (which == 3) CHAINS(__m256, c8, CVT8)
        if (which == 4) CHAINS(__m128, c4, FMA4)
        if (which == 5) CHAINS(__m256i, ones, MADDUBS)
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double per_op = which == 3 ? 24.0 : 12.0;
    return sink == 12345.678 ? 0 : per_op * iterations * threads / seconds / 1e9;
}

// The 512-bit operations, in functions of their own built for AVX-512 (called only where the CPU has the flags):
// an FMA, AVX512-BF16's vdpbf16ps (32 bf16 pair products) and VNNI's vpdpbusd (64 int8 products).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx512bf16")
#define FMA16(a) _mm512_fmadd_ps(a, m16, c16)
#define DPBF16(a) _mm512_dpbf16_ps(a, b16, b16)
#define DPBUSD(a) _mm512_dpbusd_epi32(a, u8, u8)
extern "C" double op_rate_512(int which, int64_t iterations, int threads) {
    const auto start = std::chrono::steady_clock::now();
    double sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        const __m512 m16 = _mm512_set1_ps(0.999f), c16 = _mm512_set1_ps(0.001f);
        const __m512bh b16 = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.5f));
        const __m512i u8 = _mm512_set1_epi8(1);
        if (which == 0) CHAINS(__m512, c16, FMA16)
        if (which == 1) CHAINS(__m512, c16, DPBF16)
        if (which == 2) CHAINS(__m512i, u8, DPBUSD)
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return sink == 12345.678 ? 0 : 12.0 * iterations * threads / seconds / 1e9;
}
#pragma GCC pop_options

// One-cycle dependent adds per nanosecond: the clock in GHz (the loop counter runs beside the chain).
extern "C" double clock_ghz(int64_t iterations) {
    const auto start = std::chrono::steady_clock::now();
    int64_t a = 0;
    for (int64_t i = 0; i < iterations; ++i) asm volatile("add $1, %0" : "+r"(a));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return a / seconds / 1e9;
}
"""

OPS = {  # which -> (label, floats per operation for GFLOP/s, 0 when not a float multiply-add)
    0: ("256-bit FMA", 16),
    1: ("256-bit mul", 8),
    2: ("256-bit add", 8),
    3: ("256-bit int32 <-> float conversion", 0),
    4: ("128-bit FMA", 8),
    5: ("256-bit vpmaddubsw (int8)", 0),
}
OPS_512 = {  # which -> (label, multiply-adds per operation, the CPU flags it needs)
    0: ("512-bit FMA", 16, ("avx512f",)),
    1: ("512-bit vdpbf16ps (bf16 pairs)", 32, ("avx512f", "avx512_bf16")),
    2: ("512-bit vpdpbusd (int8)", 64, ("avx512f", "avx512_vnni")),
}
Q4_FMAS_PER_BLOCK = 8  # csrc/impl.h dot_tile on AVX2, one row: 4 FMAs dequantize d*q + m, 4 dot them with x
Q4_CONVERSIONS_PER_BLOCK = 4  # csrc/simd.h q4_1_block: the 32 nibbles as 4 vectors of floats


def build(workdir: Path) -> ctypes.CDLL:
    lib = compile_c_loop(LOOPS, workdir, "rates", ("-mavx2", "-mfma"))
    lib.op_rate.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    lib.op_rate.restype = ctypes.c_double
    lib.op_rate_512.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    lib.op_rate_512.restype = ctypes.c_double
    lib.clock_ghz.argtypes = [ctypes.c_int64]
    lib.clock_ghz.restype = ctypes.c_double
    return lib


def rates_512(lib: ctypes.CDLL, iterations: int, passes: int, threads: int) -> dict[int, float]:
    """Operations per ns of OPS_512's operations this CPU has (best of `passes`), with `threads` threads."""
    flags = cpu_flags()
    return {which: max(lib.op_rate_512(which, iterations, threads) for _ in range(passes))
            for which, (_, _, needs) in OPS_512.items() if all(flag in flags for flag in needs)}


def q4_blocks() -> int:
    """32-weight Q4_1 blocks x output columns in one decode step's layer matmuls (the lm head apart)."""
    return step_bytes(0)["layer weights (Q4_1)"] // 20  # a Q4_1 block is 20 bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=50_000_000)
    parser.add_argument("--passes", type=int, default=3, help="best of this many runs per figure")
    parser.add_argument("--out", default="fp_rate", metavar="NAME", help="results file benchmarks/results/NAME.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        lib = build(Path(workdir))
        ghz = max(lib.clock_ghz(args.iterations * 4) for _ in range(args.passes))
        rates = {(which, threads): max(lib.op_rate(which, args.iterations, threads) for _ in range(args.passes))
                 for which in OPS for threads in (1, 2)}
        wide = {threads: rates_512(lib, args.iterations, args.passes, threads) for threads in (1, 2)}
    rows = []
    for which, (label, floats) in OPS.items():
        one, two = rates[which, 1], rates[which, 2]
        rows.append([label, one, one / ghz, two, floats * one if floats else "–", floats * two if floats else "–"])
        print(label, f"{one:.2f} / {two:.2f} per ns (1 / 2 threads)", flush=True)
    for which, one in wide[1].items():
        label, macs, _ = OPS_512[which]
        two = wide[2][which]
        rows.append([label, one, one / ghz, two, 2 * macs * one, 2 * macs * two])
        print(label, f"{one:.2f} / {two:.2f} per ns (1 / 2 threads)", flush=True)
    blocks = q4_blocks()
    fma_ms = blocks * Q4_FMAS_PER_BLOCK / (rates[0, 1] * 1e9) * 1e3
    cvt_ms = blocks * Q4_CONVERSIONS_PER_BLOCK / (rates[3, 1] * 1e9) * 1e3
    table = (
        f"Clock (dependent one-cycle adds): **{ghz:.2f} GHz**.\n\n"
        + markdown_table(["operation", "per ns, 1 thread", "per cycle, 1 thread", "per ns, 2 threads",
                          "GFLOP/s, 1 thread", "GFLOP/s, 2 threads"], rows)
        + f"\n\nThe exact path's single-request decode floors, 1 thread, for {blocks:,} Q4_1 block-columns of layer "
        f"matmuls per token: {Q4_FMAS_PER_BLOCK} FMAs each at {rates[0, 1]:.2f} per ns = **{fma_ms:.1f} ms**; "
        f"{Q4_CONVERSIONS_PER_BLOCK} conversions each at {rates[3, 1]:.2f} per ns = **{cvt_ms:.1f} ms** "
        "(benchmarks/decode_step.py measures what they take)."
    )
    path = write_result(args.out, "Vector operation rates: the compute roofline", table,
                        "12 independent chains of one operation per thread, best of "
                        f"{args.passes}; 2 threads run the same loop each.")
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
