"""One single-request decode step, taken apart: where its time goes against the weight stream.

Default model (smollm2-135m, Q4_1 + Q8_0 GGUF, `weights="native"`), native kernels, exact (float32) and
int8 activations. A real decode step (a 128-token prompt, then decoding) is captured and replayed: the C
layer loop (every layer), the matmuls alone (the same 120 weight matrices, called directly), the same
matmuls with one layer's weights repeated (cache-resident: what they cost with no memory wait), the lm
head, and the rest of an engine step (scheduler, batch preparation, sampler, outputs, detokenize: a
generate's time per token less the forward and the lm head). Times are CPU time of the process with one
thread (robust to a shared, loaded machine, unlike wall time); the best of the replays. `--before REV`
repeats every row with the native kernels built from git revision REV (benchmarks/kernels.py's
`build_revision`), in the same process, interleaved.

    python benchmarks/decode_step.py --before 5733328
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from kernels import build_revision, load_average  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.kernels.native import NativeLibrary  # noqa: E402

PROMPT = list(range(100, 228))
MODES = {"exact": {}, "int8": {"activation_quant": "int8"}}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def best_cpu_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e3


class StepProbe:
    """One LLM, a captured decode step, and the parts to time."""

    def __init__(self, mode: str, library: Path | None) -> None:
        self.llm = LLM("smollm2-135m", progress=False, kv_cache_memory="64MiB", kernels="native",
                       weights="native", **MODES[mode])
        model = self.llm.engine.model
        if library is not None:
            native = NativeLibrary.load(library, model.kernels.native.isa)
            model.kernels.native = native
            model.layer_loop.native = native
        self.model, self.native, self.int8 = model, model.kernels.native, mode == "int8"
        captured = {}
        forward = model.forward

        def capture(*args, **kwargs):
            if args[0].shape[0] == 1:
                captured["args"] = (args, kwargs)
            return forward(*args, **kwargs)

        model.forward = capture
        self.llm.generate([PROMPT], greedy(4))
        model.forward = forward
        self.step_args = captured["args"]
        self.hidden = forward(*self.step_args[0], **self.step_args[1])
        self.calls = []
        for layer in model.layers:
            for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                x, y = torch.randn(1, w.in_features), torch.empty(1, w.out_features)
                self.calls.append((x, y, (self.native.code, w.qtype, x.data_ptr(), 1, w.in_features,
                                          w.data.data_ptr(), w.out_features, w.row_bytes, y.data_ptr(),
                                          w.out_features)))

    def _matmuls(self, calls: list) -> None:
        entry = self.native.lib.kv_qmatmul_i8 if self.int8 else self.native.lib.kv_qmatmul
        for _, _, args in calls:
            entry(*args)

    def engine_rest(self, tokens: int) -> float:
        """ms per token of a generate outside the forward and the lm head (CPU time)."""
        model, spent = self.model, [0.0]
        originals = {name: getattr(model, name) for name in ("forward", "compute_logits")}

        def timed(function):
            def wrapper(*args, **kwargs):
                start = time.process_time()
                try:
                    return function(*args, **kwargs)
                finally:
                    spent[0] += time.process_time() - start
            return wrapper

        for name, function in originals.items():
            setattr(model, name, timed(function))
        try:
            start = time.process_time()
            self.llm.generate([PROMPT], greedy(tokens))
            total = time.process_time() - start
        finally:
            for name, function in originals.items():
                setattr(model, name, function)
        return (total - spent[0]) / tokens * 1e3

    def parts(self, reps: int) -> dict[str, float]:
        args, kwargs = self.step_args
        layer_loop = best_cpu_ms(lambda: self.model.forward(*args, **kwargs), reps)
        streamed = best_cpu_ms(lambda: self._matmuls(self.calls), reps)
        resident = best_cpu_ms(lambda: self._matmuls(self.calls[:4] * (len(self.calls) // 4)), reps)
        head = best_cpu_ms(lambda: self.model.compute_logits(self.hidden), reps)
        rest = self.engine_rest(64)
        return {
            "layer loop (C)": layer_loop, "of which matmuls (streamed)": streamed,
            "matmuls, cache-resident weights": resident, "lm head": head, "engine rest (Python)": rest,
            "step = loop + head + rest": layer_loop + head + rest,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", metavar="REV", help="also the native kernels of git revision REV")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    notes = [f"Load average (1 / 5 / 15 min) before: {load_average()}."]
    with tempfile.TemporaryDirectory() as workdir:
        library = build_revision(args.before, Path(workdir)) if args.before else None
        probes = {}
        for mode in MODES:
            if library is not None:
                probes[f"{mode}, before ({args.before})"] = StepProbe(mode, library)
            probes[f"{mode}, now"] = StepProbe(mode, None)
        results: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):  # interleaved rounds; the best of each part
            for name, probe in probes.items():
                parts = probe.parts(args.reps)
                previous = results.get(name, {})
                results[name] = {k: min(v, previous.get(k, v)) for k, v in parts.items()}
                print(name, {k: round(v, 2) for k, v in results[name].items()}, flush=True)
    notes.append(f"Load average after: {load_average()}. CPU ms per step, 1 thread, best of {args.reps} replays x "
                 f"{args.rounds} interleaved rounds; context 129-132 tokens.")
    keys = list(next(iter(results.values())))
    rows = [[name, *[results[name][k] for k in keys], 1e3 / results[name]["step = loop + head + rest"]]
            for name in results]
    table = markdown_table(["configuration", *keys, "tok/s (1 thread)"], rows)
    write_result("decode_step", "One single-request decode step, taken apart (CPU ms, 1 thread)", table,
                 "\n".join(notes))
    print(table)


if __name__ == "__main__":
    main()
