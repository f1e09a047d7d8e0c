"""One single-request decode step, taken apart: where its time goes against the weight stream.

Default model (smollm2-135m, Q4_1 + Q8_0 GGUF, `weights="native"`), native kernels, exact (float32) and
int8 activations. A real decode step (a 128-token prompt, then decoding) is captured and replayed: the C
layer loop (every layer), the matmuls alone (the same 120 weight matrices, called directly), the same
matmuls with one layer's weights repeated (cache-resident: what they cost with no memory wait), the lm
head, and the rest of an engine step (scheduler, batch preparation, sampler, outputs, detokenize: a
generate's time per token less the forward and the lm head). Times are CPU time of the process with one
thread (robust to a shared, loaded machine, unlike wall time); the best of the replays. `--before REV`
repeats every row with the native kernels built from git revision REV (benchmarks/native_kernels.py's
`build_revision`), in the same process, interleaved.

    python benchmarks/decode_step.py --before 5733328

`--mixed` times instead one mixed step under load: 16 decode rows (128-token contexts) beside one fresh
prefill of 48 tokens (and, to place the loop's prefill bound, 16-256 tokens), native weights, 2 threads,
wall time; the step in the C layer loop against the Python loop (what such a step ran before), in paired,
interleaved repeats (the median of each; results/decode_step_mixed.md).

    python benchmarks/decode_step.py --mixed

`--rows 8,32,64` times instead a batched decode step of that many rows, taken apart (matmuls, attention,
the rest of the loop, lm head, sampler, engine), exact and int8, with `--before REV` alternating
(benchmarks/decode_batch.py; results/decode_step_batch.md).

    python benchmarks/decode_step.py --rows 8,32,64 --before main

`--split-src SRC` times instead only the batch-32 generate split (prefill steps / decode steps), with another
checkout's whole kvserve (SRC: its src directory) against this one (benchmarks/source_ab.py;
results/decode_step_batch_split.md).

    python benchmarks/decode_step.py --split-src /tmp/before/src --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import best_cpu_ms, markdown_table, write_result  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.engine.model_runner import ModelRunner  # noqa: E402
from kvserve.engine.scheduler import ScheduledRequest  # noqa: E402
from kvserve.kernels.native import NativeLibrary  # noqa: E402
from kvserve.kv.pool import KVPool, KVPoolShape  # noqa: E402
from kvserve.model import layer_loop  # noqa: E402
from native_kernels import build_revision, load_average  # noqa: E402

PROMPT = list(range(100, 228))
MODES = {"exact": {}, "int8": {"activation_quant": "int8"}}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


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
                matrix = layer_loop._matrix(w)  # the layer loop's view: int8 weights are packed (their own qtype code)
                self.calls.append((x, y, (self.native.code, matrix.qtype, x.data_ptr(), 1, w.in_features,
                                          matrix.data, w.out_features, matrix.row_bytes, y.data_ptr(),
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


class _Request:  # the fields ModelRunner reads of a scheduled request
    def __init__(self, ids: list[int], computed: int, table: list[int]) -> None:
        self.all_token_ids, self.num_computed_tokens, self.num_tokens = ids, computed, len(ids)
        self.block_table, self.lora = table, None

    def prompt_positions_to_score(self, start: int, end: int) -> range:
        return range(0)  # no prompt log-probs asked


def mixed_step(model, prefill: int, cached: int = 0, decodes: int = 16, context: int = 128, block_size: int = 16):
    """A ModelRunner and one step: `decodes` rows at `context` tokens (random KV) and a prefill chunk of
    `prefill` tokens after `cached` ones (0: a fresh prompt)."""
    config = model.config
    per_decode, per_prefill = -(-(context + 1) // block_size), -(-(cached + prefill) // block_size)
    num_blocks = decodes * per_decode + per_prefill
    pool = KVPool(KVPoolShape(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim),
                  torch.float32, "cpu")
    pool.tensor.normal_(0, 0.5)
    generator = torch.Generator().manual_seed(prefill)
    step = []
    for row in range(decodes):
        ids = torch.randint(100, 20000, (context + 1,), generator=generator).tolist()
        table = list(range(row * per_decode, (row + 1) * per_decode))
        step.append(ScheduledRequest(_Request(ids, context, table), 1))
    ids = torch.randint(100, 20000, (cached + prefill,), generator=generator).tolist()
    step.append(ScheduledRequest(_Request(ids, cached, list(range(decodes * per_decode, num_blocks))), prefill))
    return ModelRunner(model, pool), step


def _pair_timings(model, loop, runner, step, reps: int) -> dict[str, dict[str, list[float]]]:
    """Wall and CPU ms of the step, C loop and Python loop in turn (alternating which goes first)."""
    times = {name: {"wall": [], "cpu": []} for name in ("python", "loop")}
    for use_loop in (True, False):  # warm-up
        model.layer_loop = loop if use_loop else None
        runner.run(step)
    for rep in range(reps):
        for name in (("python", "loop") if rep % 2 else ("loop", "python")):
            model.layer_loop = loop if name == "loop" else None
            wall, cpu = time.perf_counter(), time.process_time()
            runner.run(step)
            times[name]["wall"].append((time.perf_counter() - wall) * 1e3)
            times[name]["cpu"].append((time.process_time() - cpu) * 1e3)
    model.layer_loop = loop
    return times


def run_mixed(reps: int, threads: int, prefills: list[int], cached: int) -> None:
    torch.set_num_threads(threads)
    notes = [f"Load average (1 / 5 / 15 min) before: {load_average()}."]
    llm = LLM("smollm2-135m", progress=False, kv_cache_memory="64MiB", kernels="native", weights="native")
    model = llm.engine.model
    loop = model.layer_loop
    layer_loop.EXACT_MAX_STEP_ROWS = 1 << 30  # measure the loop past its bound too, to place the bound
    calls = []
    original = loop.forward
    loop.forward = lambda *args: calls.append(args[0].shape[0]) or original(*args)
    rows = []
    for prefill in prefills:
        runner, step = mixed_step(model, prefill, cached)
        calls.clear()
        times = _pair_timings(model, loop, runner, step, reps)
        assert calls.count(16 + prefill) == reps + 1, "the loop did not take the mixed step"
        after = f" after {cached} cached" if cached else ""
        row = [f"16 decodes + {prefill}-token prefill{after}", 16 + prefill]
        for clock in ("wall", "cpu"):
            python, native = times["python"][clock], times["loop"][clock]
            pairs = statistics.median(p / n for p, n in zip(python, native, strict=True))
            row += [statistics.median(python), statistics.median(native), pairs]
        rows.append(row)
        print(row, flush=True)
    notes.append(f"Load average after: {load_average()}. ms per step (ModelRunner.run: the forward and the lm "
                 f"head for the 17 sampled rows), {threads} thread(s), median of {reps} paired interleaved "
                 "repeats (speedup: the median of the pairs' ratios); CPU time sums both threads. Decode contexts "
                 "129 tokens, block size 16. The C loop column runs the loop whatever the prefill length; the "
                 "engine gives it such steps up to layer_loop.EXACT_MAX_STEP_ROWS rows.")
    header = ["step", "rows", "Python loop wall", "C loop wall", "wall speedup", "Python loop CPU", "C loop CPU",
              "CPU speedup"]
    write_result(f"decode_step_mixed_{threads}t" + (f"_cached{cached}" if cached else ""),
                 f"A mixed step (16 decodes + a newcomer's prefill): C layer loop vs Python loop, {threads} "
                 "thread(s), ms", markdown_table(header, rows), "\n".join(notes))
    print(markdown_table(header, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", metavar="REV", help="also the native kernels of git revision REV")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mixed", action="store_true", help="time a mixed step, C loop against Python loop")
    parser.add_argument("--threads", type=int, default=2, help="--mixed: torch and native threads")
    parser.add_argument("--prefills", default="16,48,64,96,128,192", help="--mixed: prefill lengths to time")
    parser.add_argument("--cached", type=int, default=0, help="--mixed: tokens cached before the prefill chunk")
    parser.add_argument("--rows", help="batched decode steps of these row counts (e.g. 8,32,64)")
    parser.add_argument("--before-min-rows", type=int, default=10,
                        help="--rows: the row count from which --before's layer loop took the wide GEMM")
    parser.add_argument("--split-src", metavar="SRC",
                        help="batch 32's prefill / decode split, SRC's sources against these (source_ab.py)")
    args = parser.parse_args()
    if args.split_src:
        from source_ab import split_ab

        split_ab(args.split_src, args.rounds)
        return
    if args.rows:
        from decode_batch import run_batch

        with tempfile.TemporaryDirectory() as workdir:
            run_batch([int(n) for n in args.rows.split(",")], args.before, args.before_min_rows, args.reps,
                      args.rounds, Path(workdir))
        return
    if args.mixed:
        run_mixed(args.reps, args.threads, [int(n) for n in args.prefills.split(",")], args.cached)
        return
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
