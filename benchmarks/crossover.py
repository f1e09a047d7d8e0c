"""The per-row kernel / wide GEMM crossover end to end: batched greedy decode of the default model with this
CPU's measured crossovers (kernels/crossover.py) against the fixed default (the wide GEMM from 5 rows), in
one process, rounds alternating which goes first.

For each batch size: the decode part of generating 33 tokens for that many of the `batch` workload's
prompts (from the last first token to the last finish: 32 all-decode steps), median of `--rounds`, and
whether both settings produced the same tokens.

    python benchmarks/crossover.py [--rows 4 5 6 8 12 14 16 24] [--rounds 6] [--out crossover]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import load_workloads, markdown_table, write_result
from kvserve import LLM, SamplingParams
from kvserve.kernels import crossover
from kvserve.kernels.crossover import Q4_1, Q8_0


def decode_seconds(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, cache_salt=str(time.perf_counter()))  # nothing cached
    first = max(o.metrics.first_token_time for o in outputs)
    end = max(o.metrics.finished_time for o in outputs)
    return end - first, [o.token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[4, 5, 6, 8, 12, 14, 16, 24])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="crossover")
    args = parser.parse_args()
    llm = LLM("smollm2-135m", progress=False, kv_cache_memory="1GiB", max_num_seqs=64)
    native = llm.engine.model.kernels.native
    measured = {qtype: native.qgemm_min_rows.get(qtype, crossover.DEFAULT_MIN_ROWS) for qtype in (Q4_1, Q8_0)}
    settings = {"default (wide GEMM from 5 rows)": {Q4_1: 5, Q8_0: 5}, "this CPU's crossovers": measured}
    prompts = load_workloads()["batch"]["32"]["prompts"]
    rows_out = []
    for rows in args.rows:
        times: dict[str, list[float]] = {name: [] for name in settings}
        tokens: dict[str, list[list[int]]] = {}
        for round_index in range(args.rounds):
            order = list(settings) if round_index % 2 == 0 else list(settings)[::-1]
            for name in order:
                for qtype, min_rows in settings[name].items():
                    crossover.set_min_rows(native, qtype, min_rows)
                seconds, tokens[name] = decode_seconds(llm, prompts[:rows])
                times[name].append(seconds)
        base, new = (statistics.median(times[name]) * 1e3 / 32 for name in settings)
        same = "yes" if len({str(t) for t in tokens.values()}) == 1 else "**no**"
        rows_out.append([rows, base, new, base / new, same])
        print(f"{rows} rows: {base:.1f} -> {new:.1f} ms a step ({base / new:.2f}x), same tokens: {same}", flush=True)
    for qtype, min_rows in measured.items():
        crossover.set_min_rows(native, qtype, min_rows)
    table = markdown_table(["rows", "default ms/step", "this CPU's ms/step", "speed-up", "same tokens"], rows_out)
    notes = (f"This CPU's crossovers: Q4_1 from {measured[Q4_1]} rows, Q8_0 from {measured[Q8_0]} "
             "(kernels/crossover.py; the default everywhere else is 5). ms per all-decode step of the default "
             f"model (Q4_1 layers, Q8_0 head), median of {args.rounds} alternating rounds.")
    print(write_result(args.out, "The per-row / wide GEMM crossover, end to end", table, notes))


if __name__ == "__main__":
    main()
