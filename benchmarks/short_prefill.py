"""Time to first token of short prompts (a chat turn, a question), kvserve beside transformers and llama.cpp.

Why: kvserve's workloads send mostly short new spans -- a turn over a cached history, a question after a
cached document -- and a span of tens to hundreds of rows runs the GEMMs in another regime than the 512 /
2,048-token prefills of native_kernels.py: the weights' bytes, not the multiply-adds, set the pace. Each
runner answers one-token requests for prompts of each length (fresh: nothing cached), every runner once per
round and length, in turn (order reversed every other round); medians of the time to first token.

    python benchmarks/short_prefill.py                                          # about 2 minutes
    git archive REV src | tar -x -C /tmp/before
    python benchmarks/short_prefill.py --before-src /tmp/before/src --rounds 7  # paired before / after
    python benchmarks/short_prefill.py --before-src /tmp/before/src --rounds 7 --turn-rounds 31  # a tighter turn

kvserve runs its fastest configuration here (int8 activations for decode rows, bf16 KV cache and attention,
and on an AMX CPU bf16 prefill rows: native_kernels.py's variants), and `--also NAME ...` others (e.g. the
default, "kvserve native Q4_1": exact float32 activations and KV). `--before-src` adds the same configuration
from another checkout's sources (benchmarks/source_ab.py, a child process) and a row of after / before speed
ratios round by round; kvserve then runs this checkout's sources in a child process too, so the pair is alike.
Then the seed's example for every runner that keeps a prompt cache (kvserve, llama.cpp): a chat turn of 100
new tokens after a 1,900-token history it has cached, beside those 100 tokens alone. Writes
benchmarks/results/OUT.md and docs/OUT.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import line_plot, load_workloads, markdown_table, write_result  # noqa: E402
from native_kernels import (  # noqa: E402
    BF16_PREFILL,
    FAST,
    VARIANTS,
    HFRunner,
    KvserveRunner,
    llama_cpp_python_runner,
    load_average,
)

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("transformers bf16", "llama.cpp (llama-cpp-python)")


def runners_for(args: argparse.Namespace, notes: list[str]) -> tuple[list[str], list]:
    """(kvserve's runner names, every runner): kvserve's fastest configuration and `--also`'s, its before,
    transformers bf16, llama.cpp."""
    names = [BF16_PREFILL if BF16_PREFILL in VARIANTS else FAST, *args.also]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--also: unknown {unknown}; choose from {list(VARIANTS)}")
    if not args.before_src:
        runners: list = [KvserveRunner(name, VARIANTS[name]) for name in names]
    else:  # in child processes, alike (in this one, beside the peers' models, kvserve measured ~5% slower)
        from source_ab import SourceRunner

        threads = torch.get_num_threads()
        runners = [SourceRunner(name, str(ROOT / "src"), VARIANTS[name], threads) for name in names]
        runners.append(SourceRunner(f"{names[0]} (before)", args.before_src, VARIANTS[names[0]], threads))
    runners += [] if args.skip_hf else [HFRunner(torch.bfloat16)]
    return names, runners + llama_cpp_python_runner(notes)


def measure(runners: list, prompts: dict[int, list[int]], rounds: int) -> dict[str, dict[int, list[float]]]:
    """TTFT samples in ms, runner -> length -> one per round."""
    samples: dict[str, dict[int, list[float]]] = {r.name: {size: [] for size in prompts} for r in runners}
    for runner in runners:
        runner.prefill(prompts[min(prompts)])  # warm-up
    for round_index in range(rounds):
        for size, prompt in prompts.items():
            for runner in runners if round_index % 2 == 0 else runners[::-1]:
                samples[runner.name][size].append(1000 * size / runner.prefill(prompt))
            print(f"round {round_index + 1}, {size} tokens: "
                  + ", ".join(f"{name} {by[size][-1]:.1f} ms" for name, by in samples.items()), flush=True)
    return samples


def turn_ms(runner, history: list[int], new: list[int]) -> float | None:
    """A chat turn's TTFT in ms: `new` after `history`, which the runner has cached by then (None: it keeps no
    prompt cache between requests -- transformers)."""
    turn = getattr(runner, "turn", None)  # kvserve here or in a child process, llama-cpp-python
    return None if turn is None else 1000 * turn(history, new)


def measure_turns(runners: list, history: list[int], new: list[int], rounds: int) -> dict[str, list[float]]:
    """Turn TTFT samples (ms) per runner that keeps a prompt cache, interleaved as `measure`."""
    samples: dict[str, list[float]] = {}
    for round_index in range(rounds):
        for runner in runners if round_index % 2 == 0 else runners[::-1]:
            ms = turn_ms(runner, history, new)
            if ms is not None:
                samples.setdefault(runner.name, []).append(ms)
        print(f"round {round_index + 1}, turn: " + ", ".join(f"{n} {v[-1]:.1f} ms" for n, v in samples.items()),
              flush=True)
    return samples


def paired(after: list[float], before: list[float]) -> str:
    """before / after TTFT round by round (higher: after faster): median (min - max), rounds after was faster."""
    ratios = [b / a for a, b in zip(after, before, strict=True)]
    return (f"{statistics.median(ratios):.2f} ({min(ratios):.2f} - {max(ratios):.2f}), "
            f"{sum(r > 1 for r in ratios)} of {len(ratios)} faster")


def turn_table(turns: dict[str, list[float]], fresh: dict[str, dict[int, list[float]]], size: int,
               first: str) -> str:
    """The turn beside the same new tokens alone (the seed's example: cached / fresh, target 1.2), and with
    `--before-src` the first configuration's turns after / before round by round."""
    rows = [[name, statistics.median(v), statistics.median(fresh[name][size]),
             statistics.median(v) / statistics.median(fresh[name][size])] for name, v in turns.items()]
    table = markdown_table(["runner", "turn TTFT ms", f"{size} tokens alone, ms", "turn / alone"], rows)
    before = f"{first} (before)"
    if before in turns:
        rounds = len(turns[first])
        table += f"\n\nThe turn after / before, by round ({rounds} rounds): {paired(turns[first], turns[before])}."
    return table


def ratio_rows(samples: dict[str, dict[int, list[float]]], names: list[str], sizes: list[int]) -> list[list[object]]:
    """Each kvserve configuration's speed over each peer's (median TTFT ratio), and the first one's after /
    before round by round."""
    median = {n: {s: statistics.median(v) for s, v in by.items()} for n, by in samples.items()}
    rows: list[list[object]] = [[f"{name} ÷ {peer}", *(median[peer][s] / median[name][s] for s in sizes)]
                                for name in names for peer in PEERS if peer in median]
    before = f"{names[0]} (before)"
    if before in samples:
        rows.append(["after / before, by round", *(paired(samples[names[0]][s], samples[before][s]) for s in sizes)])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="32,64,128,256,512,768", help="prompt lengths (tokens), at most 2,048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turn-rounds", type=int, metavar="N", help="rounds of the chat turn (default: --rounds)")
    parser.add_argument("--before-src", metavar="SRC", help="also kvserve from another checkout's src directory")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers bf16")
    parser.add_argument("--also", nargs="+", default=[], metavar="NAME",
                        help="more kvserve configurations (native_kernels.py's VARIANTS names), e.g. the default")
    parser.add_argument("--out", default="short_prefill", help="results/OUT.md and docs/OUT.png")
    args = parser.parse_args()
    workloads = load_workloads()
    long_prompt = workloads["prefill"]["2048"]
    sizes = [int(size) for size in args.sizes.split(",")]
    shared = workloads["shared_prefix"]  # the seed's example: 100 new tokens after a 1,900-token history
    history, new = shared["prefix"], shared["suffixes"][0]
    prompts = {size: long_prompt[:size] for size in sizes} | {len(new): new}
    notes = [f"Load average (1 / 5 / 15 min) before: {load_average()}."]
    names, runners = runners_for(args, notes)
    samples = measure(runners, prompts, args.rounds)
    turn_rounds = args.turn_rounds or args.rounds
    turns = measure_turns(runners, history, new, turn_rounds)
    for runner in runners:
        if hasattr(runner, "close"):
            runner.close()
    notes.append(f"Load average after: {load_average()}. {args.rounds} rounds ({turn_rounds} of the turn); "
                 f"threads: {torch.get_num_threads()}; "
                 "prompts: prefixes of the 2,048-token prefill workload, one-token requests, nothing cached "
                 "(kvserve: a fresh cache namespace per request; llama.cpp: its context reset). TTFT as each "
                 "runner's `prefill` in native_kernels.py measures it: kvserve's request metrics, the others' wall "
                 "time of a one-token generate.")
    header = ["runner", *(f"{size} tokens" for size in sizes)]
    rows: list[list[object]] = [[n, *(statistics.median(by[size]) for size in sizes)] for n, by in samples.items()]
    picture = ROOT / "docs" / f"{args.out}.png"
    medians = {n: {size: statistics.median(v) for size, v in by.items()} for n, by in samples.items()}
    line_plot(medians, picture, "prompt tokens (nothing cached)", "time to first token, ms (median, log scale)",
              log=True)
    notes.append(f"![time to first token against prompt length](docs/{picture.name})")
    table = (markdown_table(header, rows) + "\n\nSpeed ratios (higher: kvserve faster):\n\n"
             + markdown_table(["", *(f"{size} tokens" for size in sizes)], ratio_rows(samples, names, sizes))
             + f"\n\nA chat turn: {len(new)} new tokens after a {len(history):,}-token history the runner has "
             "cached (the seed's example; its target: turn ≤ 1.2 × the new tokens alone), medians:\n\n"
             + turn_table(turns, samples, len(new), names[0]))
    title = "Time to first token of short prompts, TTFT ms" + ("" if args.out == "short_prefill" else f" ({args.out})")
    write_result(args.out, title, table, "\n\n".join(notes))
    print(table)


if __name__ == "__main__":
    main()
