"""Native kernels: kvserve (native kernels on the GGUF's own Q4_1/Q8_0 weights, and on dense fp32
weights, and the torch kernels as before) beside transformers fp32 and llama.cpp (llama-cpp-python, the
`bench` extra) on the same GGUF, in one run.

Figures: one-request decode tok/s; batch 8 / 32 (generated tokens / wall time, prefill included, as
PEERS.md counts it); prefill tok/s at 512 and 2,048; the shared-prefix workload (16 requests sharing a
1,900-token prefix, 32 new tokens each, all sent at once) in seconds; `LLM()` ready time in a fresh
process; `kvserve generate ... --max-tokens 16` end to end. Then a per-step time breakdown of a batch-8
decode step (matmuls, attention, norms, lm head, the rest) before (torch kernels, dense) and after
(native kernels and weights), drawn to docs/kernels_step.png.

    python benchmarks/native_kernels.py            # about 10 minutes on 2 busy cores
    python benchmarks/native_kernels.py --quick    # smaller decode lengths
    python benchmarks/native_kernels.py --decode-only 5 --before 0685dfc   # single-request decode only, 5 rounds
    python benchmarks/native_kernels.py --prefill-only --rounds 2 --before-src /tmp/before/src  # prefill, paired

`--decode-only ROUNDS` measures single-request decode alone: kvserve native Q4_1 with exact and int8
activations, llama-cpp-python and llama-batched-bench, interleaved round by round (the machine's load hits
all alike), median per runner, to benchmarks/results/kernels_decode.md. `--before REV` adds the same two
kvserve variants running the native kernels as built from git revision REV (its csrc/, compiled with
today's flags into a temporary library, same C ABI), for a paired before/after in one process.
`--prefill-only --before-src SRC` adds the two variants as another checkout's whole kvserve runs them (its
Python too: benchmarks/source_ab.py, a child process), interleaved with the rest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ROOT,
    Timer,
    hf_generate,
    load_hf_model,
    load_workloads,
    markdown_table,
    native_bf16,
    require_native,
    write_result,
)
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.kernels.native import cpu_flags  # noqa: E402
from kvserve.model.registry import resolve_model  # noqa: E402

VARIANTS = {
    "kvserve native Q4_1": {"kernels": "native", "weights": "native"},
    "kvserve native Q4_1 int8": {"kernels": "native", "weights": "native", "activation_quant": "int8"},
    # llama.cpp's own precision class: int8 activation blocks, a 16-bit KV cache, 16-bit attention products
    "kvserve native Q4_1 int8, bf16 KV + attention": {"kernels": "native", "weights": "native",
                                                      "activation_quant": "int8", "kv_cache_dtype": "bfloat16",
                                                      "attention_dtype": "bfloat16"},
    "kvserve native fp32": {"kernels": "native", "weights": "dense"},
    "kvserve torch fp32 (before)": {"kernels": "torch", "weights": "dense"},
}


FAST = "kvserve native Q4_1 int8, bf16 KV + attention"
# ... and prefill rows' matmuls as bf16 products on AMX-BF16 tiles (`--prefill-dtype bfloat16`), where there are any
BF16_PREFILL = "kvserve native Q4_1 int8, bf16 KV + attention + prefill"
if "amx_bf16" in cpu_flags():
    VARIANTS[BF16_PREFILL] = {**VARIANTS[FAST], "prefill_dtype": "bfloat16"}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


class KvserveRunner:
    def __init__(self, name: str, args: dict[str, str], library: Path | None = None) -> None:
        self.name = name
        self.llm = LLM("smollm2-135m", progress=False, kv_cache_memory="1GiB", max_num_seqs=64, **args)
        require_native(self.llm, args)
        if library is not None:  # another build of the native kernels (same ABI): swap it in everywhere
            from kvserve.kernels.native import NativeLibrary

            model = self.llm.engine.model
            native = NativeLibrary.load(library, model.kernels.native.isa)
            model.kernels.native = native
            if model.layer_loop is not None:
                model.layer_loop.native = native

    def decode(self, prompt: list[int], new: int) -> float:
        out = self.llm.generate([prompt], greedy(new))[0]
        return (new - 1) / (out.metrics.total_time - out.metrics.ttft)

    def batch(self, prompts: list[list[int]], new: int) -> float:
        """Generated tok/s over the whole batch, its prefill included: a fresh namespace each call, so a
        later round does not find the prompts cached by an earlier one (the peers recompute them too)."""
        with Timer() as timer:
            self.llm.generate(prompts, greedy(new), cache_salt=str(time.perf_counter()))
        return len(prompts) * new / timer.seconds

    def prefill(self, prompt: list[int]) -> float:
        salt = str(time.perf_counter())  # a fresh namespace: nothing cached
        out = self.llm.generate([prompt], greedy(1), cache_salt=salt)[0]
        return len(prompt) / out.metrics.ttft

    def turn(self, history: list[int], new: list[int]) -> float:
        """Seconds to the first token of `history + new` right after `history` (source_ab.turn_ttft)."""
        from source_ab import turn_ttft

        return turn_ttft(self.llm, history, new)

    def shared_prefix(self, prefix: list[int], suffixes: list[list[int]], new: int) -> float:
        with Timer() as timer:
            self.llm.generate([prefix + s for s in suffixes], greedy(new), cache_salt=str(time.perf_counter()))
        return timer.seconds


class HFRunner:
    """transformers on the same GGUF. bf16 on a CPU without avx512_bf16 / AMX: only decode and prefill
    (`skip`): its matmuls run emulated, tens of times slower than fp32, so batches and the shared-prefix run
    would take many minutes; it is measured so that "x transformers bf16" is stated with fp32 beside it. On
    a CPU with native bf16 it is the faster dtype and runs every figure."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.name = "transformers fp32" if dtype == torch.float32 else "transformers bf16"
        emulated = dtype == torch.bfloat16 and not native_bf16()
        self.skip = ("batch8", "batch32", "shared") if emulated else ()
        self.model = load_hf_model(dtype)

    def decode(self, prompt: list[int], new: int) -> float:
        with Timer() as first:
            hf_generate(self.model, [prompt], 1)
        with Timer() as full:
            hf_generate(self.model, [prompt], new)
        return (new - 1) / (full.seconds - first.seconds)

    def batch(self, prompts: list[list[int]], new: int) -> float:
        with Timer() as timer:
            hf_generate(self.model, prompts, new)
        return len(prompts) * new / timer.seconds

    def prefill(self, prompt: list[int]) -> float:
        with Timer() as timer:
            hf_generate(self.model, [prompt], 1)
        return len(prompt) / timer.seconds

    def shared_prefix(self, prefix: list[int], suffixes: list[list[int]], new: int) -> float:
        with Timer() as timer:  # one at a time, as PEERS.md measured it
            for suffix in suffixes:
                hf_generate(self.model, [prefix + suffix], new)
        return timer.seconds


