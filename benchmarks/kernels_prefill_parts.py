"""Where a long prefill's time goes: the whole prefill beside its parts, measured alone at the same sizes.

A prefill of N tokens of the default model (smollm2-135m, native Q4_1 weights) runs 30 layers of four
matmuls with N rows and one causal attention of N queries over N keys. This times, per N and per
activation mode (exact: qgemm.h on float32 activations; int8: qmatmul_i8.h; int8-bf16kv: int8 with a bf16 KV
cache; fast: that and bf16 attention products, `--attention-dtype bfloat16`; fast-bf16-prefill: that and the prefill
rows' matmuls as bf16 products on AMX tiles, `--prefill-dtype bfloat16`), the whole prefill through
`LLM.generate` (one token), the four matmuls of one layer at N rows (x 30; fast-bf16-prefill's gate_up with its fused
SwiGLU), and csrc/prefill.h's attention
of one span of N tokens (x 30); what is left over is norms, RoPE, SwiGLU, activation quantization, the
head and Python. The matmuls' share of the multiply-adds is fixed per token, attention's grows with N
(9 heads x 64 x 2 per query-key pair: 7% of the MACs at 512 tokens, 25% at 2,048).

    python benchmarks/kernels_prefill_parts.py                # 1 thread, CPU seconds (robust to load)
    python benchmarks/kernels_prefill_parts.py --threads 2 --wall   # wall seconds (needs an idle machine)

Best of `--repeats` per figure. Prints a markdown table; nothing is written (copy it into
benchmarks/results/kernels_prefill.md with the date, the CPU and the load).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_workloads, markdown_table  # noqa: E402

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _best(clock, fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def _attention_seconds(native, clock, tokens: int, config, repeats: int, bf16_pool: bool, bf16: bool) -> float:
    heads, kv_heads, dim, block = config.num_heads, config.num_kv_heads, config.head_dim, 16
    blocks = -(-tokens // block)
    pool_dtype = torch.bfloat16 if bf16_pool else torch.float32
    keys = torch.randn(blocks, block, kv_heads, dim).to(pool_dtype)
    values = torch.randn(blocks, block, kv_heads, dim).to(pool_dtype)
    queries = torch.randn(tokens, heads, dim)
    spans = torch.tensor([[0, tokens, tokens]])
    tables = torch.arange(blocks).view(1, -1)
    return _best(clock, lambda: native.prefill_attention(queries, keys, values, spans, tables, dim ** -0.5,
                                                         bf16_products=bf16), repeats)


def measure(mode: str, sizes: list[int], threads: int, clock, repeats: int) -> list[list[object]]:
    from kvserve import LLM, SamplingParams
    from kvserve.kernels import bf16pack

    fast, bf16_pool = mode in ("fast", "fast-bf16-prefill"), mode in ("fast", "fast-bf16-prefill", "int8-bf16kv")
    bf16_prefill = mode == "fast-bf16-prefill"
    llm = LLM("smollm2-135m", progress=False, kv_cache_memory="512MiB", kernels="native", weights="native",
              num_threads=threads, activation_quant="none" if mode == "exact" else "int8",
              kv_cache_dtype="bfloat16" if bf16_pool else "auto", attention_dtype="bfloat16" if fast else "float32",
              prefill_dtype="bfloat16" if bf16_prefill else "float32")
    model = llm.engine.model
    native, config = model.kernels.native, model.config
    native.lib.kv_set_num_threads(threads)
    exact = native.qgemm  # int8: Kernels.linear, which reads the packed layout where the engine packed it

    def matmul(x, w, name):
        if bf16_prefill:  # the prefill rows' tiles (kernels/bf16pack.py), gate_up fused with SwiGLU as the loop runs it
            return bf16pack.gemm(native, x, model.layers[0].prefill_bf16[name], swiglu=name == "gate_up_proj")
        return model.kernels.linear(x, w) if mode != "exact" else exact(x, w.data, w.qtype, w.in_features)
    prompt = load_workloads()["prefill"]["2048"]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    layers = len(model.layers)
    rows = []
    for tokens in sizes:
        def prefill(tokens=tokens):
            llm.generate([prompt[:tokens]], params, cache_salt=str(time.perf_counter()), use_tqdm=False)

        prefill()  # warm-up
        whole = _best(clock, prefill, repeats)
        mm = 0.0
        for name in PROJECTIONS:
            weight = getattr(model.layers[0], name)
            x = torch.randn(tokens, weight.in_features)
            mm += _best(clock, lambda w=weight, x=x, name=name: matmul(x, w, name), repeats)
        attention = _attention_seconds(native, clock, tokens, config, repeats, bf16_pool, fast)
        mm, attention = layers * mm, layers * attention
        rest = whole - mm - attention
        rows.append([mode, tokens, tokens / whole, whole, mm, attention, rest, attention / whole,
                     1e3 * whole / tokens])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="512,2048")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall", action="store_true", help="wall seconds instead of the process's CPU seconds")
    parser.add_argument("--repeats", type=int, default=3)
    modes = ["exact", "int8", "int8-bf16kv", "fast", "fast-bf16-prefill"]
    parser.add_argument("--modes", nargs="+", default=modes, choices=modes)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.process_time
    unit = "wall s" if args.wall else "CPU s"
    sizes = [int(size) for size in args.sizes.split(",")]
    rows = []
    for mode in args.modes:
        rows += measure(mode, sizes, args.threads, clock, args.repeats)
    header = ["activations", "tokens", f"prefill tok / {unit}", f"prefill {unit}", f"matmuls x30 {unit}",
              f"attention x30 {unit}", f"rest {unit}", "attention share", f"ms / token ({unit})"]
    print(markdown_table(header, rows))
    print(f"`python benchmarks/kernels_prefill_parts.py --sizes {args.sizes} --threads {args.threads}"
          f"{' --wall' if args.wall else ''}`; best of {args.repeats}; load average {os.getloadavg()[0]:.1f}.")


if __name__ == "__main__":
    main()
