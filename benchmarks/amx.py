"""AMX tiles against the AVX-512 kernels they replace, paired, on a CPU with AMX (Sapphire Rapids or later):
the int8 path's packed matmul (csrc/qmatmul_amx.h, AMX-INT8) against VNNI, or with --exact the exact path's
wide GEMM (csrc/qgemm_amx.h, AMX-BF16, float32 activations split in three bf16 parts) against qgemm.h's
float32 GEMM.

Kernels: GMAC/s of the packed int8 matmul on the default model's real tensors (its Q4_1 projections and the
Q8_0 tied head) at 16-2,048 rows, tiles on for every type and off alternating in one process (best of N,
wall clock, the threads torch uses). End to end: the default model with `--activation-quant int8`, tiles as
the engine runs them (Q8_0 only) against none, alternating: prefill of 512 and 2,048 tokens, and
benchmarks/native_kernels.py's batch-8 and batch-32 workloads (32 new tokens each, prefill included, in a fresh cache
namespace each round). --exact: the same with native weights and float32 activations (the default
configuration), qgemm's tiles on against off, plus the shared-prefix workload (seconds).

    python benchmarks/amx.py            # ~3 minutes on 2 cores
    python benchmarks/amx.py --exact    # the exact path (results/amx_exact.md)
    python benchmarks/amx.py --quick    # fewer rows and rounds
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_workloads, markdown_table, write_result  # noqa: E402
from int8_packed import real_tensors  # noqa: E402
from kvserve.kernels.ops import Kernels  # noqa: E402
from native_kernels import KvserveRunner, greedy  # noqa: E402

ROWS = (16, 32, 128, 512, 2048)


def best_ms(call, rows: int, repeats: int) -> float:
    call()
    reps = max(3, 20_000 // rows)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e3


def kernel_rows(kernels: Kernels, rows_list: tuple[int, ...], repeats: int, exact: bool) -> list[list[object]]:
    native = kernels.native
    switch = native.set_amx_exact if exact else functools.partial(native.set_amx, every_type=True)
    table = []
    for label, weight in real_tensors().items():
        packed = None if exact else kernels.prepare_int8(weight)
        for rows in rows_list:
            x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(rows))
            if exact:
                call = functools.partial(native.qgemm, x, weight.data, weight.qtype, weight.in_features)
            else:
                call = functools.partial(native.qmatmul_i8_packed, x, packed)
            times = {True: [], False: []}
            for _ in range(2):  # alternate, so both see the same machine
                for on in (False, True):
                    switch(on)
                    times[on].append(best_ms(call, rows, repeats))
            off, tiles = min(times[False]), min(times[True])
            macs = rows * weight.in_features * weight.out_features
            print(f"[amx] {label:24s} rows {rows:5d}: without {off:8.3f} ms, tiles {tiles:8.3f} ms", flush=True)
            table.append([label, rows, macs / off / 1e6, macs / tiles / 1e6, off / tiles])
    native.set_amx(True)
    native.set_amx_exact(True)
    return table


def fresh_batch(runner: KvserveRunner, prompts: list[list[int]], new: int = 32) -> float:
    """Generated tok/s for `prompts` in a fresh cache namespace: every round prefills them again."""
    start = time.perf_counter()
    runner.llm.generate(prompts, greedy(new), cache_salt=str(start))
    return len(prompts) * new / (time.perf_counter() - start)


def end_to_end(rounds: int, exact: bool) -> list[list[object]]:
    workloads = load_workloads()
    args = {"weights": "native"} if exact else {"weights": "native", "activation_quant": "int8"}
    runner = KvserveRunner("exact" if exact else "int8", args)
    native = runner.llm.engine.model.kernels.native
    switch = native.set_amx_exact if exact else native.set_amx
    runner.decode(workloads["prefill"]["128"], 8)  # warm-up
    shared = workloads["shared_prefix"]
    tasks = {
        "prefill 512 tok/s": lambda: runner.prefill(workloads["prefill"]["512"]),
        "prefill 2,048 tok/s": lambda: runner.prefill(workloads["prefill"]["2048"]),
        "batch 8 tok/s": lambda: fresh_batch(runner, workloads["batch"]["8"]["prompts"]),
        "batch 32 tok/s": lambda: fresh_batch(runner, workloads["batch"]["32"]["prompts"]),
    }
    if exact:
        tasks["shared prefix s"] = lambda: runner.shared_prefix(shared["prefix"], shared["suffixes"], 32)
    samples = {(name, on): [] for name in tasks for on in (False, True)}
    for index in range(rounds):
        print(f"[amx] end to end, round {index + 1}/{rounds}", flush=True)
        for name, task in tasks.items():
            for on in (False, True):
                switch(on)
                samples[(name, on)].append(task())
    switch(True)
    rows = []
    for name in tasks:
        off, tiles = statistics.median(samples[(name, False)]), statistics.median(samples[(name, True)])
        rows.append([name, off, tiles, tiles / off])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--exact", action="store_true", help="the exact path's GEMM on AMX-BF16 tiles")
    args = parser.parse_args()
    kernels = Kernels.create("native", activation_quant="none" if args.exact else "int8")
    able = kernels.native is not None and (kernels.native.set_amx_exact(True) if args.exact
                                           else kernels.native.set_amx(True))
    if not able:
        raise SystemExit("this CPU (or kernel) cannot run these AMX tiles: nothing to compare")
    rows_list = (32, 512) if args.quick else ROWS
    kernel_table = kernel_rows(kernels, rows_list, 2 if args.quick else 3, args.exact)
    e2e_table = end_to_end(2 if args.quick else 3, args.exact)
    base = "float32 GEMM" if args.exact else "VNNI"
    where = ("native weights, float32 activations (tiles from 48 rows for Q4, 64 for the Q8_0 head)" if args.exact
             else "`--activation-quant int8` (tiles where the engine runs them: the Q8_0 head)")
    table = (
        markdown_table(["tensor", "rows", f"{base} GMAC/s", "AMX tiles GMAC/s", f"tiles / {base}"], kernel_table)
        + f"\n\nEnd to end, {where}:\n\n"
        + markdown_table(["figure", "tiles off", "tiles on", "on / off"], e2e_table)
    )
    if args.exact:
        notes = ("Kernel rows: best of N, wall clock, torch's threads, qgemm as the engine calls it (so below a "
                 "type's row threshold both columns are the float32 GEMM). End to end: median of alternating "
                 "rounds. Exact to the dequantized weights up to summation order either way "
                 "(tests/test_qgemm_amx.py).")
        write_result("amx_exact", "The exact path's wide GEMM on AMX-BF16 tiles against float32", table, notes)
    else:
        notes = ("Kernel rows: best of N, wall clock, torch's threads, tiles forced on for every type (the engine "
                 "runs them for Q8_0 only). End to end: median of alternating rounds. Results are bit-identical "
                 "either way (tests/test_kernels_amx.py).")
        write_result("amx", "The int8 path on AMX tiles against VNNI", table, notes)
    print(table + "\n\n" + notes)


if __name__ == "__main__":
    main()
