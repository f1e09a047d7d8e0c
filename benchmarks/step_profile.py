"""Per-step profile of decode: where one engine step's time goes, for one request and for batch 8.

Default model (smollm2-135m, its Q4_1 GGUF run as stored: `weights="native"`), native kernels, 2 threads.
Each configuration runs decode steps twice: once plain (the ms/step and tok/s reported) and once with
timers wrapped around the parts (exclusive times: a part's own time, without the timed parts it calls):
matmuls, attention, norms, RoPE + KV write, SwiGLU, the C layer loop, the lm head, the sampler, the
scheduler, batch preparation, Python glue inside the forward, and the rest of the engine step. The timers
add ~1 us per wrapped call, charged to the enclosing part, so the instrumented total is a bit above the
plain one.

Three configurations, interleaved round by round on the same running requests (the machine is shared;
each sees the same load drift and context lengths): "before", the Python layer loop with its torch glue
as it was (RoPE by cat, `index_copy_` KV writes, silu * mul: the reference twins); the Python loop with
the fused kernels (RoPE + KV write, SwiGLU); and the C layer loop (`model/layer_loop.py`, one native call
per step). Reported ms/step: the best round's median. Runs are stored under `--label` in
benchmarks/results/step_profile.json and all stored runs go into the table and docs/step_profile.png.

    python benchmarks/step_profile.py                      # a few minutes on 2 busy cores
    python benchmarks/step_profile.py --threads 1 --label "1 thread"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, load_workloads, machine, markdown_table, today, write_result  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402

STORE = RESULTS / "step_profile.json"
PLOT = ROOT / "docs" / "step_profile.png"
BATCHES = (1, 8)
ABSORBING = ("lm head", "sampler")
SHORT = {"before (Python loop, torch glue)": "before", "Python loop + fused kernels": "fused",
         "C layer loop": "C loop"}


class PartTimer:
    """Exclusive wall time per part: nested timed calls are subtracted from their caller."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.stack: list[float] = []  # time spent in timed children of each open call
        self.absorbing = False

    def wrap(self, part: str, function, absorb: bool = False):
        """`absorb`: calls made inside count as this part (the lm head's matmul is the lm head's)."""
        def timed(*args, **kwargs):
            if self.absorbing:
                return function(*args, **kwargs)
            self.absorbing = absorb
            self.stack.append(0.0)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.absorbing = False
                elapsed = time.perf_counter() - start
                children = self.stack.pop()
                self.totals[part] = self.totals.get(part, 0.0) + elapsed - children
                if self.stack:
                    self.stack[-1] += elapsed
        return timed


def patch_points(engine) -> list[tuple[object, str, str]]:
    """(owner, attribute, part) of every call the profile times; owners without the attribute are skipped."""
    from kvserve.engine import engine as engine_module
    from kvserve.engine.model_runner import ModelRunner
    from kvserve.kernels.ops import Kernels
    from kvserve.kv import attention
    from kvserve.model import llama

    points = [
        (Kernels, "linear", "matmuls"), (Kernels, "rms_norm", "norms"), (Kernels, "embedding", "embedding"),
        (Kernels, "paged_attention", "attention"), (attention, "_decode_attention", "attention"),
        (attention, "_prefill_attention", "attention"), (llama, "paged_attention", "attention (glue)"),
        (attention, "write_kv", "rope + kv write"), (llama, "_apply_rope", "rope + kv write"),
        (Kernels, "rope_kv_write", "rope + kv write"), (Kernels, "swiglu", "swiglu"),
        (llama.LlamaModel, "compute_logits", "lm head"), (llama.LlamaModel, "forward", "python glue (forward)"),
        (engine_module, "sample", "sampler"), (type(engine.scheduler), "schedule", "scheduler"),
        (ModelRunner, "prepare", "batch metadata"),
    ]
    try:
        from kvserve.model.layer_loop import LayerLoop

        points.append((LayerLoop, "forward", "C layer loop (all layers)"))
    except ImportError:
        pass
    return [(owner, name, part) for owner, name, part in points if hasattr(owner, name)]