class LlamaCppRunner:
    name = "llama.cpp (llama-cpp-python)"

    def __init__(self) -> None:
        from llama_cpp import Llama

        self.model = Llama(str(resolve_model("smollm2-135m")), n_ctx=4096, n_threads=torch.get_num_threads(),
                           n_batch=512, verbose=False)

    def _run(self, prompt: list[int], new: int) -> tuple[float, float]:
        """(seconds to the first token, seconds in total) for greedy generation from a fresh context."""
        self.model.reset()
        start = time.perf_counter()
        first = None
        count = 0
        for _ in self.model.generate(prompt, temp=0.0, top_k=1, reset=True):
            count += 1
            if first is None:
                first = time.perf_counter() - start
            if count >= new:
                break
        return first, time.perf_counter() - start

    def decode(self, prompt: list[int], new: int) -> float:
        first, total = self._run(prompt, new)
        return (new - 1) / (total - first)

    def batch(self, prompts: list[list[int]], new: int) -> float:
        with Timer() as timer:  # its Python API runs one sequence at a time
            for prompt in prompts:
                self._run(prompt, new)
        return len(prompts) * new / timer.seconds

    def prefill(self, prompt: list[int]) -> float:
        return len(prompt) / self._run(prompt, 1)[0]

    def turn(self, history: list[int], new: list[int]) -> float:
        """Seconds to the first token of `history + new` right after `history`: generate() reuses the longest
        prefix already in the context."""
        self.model.reset()
        next(iter(self.model.generate(history, temp=0.0, top_k=1)))
        with Timer() as timer:
            next(iter(self.model.generate(history + new, temp=0.0, top_k=1)))
        return timer.seconds

    def shared_prefix(self, prefix: list[int], suffixes: list[list[int]], new: int) -> float:
        with Timer() as timer:  # one at a time; reset() drops its cache, so each prefills the prefix
            for suffix in suffixes:
                self._run(prefix + suffix, new)
        return timer.seconds


