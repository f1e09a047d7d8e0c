"""Sixteen requests sharing a 1,900-token prefix, sent at once, 32 new tokens each (benchmarks/data
"shared_prefix"): where the time goes, phase by phase, and the admission hold-back / cascade variants.

The requests are admitted together; the first computes the prefix while the others are held
(engine/prefix_admission.py) and then take it as a cache hit; the fifteen suffixes (each recomputes the
prefix's last partial block: 112 tokens over 1,888 cached) prefill in one step; then 32 decode steps at
batch 16 read the shared blocks once per step as one group (kv/cascade.py, csrc/cascade.h). Each step is
timed from one schedule to the next (model forward, sampling, Python) and put in a phase by what it ran:
the prefix prefill (chunks of a request with nothing cached), the suffix prefills (chunks after a cache
hit), decode-only steps; `scheduling` is the time inside the scheduler, included in the phases. Each
phase also in the process's CPU seconds (steadier than wall time on a shared machine).

    python benchmarks/shared_prefix.py                   # phases of the default, then the three variants
    python benchmarks/shared_prefix.py --requests 8      # a reduced size
    python benchmarks/shared_prefix.py --ab ../other/src --rounds 3   # paired A/B against another checkout

`--ab SRC`: the default configuration only, alternating round by round between a child process importing
kvserve from SRC ("A") and one importing this checkout's src ("B"), so both see the same machine load;
medians per phase, and whether both produced the same tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, Timer, load_workloads, markdown_table, write_result  # noqa: E402

VARIANTS = {
    "before: hold off, cascade off": {"disable_prefix_hold": True, "disable_cascade_attn": True},
    "hold on, cascade off": {"disable_prefix_hold": False, "disable_cascade_attn": True},
    "hold on, cascade on (default)": {"disable_prefix_hold": False, "disable_cascade_attn": False},
}
DEFAULT = "hold on, cascade on (default)"
PHASES = ("prefix prefill", "suffix prefills", "decode", "scheduling")


def _phase_recorder(scheduler) -> tuple[list[dict], object]:
    """Wrap `scheduler.schedule`: one record per step (start, time scheduling, what it ran)."""
    steps: list[dict] = []
    original = scheduler.schedule

    def schedule():
        start, cpu = time.perf_counter(), time.process_time()
        output = original()
        chunks = [item for item in output.scheduled
                  if item.request.num_computed_tokens < item.request.num_prompt_tokens]
        kind = ("decode" if not chunks else "prefix prefill" if any(i.request.num_cached_tokens == 0 for i in chunks)
                else "suffix prefills")
        steps.append({"start": start, "cpu": cpu, "schedule": time.perf_counter() - start, "kind": kind,
                      "tokens": sum(item.num_new_tokens for item in chunks)})
        return output

    scheduler.schedule = schedule
    return steps, original


def run_variant(flags: dict[str, bool], prompts: list[list[int]], new_tokens: int, threads: int,
                activation_quant: str = "none") -> dict:
    from kvserve import LLM, SamplingParams

    llm = LLM("smollm2-135m", progress=False, kv_cache_memory="1GiB", max_num_seqs=64, kernels="native",
              weights="native", num_threads=threads, activation_quant=activation_quant, **flags)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    steps, _ = _phase_recorder(llm.engine.scheduler)
    cpu_start = time.process_time()
    with Timer() as timer:
        outputs = llm.generate(prompts, params, cache_salt=str(time.perf_counter()), use_tqdm=False)
    end, cpu_end = time.perf_counter(), time.process_time()
    cpu = cpu_end - cpu_start
    phases = dict.fromkeys(PHASES, 0.0)
    phases_cpu = dict.fromkeys(PHASES[:-1], 0.0)
    counts = dict.fromkeys(PHASES, 0)
    for index, step in enumerate(steps):
        last = index + 1 == len(steps)
        phases[step["kind"]] += (end if last else steps[index + 1]["start"]) - step["start"]
        phases_cpu[step["kind"]] += (cpu_end if last else steps[index + 1]["cpu"]) - step["cpu"]
        counts[step["kind"]] += 1
        phases["scheduling"] += step["schedule"]
    result = {
        "seconds": timer.seconds, "cpu_seconds": cpu, "cached": [out.num_cached_tokens for out in outputs],
        "tokens": [out.outputs[0].token_ids for out in outputs],
        "ttft": statistics.mean(out.metrics.ttft for out in outputs), "phases": phases, "steps": counts,
        "phases_cpu": phases_cpu,
        "suffix_tokens": sum(s["tokens"] for s in steps if s["kind"] == "suffix prefills"),
    }
    del llm
    gc.collect()
    return result


def _prompts(requests: int) -> list[list[int]]:
    shared = load_workloads()["shared_prefix"]
    return [shared["prefix"] + suffix for suffix in shared["suffixes"][:requests]]


def _phase_cells(r: dict) -> list[object]:
    return [r["seconds"], r["cpu_seconds"]] + [r["phases"][p] for p in PHASES] + [
        " / ".join(f"{r['phases_cpu'][p]:.2f}" for p in PHASES[:-1])] + [
        f"{r['steps']['prefix prefill']} / {r['steps']['suffix prefills']} / {r['steps']['decode']}",
        1e3 * r["phases"]["decode"] / max(1, r["steps"]["decode"])]


PHASE_HEADER = ["total s", "CPU s", *(f"{p} s" for p in PHASES), "CPU s: prefix / suffix / decode",
                "steps (prefix / suffix / decode)",
                "ms per decode step"]


def child(args: argparse.Namespace) -> None:
    """One default run, its result as JSON on stdout (the --ab rounds run this in a fresh process)."""
    result = run_variant(VARIANTS[DEFAULT], _prompts(args.requests), args.new_tokens, args.threads,
                         args.activation_quant)
    print("RESULT " + json.dumps(result))


def ab(args: argparse.Namespace) -> None:
    sources = {"A": str(Path(args.ab).resolve()), "B": str(ROOT / "src")}
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    loads = [os.getloadavg()[0]]
    for round_index in range(args.rounds):
        for name in ("A", "B") if round_index % 2 == 0 else ("B", "A"):
            env = {**os.environ, "PYTHONPATH": sources[name]}
            command = [sys.executable, __file__, "--child", "--requests", str(args.requests), "--new-tokens",
                       str(args.new_tokens), "--threads", str(args.threads), "--activation-quant",
                       args.activation_quant]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
            loads.append(os.getloadavg()[0])
            print(f"round {round_index + 1} {name}: {runs[name][-1]['seconds']:.2f} s "
                  f"{ {p: round(v, 2) for p, v in runs[name][-1]['phases'].items()} }", flush=True)
    rows = []
    for name, results in runs.items():
        median = {
            "seconds": statistics.median(r["seconds"] for r in results),
            "cpu_seconds": statistics.median(r["cpu_seconds"] for r in results),
            "phases": {p: statistics.median(r["phases"][p] for r in results) for p in PHASES},
            "phases_cpu": {p: statistics.median(r["phases_cpu"][p] for r in results) for p in PHASES[:-1]},
            "steps": results[0]["steps"],
        }
        rows.append(["A: the --ab checkout" if name == "A" else "B: this checkout", *_phase_cells(median)])
    same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["A"], runs["B"], strict=True))
    notes = (f"Paired A/B, {args.rounds} rounds alternating A and B (medians), {args.requests} requests, "
             f"{args.new_tokens} new tokens, {args.threads} threads, activations {args.activation_quant}; "
             f"1-minute load average during the rounds: {min(loads):.1f}-{max(loads):.1f}. "
             f"Same tokens from A and B: {'yes' if same else 'NO'}.")
    table = markdown_table(["checkout", *PHASE_HEADER], rows)
    print(table + "\n" + notes)
    if args.write:
        write_result("shared_prefix_ab", "Shared-prefix batch: paired A/B by phase", table, notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="how many of the 16 suffixes to send")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--activation-quant", default="none", choices=["none", "int8"])
    parser.add_argument("--ab", metavar="SRC", help="paired A/B: another checkout's src directory as A")
    parser.add_argument("--rounds", type=int, default=3, help="with --ab: rounds (each runs A and B once)")
    parser.add_argument("--write", action="store_true", help="with --ab: write benchmarks/results/shared_prefix_ab.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.ab:
        ab(args)
        return
    prompts = _prompts(args.requests)
    results = {}
    for name, flags in VARIANTS.items():
        results[name] = run_variant(flags, prompts, args.new_tokens, args.threads, args.activation_quant)
        r = results[name]
        print(f"{name}: {r['seconds']:.1f} s wall, {r['cpu_seconds']:.1f} s CPU, cached {r['cached']}", flush=True)
    before = results[next(iter(VARIANTS))]
    rows = []
    for name, r in results.items():
        rows.append([
            name, *_phase_cells(r), before["seconds"] / r["seconds"], r["ttft"],
            sum(1 for c in r["cached"] if c == 0), "yes" if r["tokens"] == before["tokens"] else "NO",
        ])
    table = markdown_table(
        ["variant", *PHASE_HEADER, "speed-up (wall)", "mean TTFT s", "requests with 0 cached",
         "same tokens as before"], rows)
    notes = (
        f"{len(prompts)} requests (1,900-token prefix + 100-token suffixes), {args.new_tokens} new tokens each, "
        f"greedy, all sent at once; smollm2-135m with its native Q4_1 weights, {args.threads} threads, activations "
        f"{args.activation_quant}; 1-minute load average at the end: {os.getloadavg()[0]:.1f}. Per-request cached "
        "tokens (default): " + ", ".join(str(c) for c in results[DEFAULT]["cached"]) + "."
    )
    print(write_result("shared_prefix", "Shared-prefix batch: phases, admission hold-back and cascade attention",
                       table, notes))


if __name__ == "__main__":
    main()
