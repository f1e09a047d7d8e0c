"""A batched decode step (8-64 rows) taken apart: matmuls, attention, the rest of the layer loop, lm head,
sampler and the engine's Python, for native exact and int8 activations; optionally before/after.

Default model (smollm2-135m, Q4_1 + Q8_0 GGUF, `weights="native"`). `rows` requests (the `batch` workload's
prompts, 64-128 tokens) are generated a few tokens, one all-decode step is captured and replayed:

- layer loop (C): the captured forward (csrc/layer.h, every layer);
- matmuls: the same 120 weight matrices at `rows` rows through the entry the loop takes at that row count
  (exact: the per-row kernel below `--min-rows`, else the wide GEMM of csrc/qgemm.h; int8: qmatmul_i8);
- attention: 30 paged-attention calls over the captured block tables (random queries);
- loop rest: layer loop - matmuls - attention (norms, RoPE + KV write, SwiGLU, embedding, checks; parts
  timed apart, so on a loaded machine this difference is noisy and can come out below zero);
- lm head (49152 x 576, Q8_0): the captured step's hidden states through `compute_logits`;
- sampler (`engine.sample`) and engine rest (a generate's time outside the forward, the lm head and the
  sampler: scheduler, batch preparation, outputs): per engine step of a 16-token generate of the same prompts.

Times are CPU ms of the process with 1 thread (robust to a shared machine), the best of the replays; the
engine parts the mean over a 16-token generate. `--before REV` builds the native kernels of git revision
REV (benchmarks/native_kernels.py's `build_revision`) and times every part with both libraries, alternating.

    python benchmarks/decode_step.py --rows 8,32,64 --before main
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from common import best_cpu_ms, load_workloads, markdown_table, write_result
from kvserve import LLM, SamplingParams
from kvserve.engine import engine as engine_module
from kvserve.kernels import ops
from kvserve.kernels.i8pack import PackedI8Weight
from kvserve.kernels.native import NativeLibrary
from native_kernels import build_revision, load_average

MODES = {"exact": {}, "int8": {"activation_quant": "int8"}}
PARTS = ("layer loop (C)", "matmuls", "attention", "loop rest", "lm head", "sampler", "engine rest", "step")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


class BatchProbe:
    """One LLM (one activation mode) and a captured all-decode step of `rows` rows."""

    def __init__(self, mode: str, rows: int) -> None:
        self.llm = LLM("smollm2-135m", progress=False, kv_cache_memory="512MiB", max_num_seqs=64, kernels="native",
                       weights="native", **MODES[mode])
        self.model = self.llm.engine.model
        self.int8, self.rows = mode == "int8", rows
        prompts = load_workloads()["batch"]["32"]["prompts"]
        self.prompts = (prompts * (rows // len(prompts) + 1))[:rows]
        captured: dict = {}
        forward = self.model.forward

        def capture(input_ids, positions, kv_pool, meta, *args, **kwargs):
            if input_ids.shape[0] == rows and not meta.prefills:
                captured["step"] = (input_ids, positions, kv_pool, meta, *args), kwargs
            return forward(input_ids, positions, kv_pool, meta, *args, **kwargs)

        self.model.forward = capture
        self.llm.generate(self.prompts, greedy(24))  # every row decodes at once by then (64 rows: ~10 prefills)
        self.model.forward = forward
        self.step = captured["step"]
        self.hidden = forward(*self.step[0], **self.step[1])
        self.weights = [w for layer in self.model.layers
                        for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
        # One input and one output buffer, as the loop reuses its own.
        self.x = torch.randn(rows, max(w.in_features for w in self.weights))
        self.y = torch.empty(rows, max(w.out_features for w in self.weights))
        config = self.model.config
        self.queries = torch.randn(rows, config.num_heads, config.head_dim)

    def use(self, native: NativeLibrary) -> None:
        self.model.kernels.native = native
        self.model.layer_loop.native = native

    def _matmuls(self, native: NativeLibrary, min_rows: int) -> None:
        entry = (native.lib.kv_qmatmul_i8 if self.int8 else
                 native.lib.kv_qgemm if self.rows >= min_rows else native.lib.kv_qmatmul)
        for w in self.weights:  # int8: the engine's packed layout (kernels/i8pack.py) where it packed them
            code, row_bytes = (w.code, w.group_bytes) if isinstance(w, PackedI8Weight) else (w.qtype, w.row_bytes)
            entry(native.code, code, self.x.data_ptr(), self.rows, w.in_features, w.data.data_ptr(), w.out_features,
                  row_bytes, self.y.data_ptr(), w.out_features)

    def _attention(self, native: NativeLibrary) -> None:
        _, _, kv_pool, meta = self.step[0][:4]
        tables, lens = meta.decode_block_tables.contiguous(), meta.decode_context_lens.contiguous()
        for layer in range(self.model.config.num_layers):
            keys, values = kv_pool.layer(layer)
            native.paged_attention(self.queries, keys, values, tables, lens, self.model.scale)

    def _engine(self, tokens: int) -> dict[str, float]:
        """CPU ms per decode step of a generate: lm head, sampler, and the rest outside forward + head."""
        model, spent = self.model, {"forward": 0.0, "lm head": 0.0, "sampler": 0.0}
        originals = {"forward": model.forward, "lm head": model.compute_logits}
        sample = engine_module.sample

        def timed(name, function):
            def wrapper(*args, **kwargs):
                start = time.process_time()
                try:
                    return function(*args, **kwargs)
                finally:
                    spent[name] += time.process_time() - start
            return wrapper

        model.forward, model.compute_logits = timed("forward", model.forward), timed("lm head", model.compute_logits)
        engine_module.sample = timed("sampler", sample)
        steps = [0]
        step = self.llm.engine.step
        self.llm.engine.step = lambda *a, **k: steps.__setitem__(0, steps[0] + 1) or step(*a, **k)
        try:
            start = time.process_time()
            self.llm.generate(self.prompts, greedy(tokens), cache_salt=str(time.perf_counter()))
            total = time.process_time() - start
        finally:
            model.forward, model.compute_logits = originals["forward"], originals["lm head"]
            engine_module.sample = sample
            del self.llm.engine.step
        rest = total - sum(spent.values())
        return {name: value * 1e3 / steps[0] for name, value in
                (("lm head", spent["lm head"]), ("sampler", spent["sampler"]), ("engine rest", rest))}

    def generate_split(self, native: NativeLibrary, new: int) -> dict[str, float]:
        """CPU seconds of a generate of the probe's prompts x `new` tokens (benchmarks/native_kernels.py's batch figure,
        prefill included), split into engine steps that prefill something and all-decode steps."""
        self.use(native)
        model, kind, spent = self.model, ["decode"], {"prefill steps": 0.0, "decode steps": 0.0}
        forward, step = model.forward, self.llm.engine.step

        def tagged(input_ids, positions, kv_pool, meta, *args, **kwargs):
            kind[0] = "prefill steps" if meta.prefills else "decode steps"
            return forward(input_ids, positions, kv_pool, meta, *args, **kwargs)

        def timed_step(*args, **kwargs):
            start = time.process_time()
            try:
                return step(*args, **kwargs)
            finally:
                spent[kind[0]] += time.process_time() - start

        model.forward, self.llm.engine.step = tagged, timed_step
        try:
            self.llm.generate(self.prompts, greedy(new), cache_salt=str(time.perf_counter()))
        finally:
            model.forward = forward
            del self.llm.engine.step
        return spent

    def parts(self, native: NativeLibrary, min_rows: int, reps: int) -> dict[str, float]:
        self.use(native)
        args, kwargs = self.step
        loop = best_cpu_ms(lambda: self.model.forward(*args, **kwargs), reps)
        matmuls = best_cpu_ms(lambda: self._matmuls(native, min_rows), reps)
        attention = best_cpu_ms(lambda: self._attention(native), reps)
        head = best_cpu_ms(lambda: self.model.compute_logits(self.hidden), reps)
        engine = self._engine(16)
        return {"layer loop (C)": loop, "matmuls": matmuls, "attention": attention, "lm head": head,
                "sampler": engine["sampler"], "engine rest": engine["engine rest"]}


def derived(parts: dict[str, float]) -> dict[str, float]:
    """The best of each measured part, plus loop rest and step computed from those bests."""
    out = dict(parts)
    out["loop rest"] = parts["layer loop (C)"] - parts["matmuls"] - parts["attention"]
    out["step"] = parts["layer loop (C)"] + parts["lm head"] + parts["sampler"] + parts["engine rest"]
    return out


def run_batch(rows_list: list[int], before: str | None, before_min_rows: int, reps: int, rounds: int,
              workdir: Path) -> None:
    torch.set_num_threads(1)
    notes = [f"Load average (1 / 5 / 15 min) before: {load_average()}."]
    before_path = build_revision(before, workdir) if before else None
    table, generate = [], []
    for mode in MODES:
        for rows in rows_list:
            probe = BatchProbe(mode, rows)
            resolved = {"now": (probe.model.kernels.native, ops.QGEMM_MIN_ROWS)}
            if before_path is not None:
                resolved = {f"before ({before})": (NativeLibrary.load(before_path, probe.model.kernels.native.isa),
                                                   before_min_rows), **resolved}
            results: dict[str, dict[str, float]] = {}
            for _ in range(rounds):  # alternating libraries, the best of each part
                for name, (native, min_rows) in resolved.items():
                    parts = probe.parts(native, min_rows, reps)
                    previous = results.get(name, {})
                    results[name] = {k: min(v, previous.get(k, v)) for k, v in parts.items()}
            for name, measured in results.items():
                parts = derived(measured)
                row = [mode, rows, name, *[parts[p] for p in PARTS], rows * 1e3 / parts["step"]]
                table.append(row)
                print(row, flush=True)
            if rows == 32:  # the batch-32 figure of benchmarks/native_kernels.py --quick, prefill included
                for name, (native, _) in resolved.items():
                    split = probe.generate_split(native, 32)
                    total = sum(split.values())
                    generate.append([mode, name, split["prefill steps"], split["decode steps"], total,
                                     32 * 32 / total, split["prefill steps"] / total])
                    print(generate[-1], flush=True)
            del probe
    notes.append(f"Load average after: {load_average()}. CPU ms per decode step, 1 thread, best of {reps} replays x "
                 f"{rounds} rounds (libraries alternating); contexts: the prompts (68-128 tokens) plus up to 24 "
                 "generated. step = layer loop + lm head + sampler + engine rest; tok/s = rows / step (1 thread, "
                 "CPU time: an idle 2-core machine runs the kernels on 2 threads). Before: its layer loop takes "
                 f"the wide GEMM from {before_min_rows} rows, now from {ops.QGEMM_MIN_ROWS}.")
    header = ["activations", "rows", "kernels", *[f"{p} ms" for p in PARTS], "tok/s (1 thread)"]
    generate_header = ["activations", "kernels", "prefill steps s", "decode steps s", "total s", "tok/s (1 thread)",
                       "prefill share"]
    notes.append("\nThe batch-32 figure of `benchmarks/native_kernels.py --quick` (32 prompts of 68-128 tokens, 32 new "
                 "tokens each, prefill included), CPU seconds of one generate, 1 thread, split into engine steps that "
                 "prefill something and all-decode steps:\n\n" + markdown_table(generate_header, generate))
    write_result("decode_step_batch", "A batched decode step, taken apart (CPU ms, 1 thread)",
                 markdown_table(header, table), "\n".join(notes))
    print(markdown_table(header, table))
    print(markdown_table(generate_header, generate))