def llama_cpp_python_usable(notes: list[str]) -> bool:
    """Whether llama-cpp-python can run here (without loading it): installed, and not with KVSERVE_ISA=avx2
    (its wheel runs the CPU's widest ISA, while llama_cpp_tools then builds its tools for AVX2 like kvserve's
    forced path); the notes say why not."""
    import importlib.util

    import llama_cpp_tools

    if llama_cpp_tools.forced_avx2():
        notes.append("KVSERVE_ISA=avx2: kvserve on its AVX2 kernels, llama.cpp's tools built for AVX2 / FMA "
                     "(llama_cpp_tools.AVX2_ARGS); llama-cpp-python left out (its wheel uses the CPU's widest ISA).")
        return False
    if importlib.util.find_spec("llama_cpp") is None:
        notes.append("llama-cpp-python: not installed (`pip install -e .[bench]`).")
        return False
    return True


def llama_cpp_python_runner(notes: list[str]) -> list:
    """llama.cpp through llama-cpp-python, when `llama_cpp_python_usable`."""
    return [LlamaCppRunner()] if llama_cpp_python_usable(notes) else []


def llama_cpp_tools_runner(notes: list[str]) -> list:
    """llama.cpp's own batched-bench and server (benchmarks/llama_cpp_peers.py), when its tools are built."""
    import llama_cpp_tools

    if not llama_cpp_tools.built():
        notes.append("llama.cpp's own tools: not built (`python benchmarks/llama_cpp_tools.py --build`).")
        return []
    from llama_cpp_peers import LlamaCppToolsRunner

    notes.append("llama.cpp (batched-bench, server): decode and batch figures from llama-batched-bench (batch "
                 "prompts of the workload's mean length), prefill its S_PP, shared prefix all 16 at once to "
                 "llama-server with 16 slots.")
    return [LlamaCppToolsRunner()]


def llama_cpp_avx2_runner(notes: list[str]) -> list:
    """batched-bench's AVX2 build beside the native one, when it is built and kvserve is not forced to AVX2,
    so that llama.cpp's faster build is the peer whichever it is (on a Zen 4, whose AVX-512 units are 256 bits
    wide, the two decoded within 5% of each other: results/kernels_zen4_decode.md)."""
    import llama_cpp_tools

    if llama_cpp_tools.forced_avx2() or not llama_cpp_tools.built(avx2=True):
        return []
    from llama_cpp_peers import LlamaCppToolsRunner

    notes.append("llama.cpp AVX2 build (batched-bench, server): the same tools built for AVX2 / FMA only "
                 "(`KVSERVE_ISA=avx2 python benchmarks/llama_cpp_tools.py --build`).")
    return [LlamaCppToolsRunner(avx2=True)]


def seed_example(args: dict[str, str], workloads: dict, repeats: int) -> dict[str, float]:
    """The seed's example: a 2,000-token prompt with 1,900 tokens cached vs a fresh 100-token one."""
    from llama_cpp_peers import KvservePeer

    shared = workloads["shared_prefix"]
    return KvservePeer(args).cached_ttft(shared["prefix"], shared["suffixes"], repeats)


