"""Another checkout's kvserve in a child process, driven line by line: a paired before/after across source trees.

`--before REV` (benchmarks/native_kernels.py, decode_step.py) swaps only the native library into this checkout's
Python; a change that moves work between the Python and C layer loops needs the whole "before" tree. A
`SourceRunner` starts this file with ``PYTHONPATH=SRC`` (e.g. ``git archive REV src | tar -x -C /tmp/before``,
then ``/tmp/before/src``), which loads one `LLM` and answers JSON requests on stdin: a prefill's tok/s (as
native_kernels.py's `KvserveRunner.prefill`) or a generate's CPU seconds split into steps that prefill something and
all-decode steps (as decode_batch.py's `generate_split`). The parent interleaves it with its own runners.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


class SourceRunner:
    """kvserve from `src` (a checkout's src directory) in a child process, LLM(**args) with `threads` threads."""

    def __init__(self, name: str, src: str, args: dict[str, str], threads: int) -> None:
        self.name = name
        env = {**os.environ, "PYTHONPATH": str(Path(src).resolve()), "OMP_NUM_THREADS": str(threads)}
        self.child = subprocess.Popen(
            [sys.executable, __file__, json.dumps(args), str(threads)], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )

    def _ask(self, request: dict) -> object:
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(json.dumps(request) + "\n")
        self.child.stdin.flush()
        for line in self.child.stdout:  # anything else the child prints is passed over
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError(f"{self.name}: the child process exited")

    def prefill(self, prompt: list[int]) -> float:
        return float(self._ask({"op": "prefill", "prompt": prompt}))

    def prefill_cpu(self, prompt: list[int]) -> float:
        """Prompt tokens per CPU second of the child (with 1 thread: robust to the machine's other load)."""
        return float(self._ask({"op": "prefill_cpu", "prompt": prompt}))

    def turn(self, history: list[int], new: list[int]) -> float:
        """Seconds to the first token of `history + new` right after `history` (cached by then)."""
        return float(self._ask({"op": "turn", "history": history, "new": new}))

    def generate_split(self, prompts: list[list[int]], new: int) -> dict[str, float]:
        return dict(self._ask({"op": "split", "prompts": prompts, "new": new}))

    def close(self) -> None:
        if self.child.stdin is not None:
            self.child.stdin.close()
        self.child.wait(timeout=60)


def _serve(args: dict[str, str], threads: int) -> None:
    import torch

    from kvserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM("smollm2-135m", progress=False, kv_cache_memory="1GiB", max_num_seqs=64, **args)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import require_native

    require_native(llm, args)
    model = llm.engine.model
    if model.kernels.native is not None:
        model.kernels.native.lib.kv_set_num_threads(threads)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] in ("prefill", "prefill_cpu"):
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            start = time.process_time()
            out = llm.generate([request["prompt"]], params, cache_salt=str(time.perf_counter()))[0]
            spent = out.metrics.ttft if request["op"] == "prefill" else time.process_time() - start
            answer: object = len(request["prompt"]) / spent
        elif request["op"] == "turn":
            answer = turn_ttft(llm, request["history"], request["new"])
        else:
            answer = _split(llm, request["prompts"], request["new"])
        print("RESULT " + json.dumps(answer), flush=True)


def turn_ttft(llm, history: list[int], new: list[int]) -> float:
    """A chat turn's time to first token: `history` once (one token, a fresh cache namespace), then
    `history + new` in the same namespace, so only `new` (and the history's partial last block) is computed."""
    from kvserve import SamplingParams

    params, salt = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), f"turn-{time.perf_counter()}"
    llm.generate([history], params, cache_salt=salt, use_tqdm=False)
    return llm.generate([history + new], params, cache_salt=salt, use_tqdm=False)[0].metrics.ttft


def _split(llm, prompts: list[list[int]], new: int) -> dict[str, float]:
    from kvserve import SamplingParams

    model, kind, spent = llm.engine.model, ["decode"], {"prefill steps": 0.0, "decode steps": 0.0}
    forward, step = model.forward, llm.engine.step

    def tagged(input_ids, positions, kv_pool, meta, *args, **kwargs):
        kind[0] = "prefill steps" if meta.prefills else "decode steps"
        return forward(input_ids, positions, kv_pool, meta, *args, **kwargs)

    def timed_step(*args, **kwargs):
        start = time.process_time()
        try:
            return step(*args, **kwargs)
        finally:
            spent[kind[0]] += time.process_time() - start

    model.forward, llm.engine.step = tagged, timed_step
    try:
        llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True),
                     cache_salt=str(time.perf_counter()))
    finally:
        model.forward = forward
        del llm.engine.step
    return spent