def configurations(model) -> dict[str, object]:
    """name -> a function that sets the model up that way (and returns a function that undoes it)."""
    from kvserve.kernels import reference
    from kvserve.kernels.ops import Kernels

    loop = model.layer_loop

    def torch_glue():  # the Python loop as it was: RoPE by cat, index_copy_ KV writes, silu * mul
        originals = Kernels.rope_kv_write, Kernels.swiglu
        model.layer_loop = None
        Kernels.rope_kv_write = lambda self, *args: reference.rope_kv_write(*args)
        Kernels.swiglu = lambda self, gate_up: reference.swiglu(gate_up)

        def undo():
            Kernels.rope_kv_write, Kernels.swiglu = originals
            model.layer_loop = loop
        return undo

    def fused():
        model.layer_loop = None
        return lambda: setattr(model, "layer_loop", loop)

    def layer_loop():
        model.layer_loop = loop
        return lambda: None

    configs = {"before (Python loop, torch glue)": torch_glue, "Python loop + fused kernels": fused}
    if loop is not None:
        configs["C layer loop"] = layer_loop
    return configs


def timed_steps(engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - begin)
    return times


def instrumented_steps(engine, steps: int) -> tuple[dict[str, float], float]:
    timer = PartTimer()
    points = patch_points(engine)
    originals = [getattr(owner, name) for owner, name, _ in points]
    for owner, name, part in points:
        setattr(owner, name, timer.wrap(part, getattr(owner, name), absorb=part in ABSORBING))
    try:
        total = sum(timed_steps(engine, steps))
    finally:
        for (owner, name, _), original in zip(points, originals, strict=True):
            setattr(owner, name, original)
    return timer.totals, total