def ready_time(args: dict[str, str], repeats: int) -> float:
    """Seconds from a fresh interpreter to a ready `LLM()` (imports included), median of `repeats`."""
    options = ", ".join(f"{k}={v!r}" for k, v in args.items())
    code = (
        "import time; t = time.perf_counter(); from kvserve import LLM; "
        f"LLM('smollm2-135m', progress=False, {options}); print(time.perf_counter() - t)"
    )
    return statistics.median(
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
        for _ in range(repeats)
    )


def generate_time(args: dict[str, str]) -> float:
    """Wall seconds of `kvserve generate "..." --max-tokens 16`, process start to exit."""
    flags = [f"--{key}={value}" for key, value in args.items()]
    command = [sys.executable, "-m", "kvserve.cli", "generate", "Tell me about Paris.", "--max-tokens", "16", *flags]
    with Timer() as timer:
        subprocess.run(command, capture_output=True, check=True)
    return timer.seconds


def llama_cpp_ready() -> float:
    code = (
        "import time; t = time.perf_counter(); from llama_cpp import Llama; "
        f"Llama({str(resolve_model('smollm2-135m'))!r}, n_ctx=4096, verbose=False); print(time.perf_counter() - t)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(result.stdout)


PEER_SHARED_REQUESTS = 2  # the peers run shared-prefix requests one at a time: 2 of 16, scaled to 16


def _paired_ratios(samples: dict[str, dict[str, list[float]]], names: tuple[str, ...]) -> str:
    """With `--before-src`: each variant's tok/s over its before's, round by round (the two ran back to back),
    as median (min - max): on a shared machine whose speed swings between rounds, the per-runner medians can
    disagree with the pairs."""
    pairs = [(name, f"{name} (before)") for name in names if f"{name} (before)" in samples]
    if not pairs:
        return ""
    rows = []
    for after, before in pairs:
        cells = []
        for key in ("prefill512", "prefill2048"):
            ratios = [a / b for a, b in zip(samples[after][key], samples[before][key], strict=True)]
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f} - {max(ratios):.2f}), "
                         f"{sum(r > 1 for r in ratios)} of {len(ratios)} faster")
        rows.append([f"{after} / before", *cells])
    return ("\n\nPaired, round by round (after / before tok/s: median (min - max), rounds where after was faster):"
            "\n\n" + markdown_table(["", "prefill 512", "prefill 2048"], rows))


def _peer_ratios(samples: dict[str, dict[str, list[float]]], names: tuple[str, ...],
                 peer: str = "transformers bf16") -> str:
    """Each kvserve variant's tok/s over `peer`'s, round by round (the two ran in the same round): a round in
    which one of them ran slow moves one ratio, not the medians' quotient."""
    if peer not in samples:
        return ""
    rows = []
    for name in names:
        cells = []
        for key in ("prefill512", "prefill2048"):
            ratios = [a / b for a, b in zip(samples[name][key], samples[peer][key], strict=True)]
            cells.append(f"{statistics.median(ratios):.2f} ({' / '.join(f'{r:.2f}' for r in ratios)})")
        rows.append([name, *cells])
    return (f"\n\n÷ {peer}, round by round (median (each round)):\n\n"
            + markdown_table(["", "prefill 512", "prefill 2048"], rows))