def prefill_cpu_ab(before_src: str, rounds: int) -> None:
    """Prefill 256 / 512 / 2,048 tokens, exact and int8, prompt tokens per CPU second with 1 thread, `before_src`
    against this checkout (alternating, the best of `rounds`): a before/after the machine's load hardly moves."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import ROOT, load_workloads, markdown_table
    from native_kernels import load_average

    workloads = load_workloads()["prefill"]
    prompts = {"256": workloads["512"][:256], "512": workloads["512"], "2048": workloads["2048"]}
    loads, rows = [load_average()], []
    for mode, extra in {"exact": {}, "int8": {"activation_quant": "int8"}}.items():
        args = {"kernels": "native", "weights": "native", **extra}
        runners = {name: SourceRunner(name, src, args, 1)
                   for name, src in {"before": before_src, "now": str(ROOT / "src")}.items()}
        best: dict[str, dict[str, float]] = {name: {} for name in runners}
        for name in runners:
            runners[name].prefill_cpu(prompts["256"][:64])  # warm-up
        for round_index in range(rounds):
            for size, prompt in prompts.items():
                for name in runners if round_index % 2 == 0 else list(runners)[::-1]:
                    value = runners[name].prefill_cpu(prompt)
                    best[name][size] = max(best[name].get(size, 0.0), value)
        for runner in runners.values():
            runner.close()
        loads.append(load_average())
        rows += [[mode, name, *(best[name][size] for size in prompts)] for name in runners]
        rows.append([mode, "now / before", *(best["now"][s] / best["before"][s] for s in prompts)])
        print(markdown_table(["activations", "kvserve", *prompts], rows[-3:]), flush=True)
    header = ["activations", "kvserve", *(f"prefill {size} tok / CPU s" for size in prompts)]
    print(markdown_table(header, rows))
    print(f"`python benchmarks/source_ab.py --prefill-cpu {before_src} --rounds {rounds}`: 1 thread, best of "
          f"{rounds} alternating rounds; load average (1 / 5 / 15 min): {'; '.join(loads)}.")


if __name__ == "__main__":
    if sys.argv[1] == "--prefill-cpu":  # python benchmarks/source_ab.py --prefill-cpu SRC [ROUNDS]
        prefill_cpu_ab(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3)
    else:
        _serve(json.loads(sys.argv[1]), int(sys.argv[2]))


def split_ab(before_src: str, rounds: int) -> None:
    """benchmarks/decode_step.py --split-src: the batch-32 figure's CPU seconds (1 thread) split into prefill
    and decode steps, exact and int8, `before_src` against this checkout, alternating; the best of each."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import ROOT, load_workloads, markdown_table, write_result
    from native_kernels import load_average

    prompts = load_workloads()["batch"]["32"]["prompts"]
    modes = {"exact": {}, "int8": {"activation_quant": "int8"}}
    sources = {"before": before_src, "now": str(ROOT / "src")}
    loads, rows = [load_average()], []
    for mode, extra in modes.items():
        args = {"kernels": "native", "weights": "native", **extra}
        runners = {name: SourceRunner(name, src, args, 1) for name, src in sources.items()}
        best: dict[str, dict[str, float]] = {}
        for round_index in range(rounds):
            for name in sources if round_index % 2 == 0 else list(sources)[::-1]:
                split = runners[name].generate_split(prompts, 32)
                total = sum(split.values())
                if name not in best or total < sum(best[name].values()):
                    best[name] = split
                print(f"{mode} {name}: {split}", flush=True)
        for runner in runners.values():
            runner.close()
        loads.append(load_average())
        for name, split in best.items():
            total = sum(split.values())
            rows.append([mode, name, split["prefill steps"], split["decode steps"], total, 32 * 32 / total,
                         split["prefill steps"] / total])
    header = ["activations", "kvserve", "prefill steps s", "decode steps s", "total s", "tok/s (1 thread)",
              "prefill share"]
    notes = (f"`python benchmarks/decode_step.py --split-src {before_src} --rounds {rounds}`: before = the sources "
             "at that path (whole kvserve, child process), now = this checkout; CPU seconds of one generate of "
             "32 prompts (68-128 tokens) x 32 new tokens, 1 thread, the best of the rounds (alternating). "
             f"Load average (1 / 5 / 15 min): {'; '.join(loads)}.")
    write_result("decode_step_batch_split", "Batch 32: CPU seconds in prefill and decode steps, before / now",
                 markdown_table(header, rows), notes)
    print(markdown_table(header, rows) + "\n" + notes)