def profile_batch(llm: LLM, prompts: list[list[int]], steps: int, rounds: int) -> dict[str, dict]:
    """The configurations interleaved round by round on the same running requests (the load on a shared
    machine drifts: each configuration sees the same drift and the same context lengths)."""
    engine = llm.engine
    configs = configurations(engine.model)
    budget = rounds * len(configs) * 2 * steps + 8
    for prompt in prompts:
        params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
        engine.add(engine.make_request(prompt, params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    plain: dict[str, list[float]] = {name: [] for name in configs}
    parts: dict[str, dict[str, float]] = {name: {} for name in configs}
    instrumented: dict[str, float] = dict.fromkeys(configs, 0.0)
    for _ in range(rounds):
        for name, setup in configs.items():
            undo = setup()
            try:
                timed_steps(engine, 1)  # warm up
                plain[name].append(statistics.median(timed_steps(engine, steps)))
                totals, total = instrumented_steps(engine, steps)
            finally:
                undo()
            instrumented[name] += total
            for part, seconds in totals.items():
                parts[name][part] = parts[name].get(part, 0.0) + seconds
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    results = {}
    count = rounds * steps
    for name in configs:
        ms = {part: 1000 * seconds / count for part, seconds in sorted(parts[name].items())}
        ms["engine rest (outputs, detokenize)"] = 1000 * instrumented[name] / count - sum(ms.values())
        best = 1000 * min(plain[name])
        results[name] = {"ms_per_step": best, "tok_per_s": len(prompts) * 1000 / best,
                         "instrumented_ms": 1000 * instrumented[name] / count, "parts": ms}
    return results


def measure(steps: int, rounds: int) -> dict[str, dict]:
    prompts = load_workloads()["batch"]["8"]["prompts"]
    llm = LLM("smollm2-135m", progress=False, kv_cache_memory="256MiB", weights="native", kernels="native")
    results: dict[str, dict] = {}
    for batch in BATCHES:
        for name, result in profile_batch(llm, prompts[:batch], steps, rounds).items():
            results[f"{name}, batch {batch}"] = result
            print(f"{name:34s} batch {batch}: {result['ms_per_step']:8.2f} ms/step ({result['tok_per_s']:.1f} tok/s)",
                  flush=True)
    return results


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(name.split(": ", 1)[0] for name in results))
    fig, axes = plt.subplots(len(labels), len(BATCHES), figsize=(12, 1.2 + 1.6 * len(labels)), squeeze=False)
    parts = sorted({part for result in results.values() for part in result["parts"]})
    colors = dict(zip(parts, plt.get_cmap("tab20").colors, strict=False))
    for row, label in zip(axes, labels, strict=True):
        for ax, batch in zip(row, BATCHES, strict=True):
            names = [name for name in results if name.startswith(f"{label}: ") and name.endswith(f"batch {batch}")]
            left = [0.0] * len(names)
            for part in parts:
                widths = [max(0.0, results[name]["parts"].get(part, 0.0)) for name in names]
                ax.barh([SHORT[n.split(": ", 1)[1].rsplit(",", 1)[0]] for n in names], widths, left=left, label=part,
                        color=colors[part])
                left = [a + b for a, b in zip(left, widths, strict=True)]
            ax.set_title(f"{label}, batch {batch}", fontsize=9)
            ax.set_xlabel("ms per decode step (instrumented)", fontsize=8)
            ax.invert_yaxis()
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(store: dict) -> None:
    results = {f"{label}: {name}": result for label, runs in store.items() for name, result in runs["results"].items()}
    def before(name: str) -> dict:
        label, rest = name.split(": ", 1)
        return results[f"{label}: before (Python loop, torch glue),{rest.rsplit(',', 1)[1]}"]

    rows = [[name, r["ms_per_step"], r["tok_per_s"], f"{before(name)['ms_per_step'] / r['ms_per_step']:.2f}x",
             r["instrumented_ms"]] for name, r in results.items()]
    parts = sorted({part for r in results.values() for part in r["parts"]})
    part_rows = [[part] + [results[name]["parts"].get(part, 0.0) for name in results] for part in parts]
    short = [f"{name.split(':')[0]}: {SHORT[name.split(': ', 1)[1].rsplit(',', 1)[0]]}, b{name.rsplit(' ', 1)[1]}"
             for name in results]
    runs = "\n".join(
        f"- {label}: `{run['command']}` at {run['commit']} — {run['machine']} — {run['date']} — load average "
        f"{run['load'][0]:.1f} before, {run['load'][1]:.1f} after (on 2 cores)"
        for label, run in store.items()
    )
    table = (
        markdown_table(["configuration", "ms / step", "tok/s", "vs before", "instrumented ms / step"], rows)
        + "\n\nExclusive ms per step by part (instrumented run), ![plot](docs/step_profile.png):\n\n"
        + markdown_table(["part", *short], part_rows)
    )
    notes = (
        "Runs:\n\n" + runs + "\n\nThe machine (2 cores) was shared by several sessions running tests and "
        "benchmarks while these ran (load averages above): every absolute number here is several times what an "
        "idle machine gives, and only the ratios between configurations of one run mean anything (they ran "
        "interleaved, round by round, on the same requests). Batch 8 prompts: the `batch/8` workload (64-122 "
        "tokens); batch 1 is its first prompt. Parts are exclusive times of the instrumented run; the lm head "
        "and sampler include the matmul / ops they call. With 2 threads on an oversubscribed machine each OpenMP "
        "region waits for a descheduled peer thread, so the 2-thread rows swing by 2x between configurations "
        "whose matmuls are identical (see the matmuls row): read the 1-thread run for the comparison.\n"
    )
    write_result("step_profile", "Per-step decode profile (Python loop vs C layer loop)", table, notes)
    plot(results, PLOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="2 threads", help="where this run's rows go in step_profile.json")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--report-only", action="store_true", help="redraw the table and plot from the stored runs")
    args = parser.parse_args()
    if args.report_only:
        report(json.loads(STORE.read_text()))
        return
    torch.set_num_threads(args.threads)
    import subprocess

    store = json.loads(STORE.read_text()) if STORE.exists() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    load_before = os.getloadavg()[0]
    results = measure(args.steps, args.rounds)
    store[args.label] = {
        "results": results, "load": [load_before, os.getloadavg()[0]], "machine": machine(), "date": today(),
        "commit": commit.strip(), "command": "python " + shlex.join(["benchmarks/step_profile.py", *sys.argv[1:]]),
    }
    STORE.parent.mkdir(parents=True, exist_ok=True)
    STORE.write_text(json.dumps(store, indent=1))
    report(store)


if __name__ == "__main__":
    main()