def prefill_only(args: argparse.Namespace, workloads: dict) -> None:
    """Prefill 512 / 2,048 for kvserve (exact and int8) and transformers fp32 and bf16, `args.rounds` rounds
    interleaved runner by runner (medians), then the seed's example; to results/kernels_prefill.md."""
    names = ("kvserve native Q4_1", "kvserve native Q4_1 int8", FAST) + ((BF16_PREFILL,) * (BF16_PREFILL in VARIANTS))
    if args.variants:  # fewer runners: on this VM a run of many processes shows more slow rounds
        unknown = sorted(set(args.variants) - set(names))
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; choose from {list(names)}")
        names = tuple(name for name in names if name in args.variants)
    runners: list = [KvserveRunner(name, VARIANTS[name]) for name in names]
    if args.before_src:  # the same variants from another checkout's sources (source_ab.py), same threads
        from source_ab import SourceRunner

        runners += [SourceRunner(f"{name} (before)", args.before_src, VARIANTS[name], torch.get_num_threads())
                    for name in names]
    runners += ([] if args.skip_hf_fp32 else [HFRunner(torch.float32)]) + ([] if args.skip_hf_bf16 else
                                                                            [HFRunner(torch.bfloat16)])
    loads = [load_average()]
    samples: dict[str, dict[str, list[float]]] = {r.name: {"prefill512": [], "prefill2048": []} for r in runners}
    for runner in runners:
        runner.prefill(workloads["prefill"]["512"][:64])  # warm-up
    for round_index in range(args.rounds):
        for key, size in (("prefill512", "512"), ("prefill2048", "2048")):
            for runner in runners if round_index % 2 == 0 else runners[::-1]:
                samples[runner.name][key].append(runner.prefill(workloads["prefill"][size]))
                print(f"round {round_index + 1} {key} {runner.name}: {samples[runner.name][key][-1]:.1f} tok/s",
                      flush=True)
        loads.append(load_average())
    median = {name: {k: statistics.median(v) for k, v in figures.items()} for name, figures in samples.items()}
    rows = [[name, m["prefill512"], m["prefill2048"]] + [
        m[key] / median[peer][key] for peer in ("transformers fp32", "transformers bf16") if peer in median
        for key in ("prefill512", "prefill2048")] for name, m in median.items()]
    peers = [p for p in ("transformers fp32", "transformers bf16") if p in median]
    header = ["runner", "prefill 512 tok/s", "prefill 2048 tok/s"] + [
        f"÷ {peer} at {size}" for peer in peers for size in ("512", "2048")]
    for runner in runners:
        if hasattr(runner, "close"):
            runner.close()
    del runners
    seeds = {name: seed_example(VARIANTS[name], workloads, 3) for name in names if name != "kvserve native Q4_1 int8"}
    table = (markdown_table(header, rows) + _peer_ratios(samples, names) + _paired_ratios(samples, names)
             + "\n\nThe seed's example, one-token request wall seconds (medians of 3; target: cached ≤ 1.2 × "
             "fresh):\n\n"
             + markdown_table(["", "cold 2,000 tokens", "2,000 with 1,900 cached", "fresh 100 tokens",
                               "cached / fresh"],
                              [[name, s["cold"], s["cached"], s["fresh"], s["cached"] / s["fresh"]]
                               for name, s in seeds.items()]))
    notes = (f"{args.rounds} rounds, every runner in turn per figure (order reversed every other round), medians; "
             f"threads: {torch.get_num_threads()}; load average (1 / 5 / 15 min) per round: {'; '.join(loads)}. "
             "transformers bf16 on a CPU without avx512_bf16 / AMX runs its matmuls emulated: a ratio against it "
             "is no measure of kvserve's speed, read the fp32 one beside it.")
    name = "kernels_prefill" if args.out == "kernels" else f"{args.out}_prefill"  # e.g. kernels_amx_prefill
    title = f"Prefill beside transformers {' and '.join(p.removeprefix('transformers ') for p in peers)}, paired rounds"
    title += "" if name == "kernels_prefill" else f" ({name})"
    write_result(name, title, table, notes)
    print(table + "\n" + notes)


def figures(runners: list, workloads: dict, new: int) -> dict[str, dict[str, float]]:
    """Every figure for every runner, interleaved figure by figure so all runners see the same machine load."""
    shared = workloads["shared_prefix"]
    tasks = {
        "decode": lambda r: r.decode(workloads["prefill"]["128"], new),
        "batch8": lambda r: r.batch(workloads["batch"]["8"]["prompts"], new),
        "batch32": lambda r: r.batch(workloads["batch"]["32"]["prompts"], new),
        "prefill512": lambda r: r.prefill(workloads["prefill"]["512"]),
        "prefill2048": lambda r: r.prefill(workloads["prefill"]["2048"]),
        "shared": lambda r: (
            r.shared_prefix(shared["prefix"], shared["suffixes"], 32)
            if isinstance(r, KvserveRunner) or getattr(r, "all_at_once", False)
            else r.shared_prefix(shared["prefix"], shared["suffixes"][:PEER_SHARED_REQUESTS], 32)
            * len(shared["suffixes"]) / PEER_SHARED_REQUESTS
        ),
    }
    for runner in runners:
        runner.decode(workloads["prefill"]["128"], 8)  # warm-up
    results: dict[str, dict[str, float]] = {runner.name: {} for runner in runners}
    for key, task in tasks.items():
        for runner in runners:
            if key in getattr(runner, "skip", ()):
                results[runner.name][key] = float("nan")
                continue
            results[runner.name][key] = task(runner)
            print(f"{key:12s} {runner.name:30s} {results[runner.name][key]:10.2f}", flush=True)
    return results


