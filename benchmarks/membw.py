"""The decode roofline: this machine's read bandwidth, and the bytes one decode step of the default GGUF
must read, so a single-request decode rate can be set against its floor (ms / token = bytes / bandwidth).

Bandwidth is a streaming read (a small C loop, built here with g++: 32-byte vector loads XOR-ed into four
accumulators, split over OpenMP threads; best of several passes), with 1 and 2 threads, at three sizes:
32 MiB (inside the last-level cache), the model's own working set (96 MiB: a CPU whose last-level cache
holds it streams decode weights from cache, not DRAM) and 1 GiB (DRAM). Bytes per step: every weight
tensor in its stored GGUF format (the layers' Q4_1 blocks and the Q8_0 token embedding, which is also the
lm head), the norms, and the KV cache attention reads at the benchmark's context (kvserve keeps float32 KV,
llama.cpp float16).

    python benchmarks/membw.py
    python benchmarks/membw.py --out membw_zen1   # another CPU's results beside the first
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compile_c_loop, markdown_table, write_result  # noqa: E402
from kvserve.model.registry import resolve_model  # noqa: E402

MIB = 1 << 20


READ_LOOP = r"""
#include <immintrin.h>
#include <cstdint>
extern "C" uint64_t stream_read(const uint8_t* p, int64_t n, int threads) {
    uint64_t total = 0;
#pragma omp parallel for reduction(^ : total) schedule(static) num_threads(threads)
    for (int64_t chunk = 0; chunk < n / 4096; ++chunk) {
        const __m256i* v = reinterpret_cast<const __m256i*>(p + chunk * 4096);
        __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
        for (int i = 0; i < 4096 / 32; i += 4) {
            a = _mm256_xor_si256(a, _mm256_load_si256(v + i));
            b = _mm256_xor_si256(b, _mm256_load_si256(v + i + 1));
            c = _mm256_xor_si256(c, _mm256_load_si256(v + i + 2));
            d = _mm256_xor_si256(d, _mm256_load_si256(v + i + 3));
        }
        a = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
        total ^= static_cast<uint64_t>(_mm256_extract_epi64(a, 0) ^ _mm256_extract_epi64(a, 3));
    }
    return total;
}
"""


def build_reader(workdir: Path) -> ctypes.CDLL:
    lib = compile_c_loop(READ_LOOP, workdir, "read")
    lib.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.stream_read.restype = ctypes.c_uint64
    return lib


def read_bandwidth(lib: ctypes.CDLL, num_bytes: int, threads: int, passes: int) -> float:
    """GB/s of the best of `passes` full reads of a `num_bytes` buffer."""
    buffer = torch.randint(0, 255, (num_bytes + 64,), dtype=torch.uint8)
    address = (buffer.data_ptr() + 63) // 64 * 64  # 32-byte aligned loads
    lib.stream_read(address, num_bytes, threads)  # touch and warm
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        lib.stream_read(address, num_bytes, threads)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def step_bytes(context: int) -> dict[str, int]:
    """Bytes one single-request decode step reads, by part, from the GGUF's own tensor table."""
    import gguf

    reader = gguf.GGUFReader(str(resolve_model("smollm2-135m")))
    parts = {"layer weights (Q4_1)": 0, "lm head = token_embd (Q8_0)": 0, "norms (F32)": 0}
    layers = kv_heads = head_dim = 0
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            parts["lm head = token_embd (Q8_0)"] += int(tensor.n_bytes)
        elif tensor.tensor_type.name == "F32":
            parts["norms (F32)"] += int(tensor.n_bytes)
        else:
            parts["layer weights (Q4_1)"] += int(tensor.n_bytes)
        if tensor.name.endswith("attn_k.weight"):
            layers += 1
            kv_width = int(tensor.shape[1])
    arch = "llama"
    kv_heads = int(reader.fields[f"{arch}.attention.head_count_kv"].parts[-1][0])
    heads = int(reader.fields[f"{arch}.attention.head_count"].parts[-1][0])
    hidden = int(reader.fields[f"{arch}.embedding_length"].parts[-1][0])
    head_dim = hidden // heads
    assert kv_width == kv_heads * head_dim, (kv_width, kv_heads, head_dim)
    per_token = layers * 2 * kv_heads * head_dim
    parts[f"KV at {context} tokens, fp32 (kvserve)"] = per_token * 4 * context
    parts[f"KV at {context} tokens, fp16 (llama.cpp)"] = per_token * 2 * context
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=8)
    parser.add_argument("--context", type=int, default=144, help="decode context (the 128-token prompt + 16)")
    parser.add_argument("--out", default="membw", metavar="NAME", help="results file benchmarks/results/NAME.md")
    args = parser.parse_args()
    parts = step_bytes(args.context)
    weights = sum(v for k, v in parts.items() if not k.startswith("KV"))
    kv_fp32 = next(v for k, v in parts.items() if "fp32" in k)
    kv_fp16 = next(v for k, v in parts.items() if "fp16" in k)
    sizes = {"32 MiB": 32 * MIB, "model-sized (96 MiB)": 96 * MIB, "DRAM-sized (1 GiB)": 1024 * MIB}
    with tempfile.TemporaryDirectory() as workdir:
        lib = build_reader(Path(workdir))
        bandwidth = {(label, threads): read_bandwidth(lib, size, threads, args.passes)
                     for label, size in sizes.items() for threads in (1, 2)}
    for key, value in bandwidth.items():
        print(key, f"{value:.1f} GB/s", flush=True)
    bw_rows = [[label, threads, value] for (label, threads), value in bandwidth.items()]
    byte_rows = [[name, value / 1e6] for name, value in parts.items()]
    kvserve_bytes, llama_bytes = weights + kv_fp32, weights + kv_fp16
    floor_rows = [
        [f"{label}, {threads} thread{'s' if threads > 1 else ''}", kvserve_bytes / (bw * 1e9) * 1e3,
         bw * 1e9 / kvserve_bytes, llama_bytes / (bw * 1e9) * 1e3, bw * 1e9 / llama_bytes]
        for (label, threads), bw in bandwidth.items()
    ]
    table = (
        "Streaming read bandwidth (GB/s, best of "
        f"{args.passes}):\n\n" + markdown_table(["buffer", "threads", "GB/s"], bw_rows)
        + "\n\nBytes one single-request decode step reads (MB):\n\n"
        + markdown_table(["part", "MB"], byte_rows)
        + "\n\nThe floor: ms per token (and the tok/s ceiling) if a step did nothing but read its bytes once:\n\n"
        + markdown_table(["bandwidth", "kvserve ms", "kvserve tok/s ceiling", "llama.cpp ms",
                          "llama.cpp tok/s ceiling"], floor_rows)
    )
    write_result(args.out, "Decode roofline: read bandwidth and bytes per decode step", table, "")
    print(table)


if __name__ == "__main__":
    main()
