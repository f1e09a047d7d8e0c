"""Per-step profile of decode: where one engine step's time goes, for one request and for batch 8.

Default model (smollm2-135m, its Q4_1 GGUF run as stored: `weights="native"`), native kernels, 2 threads.
Each configuration runs decode steps twice: once plain (the ms/step and tok/s reported) and once with
timers wrapped around the parts (exclusive times: a part's own time, without the timed parts it calls):
matmuls, attention, norms, RoPE + KV write, SwiGLU, the C layer loop, the lm head, the sampler, the
scheduler, batch preparation, Python glue inside the forward, and the rest of the engine step. The timers
add ~1 us per wrapped call, charged to the enclosing part, so the instrumented total is a bit above the
plain one.

Configurations measured in one run: the Python layer loop with the fused kernels (RoPE + KV write,
SwiGLU), and the C layer loop (`model/layer_loop.py`, one native call per step). The "before" rows (the
Python loop as it was, unfused) were measured by this script at the parent commit and are kept in
benchmarks/results/step_profile.json; `--label before` re-measures into that slot on such a checkout.

    python benchmarks/step_profile.py               # about 1 minute
"""

from __future__ import annotations

import argparse
import json
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


class PartTimer:
    """Exclusive wall time per part: nested timed calls are subtracted from their caller."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.stack: list[float] = []  # time spent in timed children of each open call

    def wrap(self, part: str, function):
        def timed(*args, **kwargs):
            self.stack.append(0.0)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
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


def start(llm: LLM, prompts: list[list[int]], steps: int) -> None:
    engine = llm.engine
    for prompt in prompts:
        engine.add(engine.make_request(prompt, SamplingParams(max_tokens=2 * steps + 8, temperature=0.0,
                                                              ignore_eos=True)))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    for _ in range(3):  # warm up
        engine.step()


def profile(llm: LLM, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """ms per decode step, plain, then per part; the requests are aborted afterwards."""
    engine = llm.engine
    start(llm, prompts, steps)
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - begin)
    timer = PartTimer()
    points = patch_points(engine)
    originals = [getattr(owner, name) for owner, name, _ in points]
    for owner, name, part in points:
        setattr(owner, name, timer.wrap(part, getattr(owner, name)))
    try:
        begin = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - begin
    finally:
        for (owner, name, _), original in zip(points, originals, strict=True):
            setattr(owner, name, original)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    parts = {part: 1000 * seconds / steps for part, seconds in sorted(timer.totals.items())}
    parts["engine rest (outputs, detokenize)"] = 1000 * total / steps - sum(parts.values())
    return {"ms_per_step": 1000 * statistics.median(times), "instrumented_ms": 1000 * total / steps, "parts": parts}


def measure(steps: int) -> dict[str, dict]:
    workloads = load_workloads()
    prompts = workloads["batch"]["8"]["prompts"]
    llm = LLM("smollm2-135m", progress=False, kv_cache_memory="256MiB", weights="native", kernels="native")
    model = llm.engine.model
    configs = {"python loop": None}
    loop = getattr(model, "layer_loop", None)
    if loop is not None:
        configs = {"python loop + fused kernels": None, "C layer loop": loop}
    results: dict[str, dict] = {}
    for config, layer_loop in configs.items():
        if hasattr(model, "layer_loop"):
            model.layer_loop = layer_loop
        for batch in BATCHES:
            result = profile(llm, prompts[:batch], steps)
            result["tok_per_s"] = batch * 1000 / result["ms_per_step"]
            results[f"{config}, batch {batch}"] = result
            print(f"{config:30s} batch {batch}: {result['ms_per_step']:.2f} ms/step "
                  f"({result['tok_per_s']:.1f} tok/s)", flush=True)
    if hasattr(model, "layer_loop"):
        model.layer_loop = loop
    return results


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(BATCHES), figsize=(12, 3.6))
    parts = sorted({part for result in results.values() for part in result["parts"]})
    colors = dict(zip(parts, plt.get_cmap("tab20").colors, strict=False))
    for ax, batch in zip(axes, BATCHES, strict=True):
        names = [name for name in results if name.endswith(f"batch {batch}")]
        left = [0.0] * len(names)
        for part in parts:
            widths = [max(0.0, results[name]["parts"].get(part, 0.0)) for name in names]
            ax.barh([n.rsplit(",", 1)[0] for n in names], widths, left=left, label=part, color=colors[part])
            left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.set_xlabel(f"ms per decode step, batch {batch} (instrumented)")
        ax.invert_yaxis()
    axes[-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(store: dict) -> None:
    results = {f"{label}: {name}": result for label, runs in store.items() for name, result in runs["results"].items()}
    rows = [[name, r["ms_per_step"], r["tok_per_s"], r["instrumented_ms"]] for name, r in results.items()]
    parts = sorted({part for r in results.values() for part in r["parts"]})
    part_rows = [[part] + [results[name]["parts"].get(part, 0.0) for name in results] for part in parts]
    runs = "\n".join(f"- {label}: `{run['command']}` at {run['commit']} — {run['machine']} — {run['date']}"
                     for label, run in store.items())
    table = (
        markdown_table(["configuration", "ms / step", "tok/s", "instrumented ms / step"], rows)
        + "\n\nExclusive ms per step by part (instrumented run), ![plot](docs/step_profile.png):\n\n"
        + markdown_table(["part", *results], part_rows)
    )
    notes = (
        "Runs:\n\n" + runs + "\n\nThe machine (2 cores) is shared by several sessions while these ran: "
        "absolute numbers are noisy (±15% run to run); compare rows of one run. Batch 8 prompts: the "
        "`batch/8` workload; batch 1 is its first prompt."
    )
    write_result("step_profile", "Per-step decode profile (Python loop vs C layer loop)", table, notes)
    plot(results, PLOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="after", help="where this run's rows go in step_profile.json")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    import subprocess

    store = json.loads(STORE.read_text()) if STORE.exists() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    store[args.label] = {
        "results": measure(args.steps), "machine": machine(), "date": today(), "commit": commit.strip(),
        "command": f"python benchmarks/step_profile.py --label {args.label}",
    }
    STORE.parent.mkdir(parents=True, exist_ok=True)
    STORE.write_text(json.dumps(store, indent=1))
    report(store)


if __name__ == "__main__":
    main()