def step_breakdown(args: dict[str, str], workloads: dict, steps: int = 16) -> dict[str, float]:
    """Milliseconds per batch-8 decode step by part, from timers wrapped around the model's calls."""
    from kvserve.model import llama
    from kvserve.model.layer_loop import LayerLoop

    llm = LLM("smollm2-135m", progress=False, kv_cache_memory="256MiB", **args)
    model, kernels = llm.engine.model, llm.engine.model.kernels
    # The native layer loop runs every layer (matmuls, attention, norms, RoPE) in one C call: timed whole.
    totals = {"matmuls": 0.0, "attention": 0.0, "norms": 0.0, "layer loop (C, all layers)": 0.0, "lm head": 0.0}
    depth = [0]  # only the outermost timed call counts (the lm head's matmul is the lm head's)

    def timed(part: str, function):
        def wrapper(*a, **k):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    totals[part] += time.perf_counter() - start
        return wrapper

    engine = llm.engine
    for prompt in workloads["batch"]["8"]["prompts"]:
        engine.add(engine.make_request(prompt, greedy(steps + 4)))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    originals = (type(kernels).linear, type(kernels).rms_norm, llama.paged_attention, type(model).compute_logits,
                 LayerLoop.forward)
    type(kernels).linear = timed("matmuls", originals[0])
    type(kernels).rms_norm = timed("norms", originals[1])
    llama.paged_attention = timed("attention", originals[2])
    type(model).compute_logits = timed("lm head", originals[3])
    LayerLoop.forward = timed("layer loop (C, all layers)", originals[4])
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - start
    finally:
        (type(kernels).linear, type(kernels).rms_norm, llama.paged_attention, type(model).compute_logits,
         LayerLoop.forward) = originals
    result = {part: 1000 * seconds / steps for part, seconds in totals.items()}
    result["other (python, rope, sampler, scheduler)"] = 1000 * total / steps - sum(result.values())
    return result


def plot(breakdowns: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(breakdowns)
    left = [0.0] * len(names)
    for part in next(iter(breakdowns.values())):
        widths = [breakdowns[name][part] for name in names]
        ax.barh(names, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("ms per batch-8 decode step")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_revision(rev: str, workdir: Path) -> Path:
    """The native library as built from git revision `rev`'s csrc/ (today's compiler flags)."""
    from kvserve.kernels import build

    csrc = workdir / "csrc"
    csrc.mkdir()
    listing = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:src/kvserve/kernels/csrc"],
                             capture_output=True, text=True, check=True).stdout.split()
    for name in listing:
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:src/kvserve/kernels/csrc/{name}"],
                                capture_output=True, check=True).stdout
        (csrc / name).write_bytes(source)
    target = workdir / "before.so"
    subprocess.run([build.compiler(), *build.FLAGS, "-o", str(target), str(csrc / "kernels.cpp")], check=True)
    import ctypes

    from kvserve.kernels.native import _SIGNATURES

    missing = [name for name in _SIGNATURES if not hasattr(ctypes.CDLL(str(target)), name)]
    if missing:
        raise SystemExit(f"--before {rev}: its kernels lack {', '.join(missing)}, which today's bindings load; "
                         "pick a revision that exports every kernel of this one (kv_qgemm: from 0685dfc on)")
    return target


def _cell(value: float) -> float | str:
    """A figure for the table: "–" where it was not measured (NaN)."""
    return "–" if value != value else value


