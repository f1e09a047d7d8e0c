"""Batched decode at the workload's own length: 8 and 32 requests x 128 new tokens, paired rounds.

native_kernels.py --quick gives each batch request 32 new tokens, so its batch figures are mostly prefill
(32 prompts of 68-128 tokens). The peers' batch figures (benchmarks/data/PEERS.md) and issue 12's target
(batch 32 >= 3x transformers' faster dtype, >= 1,000 tok/s on a Zen 4) are for the `batch` workload as
written: 128 new tokens per request. This runs exactly that, generated tokens / wall second (prefill
included), for kvserve with native Q4_1 weights -- exact activations, int8 activations, and int8 with a bf16
KV cache (llama.cpp's own precision class: 8-bit activation blocks, a 16-bit KV cache) -- beside
transformers (bf16 by default: the faster dtype on a CPU with native bf16; `--hf-dtypes float32 bfloat16`
for both) and llama-cpp-python (one request at a time: its Python API has no batch), every runner once per
round in turn; medians.

Each runner lives in its own process (started once, driven in turn): run in one process, the kvserve
runners slowed by 30-40% from the second round on (2026-12-05, the AMX Xeon; not seen with any runner alone
or with fewer of them), so no runner shares an interpreter, an allocator or OpenMP pools with another.
Every batch runs in a fresh cache namespace: nothing a previous round cached is reused.

    python benchmarks/batch_decode.py                   # ~6 minutes on 2 idle cores
    python benchmarks/batch_decode.py --batches 32 --rounds 5 --no-llama-cpp

Writes benchmarks/results/batch_decode.md (or --out).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_workloads, markdown_table, write_result  # noqa: E402
from native_kernels import (  # noqa: E402
    BF16_PREFILL,
    VARIANTS,
    HFRunner,
    KvserveRunner,
    llama_cpp_python_runner,
    llama_cpp_python_usable,
    load_average,
)

KVSERVE = {
    "kvserve native Q4_1": VARIANTS["kvserve native Q4_1"],
    "kvserve native Q4_1 int8": VARIANTS["kvserve native Q4_1 int8"],
    "kvserve native Q4_1 int8, bf16 KV": {**VARIANTS["kvserve native Q4_1 int8"], "kv_cache_dtype": "bfloat16"},
    "kvserve native Q4_1 int8, bf16 KV + attention": VARIANTS["kvserve native Q4_1 int8, bf16 KV + attention"],
    # an fp8 (e4m3fn) KV cache: a quarter of float32's bytes for decode attention to stream (quality: perplexity.md)
    "kvserve native Q4_1 int8, fp8 KV": {**VARIANTS["kvserve native Q4_1 int8"], "kv_cache_dtype": "fp8"},
}
if BF16_PREFILL in VARIANTS:  # AMX-BF16 only: the prompts' matmuls as bf16 products on the tiles
    KVSERVE["kvserve native Q4_1 int8, bf16 KV + prefill"] = {**KVSERVE["kvserve native Q4_1 int8, bf16 KV"],
                                                            "prefill_dtype": "bfloat16"}
    KVSERVE["kvserve native Q4_1 int8, fp8 KV + prefill"] = {**KVSERVE["kvserve native Q4_1 int8, fp8 KV"],
                                                           "prefill_dtype": "bfloat16"}


class RunnerProcess:
    """One runner in a process of its own: `batch` sends the prompts and waits for its tok/s."""

    def __init__(self, kind: str, spec: object) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipe, child = context.Pipe()
        self.process = context.Process(target=_serve_runner, args=(kind, spec, child), daemon=True)
        self.process.start()
        self.name = self._receive()

    def batch(self, prompts: list[list[int]], new: int) -> float:
        self.pipe.send((prompts, new))
        return self._receive()

    def _receive(self):
        reply = self.pipe.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        self.pipe.send(None)
        self.process.join(timeout=30)


def _serve_runner(kind: str, spec: object, pipe: Connection) -> None:
    """The worker: build the runner, say its name, then time each batch it is sent until None."""
    try:
        if kind == "kvserve":
            runner = KvserveRunner(*spec)
        elif kind == "hf":
            runner = HFRunner(getattr(torch, spec))
        else:
            found = llama_cpp_python_runner([])
            if not found:
                raise RuntimeError("llama-cpp-python is not installed")
            runner = found[0]
        pipe.send(runner.name)
    except Exception as err:  # noqa: BLE001 -- reported to the parent, which raises it
        pipe.send(err)
        return
    while (message := pipe.recv()) is not None:
        pipe.send(runner.batch(*message))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="8,32", help="batch sizes of the `batch` workload")
    parser.add_argument("--new", type=int, default=128, help="new tokens per request (the workload's: 128)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hf-dtypes", nargs="*", default=["bfloat16"], help="transformers runners (none: skip)")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--kvserve", nargs="+", choices=list(KVSERVE), default=list(KVSERVE), metavar="NAME",
                        help="the kvserve runners to include (default: all)")
    parser.add_argument("--out", default="batch_decode")
    args = parser.parse_args()
    workloads = load_workloads()["batch"]
    batches = [int(b) for b in args.batches.split(",")]
    notes = [f"Load average (1 / 5 / 15 min) before: {load_average()}."]
    specs = [("kvserve", (name, KVSERVE[name])) for name in args.kvserve]
    specs += [("hf", dtype) for dtype in args.hf_dtypes]
    if not args.no_llama_cpp and llama_cpp_python_usable(notes):
        specs.append(("llama", None))
    runners = [RunnerProcess(kind, spec) for kind, spec in specs]
    for runner in runners:
        runner.batch(workloads["8"]["prompts"][:2], 4)  # warm-up
    samples = {runner.name: {b: [] for b in batches} for runner in runners}
    for round_index in range(args.rounds):
        for batch in batches:
            for runner in runners:
                samples[runner.name][batch].append(runner.batch(workloads[str(batch)]["prompts"], args.new))
            print(f"round {round_index + 1}, batch {batch}: "
                  + ", ".join(f"{name} {v[batch][-1]:.1f}" for name, v in samples.items()), flush=True)
    median = {name: {b: statistics.median(v) for b, v in by_batch.items()} for name, by_batch in samples.items()}
    header = ["runner", *(f"batch {b} tok/s" for b in batches), *(f"batch {b} min-max" for b in batches)]
    rows = [[name, *by_batch.values(), *(f"{min(samples[name][b]):.0f}-{max(samples[name][b]):.0f}" for b in batches)]
            for name, by_batch in median.items()]
    peers = [name for name in median if not name.startswith("kvserve")]
    for peer in peers:
        rows += [[f"{name} / {peer}", *(median[name][b] / median[peer][b] for b in batches), *([""] * len(batches))]
                 for name in args.kvserve]
    notes.append(f"Load average after: {load_average()}. {args.rounds} rounds; {args.new} greedy new tokens per "
                 f"request, EOS ignored; tok/s = generated tokens / wall seconds of the whole batch (prefill "
                 f"included); threads: {torch.get_num_threads()}; every runner once per round and batch, in turn; "
                 "medians; each runner in its own process, every batch in a fresh cache namespace. transformers "
                 "batches with left padding; llama-cpp-python runs the requests one at a time.")
    for runner in runners:
        runner.close()
    table = markdown_table(header, rows)
    title = "Batched decode at the workload's 128 new tokens, paired rounds"
    title += "" if args.out == "batch_decode" else f" ({args.out})"  # the section's name, as BENCHMARKS.md cites it
    write_result(args.out, title, table, "\n\n".join(notes))
    print(table)


if __name__ == "__main__":
    main()
