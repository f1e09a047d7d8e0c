"""Paged decode attention alone: one decode step's 30 layers of `kv_paged_attention` over a batch of rows.

The shape of the default model (SmolLM2-135M: 9 heads, 3 KV heads, head dim 64, 30 layers), block size 16,
contexts drawn uniformly from 70-150 tokens (a batched decode step of benchmarks/decode_step.py --rows),
block tables a random permutation of the pool (the allocator's free list after some churn), one pool per
layer as the engine's. CPU time of the process (robust to a shared machine), best of the repeats; every
layer's K/V is read once per step, so the pool's bytes stream from memory as in a real step. `--before REV`
times the kernel built from git revision REV's csrc/ in the same process, interleaved. The `cascade` rows run
`kv_cascade_attention` instead, the rows in groups of 8 sharing their first 64 tokens (the shared part read
once per group, each row's own tokens after it through the decode kernel). `--kv-dtypes` picks the pools'
element types (float32, bfloat16, fp8: `--kv-cache-dtype`'s; the kernel widens bf16 and fp8 as it loads them).

    python benchmarks/decode_attention.py --before main
    python benchmarks/decode_attention.py --kv-dtypes float32,bfloat16,fp8 --threads 2 --before main
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import best_cpu_ms, markdown_table, write_result  # noqa: E402
from kvserve.kernels import build  # noqa: E402
from kvserve.kernels.native import NativeLibrary  # noqa: E402
from kvserve.kv.cascade import plan_cascade  # noqa: E402
from native_kernels import build_revision, load_average  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
SHARED_BLOCKS = 4  # --cascade rows: 64 shared leading tokens per group of 8


class Step:
    """One decode step's attention inputs: per-layer pools, block tables, context lengths, queries."""

    def __init__(self, rows: int, low: int, high: int, cascade: bool = False, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.lens = torch.randint(low, high + 1, (rows,), generator=gen)
        width = -(-high // BLOCK)
        num_blocks = rows * width + 1
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.pools = [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
                      for _ in range(LAYERS)]
        self.element = dtype.itemsize
        self.tables = torch.randperm(num_blocks, generator=gen)[: rows * width].view(rows, width).contiguous()
        self.queries = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
        self.scale = HEAD_DIM**-0.5
        self.plan = None
        if cascade:  # groups of 8 rows: each member's first 4 blocks are its group's first member's
            for row in range(rows):
                self.tables[row, :SHARED_BLOCKS] = self.tables[row - row % 8, :SHARED_BLOCKS]
            self.plan = plan_cascade(self.tables.tolist(), self.lens.tolist(), BLOCK, min_rows=2,
                                     min_blocks=SHARED_BLOCKS)

    def run(self, native: NativeLibrary) -> None:
        for keys, values in self.pools:
            if self.plan is None:
                native.paged_attention(self.queries, keys, values, self.tables, self.lens, self.scale)
            else:
                native.cascade_attention(self.queries, keys, values, self.tables, self.lens, self.plan, self.scale)

    @property
    def bytes(self) -> int:
        """K and V bytes a step must read: every row's context (a group's shared tokens once), every layer."""
        tokens = int(self.lens.sum())
        if self.plan is not None:
            members = self.plan.group_offsets.diff()
            tokens -= int(((members - 1) * self.plan.group_shared_blocks).sum()) * BLOCK
        return tokens * KV_HEADS * HEAD_DIM * self.element * 2 * LAYERS

    @property
    def macs(self) -> int:
        return int(self.lens.sum()) * HEADS * HEAD_DIM * 2 * LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--contexts", default="70-150,1000-1100", help="comma-separated LOW-HIGH ranges")
    parser.add_argument("--before", metavar="REV")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cascade-rows", default="32", help="row counts of the cascade case (groups of 8)")
    parser.add_argument("--max-pool-gib", type=float, default=1.0, help="skip cases whose 30 pools exceed this")
    parser.add_argument("--kv-dtypes", default="float32", help=f"comma-separated, of {', '.join(KV_DTYPES)}")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/decode_attention.md")
    parser.add_argument("--out", metavar="NAME", help="with --write: results/NAME.md instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    notes = [f"Load average (1 / 5 / 15 min) before: {load_average()}."]
    with tempfile.TemporaryDirectory() as workdir:
        libraries = {"now": NativeLibrary.load(build.build())}
        if args.before:
            libraries = {f"before ({args.before})": NativeLibrary.load(build_revision(args.before, Path(workdir))),
                         **libraries}
        rows_out = []
        cases = [(span, rows, False) for span in args.contexts.split(",") for rows in args.rows.split(",")]
        cases += [(args.contexts.split(",")[0], rows, True) for rows in args.cascade_rows.split(",") if rows]
        cases = [(*case, kv) for kv in args.kv_dtypes.split(",") for case in cases]
        for span, rows, cascade, kv in cases:
            low, high = (int(x) for x in span.split("-"))
            dtype = KV_DTYPES[kv]
            pool_gib = int(rows) * -(-high // BLOCK) * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize * 2 * LAYERS / 2**30
            if pool_gib > args.max_pool_gib:
                notes.append(f"Skipped {rows} rows of {span} tokens, {kv} ({pool_gib:.1f} GiB of pools).")
                continue
            step = Step(int(rows), low, high, cascade, dtype=dtype)
            best = {name: float("inf") for name in libraries}
            for _ in range(args.rounds):
                for name, native in libraries.items():
                    best[name] = min(best[name], best_cpu_ms(lambda n=native, s=step: s.run(n), args.reps))
            for name, ms in best.items():
                kind = "cascade" if cascade else "paged"
                rows_out.append([f"{low}-{high}", int(rows), kind, kv, name, ms, step.macs / ms / 1e6,
                                 step.bytes / ms / 1e6])
            print(rows_out[-1], flush=True)
    notes.append(f"Load average after: {load_average()}.")
    header = ["context", "rows", "attention", "KV", "kernels", "ms / step (30 layers)", "GMAC/s", "GB/s of K+V read"]
    table = markdown_table(header, rows_out)
    print(table)
    if args.write:
        name = args.out or "decode_attention" + ("" if args.kv_dtypes == "float32" else "_kv_dtypes")
        write_result(name, "Paged decode attention alone (CPU ms per decode step, 30 layers)", table, " ".join(notes))


if __name__ == "__main__":
    main()