def load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def decode_only(rounds: int, before: str | None, new: int, out: str = "kernels") -> None:
    """Single-request decode, every runner once per round, interleaved; medians (to kernels_decode.md, or
    OUT_decode.md for another `--out`)."""
    import tempfile

    workloads = load_workloads()
    prompt = workloads["prefill"]["128"]
    names = ("kvserve native Q4_1", "kvserve native Q4_1 int8")
    with tempfile.TemporaryDirectory() as workdir:
        runners: list = [KvserveRunner(name, VARIANTS[name]) for name in names]
        if before:
            library = build_revision(before, Path(workdir))
            runners += [KvserveRunner(f"{name} (before: {before})", VARIANTS[name], library) for name in names]
        notes = [f"Load average (1 / 5 / 15 min) before: {load_average()}."]
        runners += llama_cpp_python_runner(notes)
        runners += llama_cpp_tools_runner(notes)
        runners += llama_cpp_avx2_runner(notes)
        for runner in runners:
            runner.decode(prompt, 8)  # warm-up
        samples: dict[str, list[float]] = {runner.name: [] for runner in runners}
        for round_index in range(rounds):
            for runner in runners:
                samples[runner.name].append(runner.decode(prompt, new))
            print(f"round {round_index + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in samples.items()), flush=True)
    notes.append(f"Load average after: {load_average()}. {rounds} rounds, {new} new tokens after the 128-token "
                 f"prompt, threads: {torch.get_num_threads()}; every runner once per round, in turn.")
    median = {name: statistics.median(values) for name, values in samples.items()}
    reference = "llama.cpp (batched-bench, server)" if "llama.cpp (batched-bench, server)" in median else None
    header = ["runner", "median tok/s", "ms / token", "min", "max"] + ([f"vs {reference}"] if reference else [])
    rows = [[name, median[name], 1e3 / median[name], min(values), max(values)]
            + ([median[name] / median[reference]] if reference else []) for name, values in samples.items()]
    name = "kernels_decode" if out == "kernels" else f"{out}_decode"  # e.g. kernels_zen4_decode
    title = "Single-request decode beside llama.cpp, paired rounds" + ("" if out == "kernels" else f" ({out})")
    write_result(name, title,
                 markdown_table(header, rows), "\n".join(notes))
    print(markdown_table(header, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 new tokens per decode instead of 128")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-hf-bf16", action="store_true", help="no transformers bf16 (slow without native bf16)")
    parser.add_argument("--prefill-only", action="store_true",
                        help="prefill 512 / 2,048 and the seed's example only, every runner (a quick paired run)")
    parser.add_argument("--rounds", type=int, default=3, help="with --prefill-only: rounds")
    parser.add_argument("--variants", nargs="+", metavar="NAME", help="with --prefill-only: only these kvserve runners")
    parser.add_argument("--skip-hf-fp32", action="store_true", help="with --prefill-only: no transformers fp32")
    parser.add_argument("--decode-only", type=int, metavar="ROUNDS", help="single-request decode only")
    parser.add_argument("--before", metavar="REV", help="with --decode-only: also the kernels of git REV")
    parser.add_argument("--out", default="kernels", metavar="NAME",
                        help="results file benchmarks/results/NAME.md (e.g. kernels_avx2 for another CPU's run)")
    parser.add_argument("--before-src", metavar="SRC",
                        help="with --prefill-only: also kvserve from another checkout's src directory (source_ab.py)")
    args = parser.parse_args()
    if args.decode_only:
        decode_only(args.decode_only, args.before, 32 if args.quick else 128, args.out)
        return
    new = 32 if args.quick else 128
    workloads = load_workloads()
    if args.prefill_only:
        prefill_only(args, workloads)
        return
    runners = [KvserveRunner(name, variant) for name, variant in VARIANTS.items()]
    runners += [] if args.skip_hf else [HFRunner(torch.float32)]
    runners += [] if args.skip_hf or args.skip_hf_bf16 else [HFRunner(torch.bfloat16)]
    notes = []
    runners += llama_cpp_python_runner(notes)
    runners += llama_cpp_tools_runner(notes)
    if "amx_int8" in cpu_flags():
        notes.append("llama.cpp on this CPU (AMX): built without its AMX backend (`llama_cpp_tools.NO_AMX_ARGS`; "
                     "AVX-512 + VNNI + BF16), which segfaulted in `ggml_backend_amx_mul_mat` on this model.")
    results = figures(runners, workloads, new)
    del runners
    startup = {name: VARIANTS[name] for name in ("kvserve native Q4_1", "kvserve torch fp32 (before)")}
    ready = {name: ready_time(variant, 1 if args.quick else 3) for name, variant in startup.items()}
    generate = {name: generate_time(variant) for name, variant in startup.items()}
    if "llama.cpp (llama-cpp-python)" in results:
        ready["llama.cpp (llama-cpp-python)"] = llama_cpp_ready()
    header = ["runner", "decode tok/s", "batch 8 tok/s", "batch 32 tok/s", "prefill 512 tok/s", "prefill 2048 tok/s",
              "shared prefix s", "LLM() ready s", "generate 16 s"]
    rows = [
        [name, *(_cell(f[key]) for key in ("decode", "batch8", "batch32", "prefill512", "prefill2048", "shared")),
         ready.get(name, "–"), generate.get(name, "–")]
        for name, f in results.items()
    ]
    base = results["kvserve native Q4_1"]
    ratio_rows = [
        [f"native Q4_1 / {name}"] + [_cell(base[key] / f[key]) for key in ("decode", "batch8", "batch32",
                                                                           "prefill512", "prefill2048")]
        + [_cell(f["shared"] / base["shared"])]
        for name, f in results.items() if name != "kvserve native Q4_1"
    ]
    breakdowns = {
        "before: torch kernels, fp32": step_breakdown(VARIANTS["kvserve torch fp32 (before)"], workloads),
        "after: native kernels, Q4_1": step_breakdown(VARIANTS["kvserve native Q4_1"], workloads),
        "after: native Q4_1, int8 activations": step_breakdown(VARIANTS["kvserve native Q4_1 int8"], workloads),
    }
    plot(breakdowns, ROOT / "docs" / f"{args.out}_step.png")
    seeds = {name: seed_example(VARIANTS[name], workloads, 1 if args.quick else 3)
             for name in ("kvserve native Q4_1", FAST)}
    parts = list(next(iter(breakdowns.values())))
    step_rows = [[name] + [b[p] for p in parts] + [sum(b.values())] for name, b in breakdowns.items()]
    table = (
        markdown_table(header, rows)
        + "\n\nRatios (higher = kvserve native Q4_1 faster; shared prefix as time ratio):\n\n"
        + markdown_table(["", "decode", "batch 8", "batch 32", "prefill 512", "prefill 2048", "shared prefix"],
                         ratio_rows)
        + f"\n\nPer-step breakdown, ms per batch-8 decode step (![plot](docs/{args.out}_step.png)):\n\n"
        + markdown_table(["", *parts, "total"], step_rows)
        + "\n\nThe seed's example, one-token request wall seconds (target: cached ≤ 1.2 × fresh):\n\n"
        + markdown_table(["", "cold 2,000 tokens", "2,000 with 1,900 cached", "fresh 100 tokens", "cached / fresh"],
                         [[name, s["cold"], s["cached"], s["fresh"], s["cached"] / s["fresh"]]
                          for name, s in seeds.items()])
    )
    notes.append(f"Decode figures: {new} new tokens; threads: {torch.get_num_threads()}. transformers batches with "
                 "padding; llama.cpp's Python API runs batch requests one at a time. Shared prefix: kvserve gets all "
                 f"16 requests at once; the peers run {PEER_SHARED_REQUESTS} of them one at a time, scaled to 16.")
    title = "Native CPU kernels vs transformers and llama.cpp" + ("" if args.out == "kernels" else f" ({args.out})")
    write_result(args.out, title, table, "\n".join(notes))
    print(table)


if __name__ == "__main__":
    main()
