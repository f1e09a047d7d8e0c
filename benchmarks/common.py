"""Shared benchmark helpers: workloads, the machine description, result files, HF reference runs."""

from __future__ import annotations

import ctypes
import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvserve.kernels.native import cpu_flags

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WORKLOADS = ROOT / "benchmarks" / "data" / "workloads.json"


def load_workloads() -> dict:
    """The fixed token-id workloads in benchmarks/data (same work the peers in PEERS.md ran)."""
    if not WORKLOADS.exists():
        raise SystemExit(f"missing {WORKLOADS}: the workloads file ships with the repository for this benchmark")
    return json.loads(WORKLOADS.read_text())


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (so transformers bf16 is its faster dtype, not an emulation)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def isa_summary() -> str:
    """The vector features kernels dispatch on, as benchmarks record them beside the CPU model."""
    flags = cpu_flags()
    names = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "VNNI", "avx512_bf16": "BF16",
             "amx_bf16": "AMX"}
    present = [label for flag, label in names.items() if flag in flags]
    return "+".join(present) if present else "no AVX2"


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    cpu = f"{model} ({isa_summary()}), {os.cpu_count()} cores"
    return f"{cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def today() -> str:
    return _dt.date.today().isoformat()


# Environment that changes what the kernels run (kvserve.kernels.ops / native): shown with the command.
KERNEL_ENV = ("KVSERVE_ISA", "KVSERVE_AMX")


def command_line() -> str:
    env = [f"{name}={os.environ[name]} " for name in KERNEL_ENV if name in os.environ]
    return "".join(env) + "python " + shlex.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])  # copyable


def write_result(name: str, title: str, table: str, notes: str = "") -> Path:
    """Write one benchmark's markdown section to benchmarks/results/NAME.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    body = (
        f"## {title}\n\n`{command_line()}` — {machine()} — {today()}\n\n{table}\n"
        + (f"\n{notes}\n" if notes else "")
    )
    path.write_text(body)
    return path


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    def cell(value: object) -> str:
        return f"{value:,.2f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def load_hf_model(dtype: torch.dtype):
    """transformers on the same GGUF (the reference peer)."""
    from transformers import AutoModelForCausalLM

    from kvserve.model.registry import resolve_model

    path = resolve_model("smollm2-135m")
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy, EOS ignored, left-padded batch with an explicit attention mask."""
    pad = 0
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
    )
    return out[:, width:].tolist()


def require_native(llm, args: dict[str, str]) -> None:
    """Stop when a runner asked for the native kernels and the engine fell back to torch's (a failed build
    only warns): its figures would be the torch kernels' under a native runner's name."""
    if args.get("kernels") == "native" and llm.engine.model.kernels.backend != "native":
        raise SystemExit("the native kernels did not load (see the warning above); refusing to time the torch "
                         f"kernels as {args}")


def line_plot(series: dict[str, dict[int, float]], path: Path, xlabel: str, ylabel: str, log: bool = False) -> None:
    """One line per runner of its value by size (sorted), to a PNG: long_decode.py, short_prefill.py."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, by_size in series.items():
        sizes = sorted(by_size)
        ax.plot(sizes, [by_size[size] for size in sizes], marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def best_cpu_ms(fn, reps: int) -> float:
    """CPU milliseconds of the fastest of `reps` calls of fn after one warm-up: process time, so a shared
    machine's other load enters less than it would wall time."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e3


def compile_c_loop(source: str, workdir: Path, name: str, flags: tuple[str, ...] = ("-mavx2",)) -> ctypes.CDLL:
    """A benchmark's small C++ loop (membw.py, fp_rate.py) built with g++ into workdir and loaded."""
    path, library = workdir / f"{name}.cpp", workdir / f"{name}.so"
    path.write_text(source)
    subprocess.run(["g++", "-O2", *flags, "-fopenmp", "-fPIC", "-shared", "-o", str(library), str(path)], check=True)
    return ctypes.CDLL(str(library))
