"""kvserve beside llama.cpp's own batched paths: llama-batched-bench (batch 1 / 8 / 32) and llama-server
(16 parallel slots, continuous batching, prompt cache) on the same Q4_1 GGUF.

Why: benchmarks/native_kernels.py's llama.cpp peer is llama-cpp-python, whose API runs batch requests one at a
time, so the issue's "batch-32 ≥ llama.cpp's batched throughput" and "shared prefix ≥ 10× llama.cpp's
server given all 16 at once" need llama.cpp's real batched code. benchmarks/llama_cpp_tools.py builds the
tools (same llama.cpp version as the bindings) on first use.

Figures (kvserve: native kernels on the GGUF's own Q4_1 weights, the default `LLM()` otherwise):
- batched decode: kvserve gets the workload's batch prompts (64-128 tokens); llama-batched-bench gets
  prompts of their mean length (it takes one length). "generated / wall" = batch × new tokens / (prefill
  + decode time), as native_kernels.py counts; "decode only" = llama.cpp's S_TG, and for kvserve batch ×
  (new - 1) / (wall - the last first-token time).
- shared prefix: 16 requests (1,900-token prefix + 100 distinct tokens each, 32 new tokens), all sent at
  once: kvserve's `LLM.generate` on the list; llama-server with 16 slots gets 16 concurrent /completion
  requests (token ids, greedy, EOS ignored, cache_prompt on). Wall seconds until the last finishes.
- the seed's example: time to first token (wall time of a one-token request) for a 2,000-token prompt
  sharing 1,900 tokens with the previous request, beside a cold 2,000-token one and a fresh 100-token
  one; median of `--repeats`.

    python benchmarks/llama_cpp_peers.py            # builds the tools first if needed (10-20 min once)
    python benchmarks/llama_cpp_peers.py --parts batched seed --prefix-tokens 400   # a reduced run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_tools as tools  # noqa: E402
from common import Timer, load_workloads, markdown_table, write_result  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.registry import resolve_model  # noqa: E402

KVSERVE_NATIVE = {"kernels": "native", "weights": "native"}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _ctx_per_slot(prefix: list[int], suffixes: list[list[int]], new: int) -> int:
    need = len(prefix) + max(len(s) for s in suffixes) + new
    return -(-need // 256) * 256


class LlamaCppToolsRunner:
    """llama.cpp through its own tools; the same methods as benchmarks/native_kernels.py's runners."""

    name = "llama.cpp (batched-bench, server)"
    all_at_once = True  # native_kernels.py sends it all 16 shared-prefix requests at once, as kvserve

    def __init__(self, threads: int | None = None, avx2: bool | None = None) -> None:
        """`avx2`: batched-bench's AVX2 build (llama_cpp_tools.AVX2_ARGS); None: as KVSERVE_ISA says."""
        self.model = resolve_model("smollm2-135m")
        self.threads = threads or torch.get_num_threads()
        self.avx2 = avx2
        if avx2:
            self.name = "llama.cpp AVX2 build (batched-bench, server)"
        self.rows: list[tools.BatchedBench] = []  # every batched-bench row run, for the record

    def _bench(self, prompt: int, new: int, batch: int) -> tools.BatchedBench:
        row = tools.batched_bench(self.model, prompt, new, [batch], self.threads, self.avx2)[0]
        self.rows.append(row)
        return row

    def decode(self, prompt: list[int], new: int) -> float:
        return self._bench(len(prompt), new, 1).decode_tok_s

    def batch(self, prompts: list[list[int]], new: int) -> float:
        mean = round(statistics.mean(len(p) for p in prompts))
        return self._bench(mean, new, len(prompts)).generated_per_wall_s

    def prefill(self, prompt: list[int]) -> float:
        return self._bench(len(prompt), 1, 1).prefill_tok_s

    def shared_prefix(self, prefix: list[int], suffixes: list[list[int]], new: int) -> float:
        prompts = [prefix + s for s in suffixes]
        slot_ctx = _ctx_per_slot(prefix, suffixes, new)
        with tools.server(self.model, len(prompts), slot_ctx, self.threads, avx2=self.avx2) as srv:
            srv.completion(suffixes[0][:8], 2)  # warm-up off the clock
            with Timer() as timer, ThreadPoolExecutor(len(prompts)) as pool:
                replies = list(pool.map(lambda p: srv.completion(p, new), prompts))
        short = [r["tokens_predicted"] for r in replies if r["tokens_predicted"] != new]
        if short:
            raise RuntimeError(f"llama-server generated {short} tokens instead of {new}")
        return timer.seconds

    def cached_ttft(self, prefix: list[int], suffixes: list[list[int]], repeats: int) -> dict[str, float]:
        """Median one-token request times: cold 2,000 tokens, then 1,900 of them cached, then fresh 100."""
        times: dict[str, list[float]] = {"cold": [], "cached": [], "fresh": [], "cached prompt_n": []}
        with tools.server(self.model, 1, _ctx_per_slot(prefix, suffixes, 1), self.threads, avx2=self.avx2) as srv:
            srv.completion(suffixes[-1][:8], 2)
            for i in range(repeats):
                cold, cached, fresh = suffixes[3 * i: 3 * i + 3]
                for key, prompt in (("cold", prefix + cold), ("cached", prefix + cached), ("fresh", fresh)):
                    with Timer() as timer:
                        reply = srv.completion(prompt, 1)
                    times[key].append(timer.seconds)
                    if key == "cached":
                        times["cached prompt_n"].append(reply["timings"]["prompt_n"])
        return {key: statistics.median(values) for key, values in times.items()}


class KvservePeer:
    """kvserve's side of the same figures (native kernels, Q4_1 weights as stored)."""

    name = "kvserve native Q4_1"

    def __init__(self, args: dict[str, str] | None = None) -> None:
        self.llm = LLM("smollm2-135m", progress=False, kv_cache_memory="1GiB", max_num_seqs=64,
                       **(KVSERVE_NATIVE if args is None else args))

    def batch(self, prompts: list[list[int]], new: int) -> tuple[float, float]:
        """(generated / wall, decode only) tok/s."""
        with Timer() as timer:
            outputs = self.llm.generate(prompts, greedy(new), cache_salt=str(time.perf_counter()), use_tqdm=False)
        first = max(out.metrics.ttft for out in outputs)
        return len(prompts) * new / timer.seconds, len(prompts) * (new - 1) / (timer.seconds - first)

    def shared_prefix(self, prefix: list[int], suffixes: list[list[int]], new: int) -> float:
        with Timer() as timer:
            self.llm.generate([prefix + s for s in suffixes], greedy(new), cache_salt=str(time.perf_counter()),
                              use_tqdm=False)
        return timer.seconds

    def _one_token(self, prompt: list[int], salt: str) -> float:
        with Timer() as timer:
            self.llm.generate([prompt], greedy(1), cache_salt=salt, use_tqdm=False)
        return timer.seconds

    def cached_ttft(self, prefix: list[int], suffixes: list[list[int]], repeats: int) -> dict[str, float]:
        times: dict[str, list[float]] = {"cold": [], "cached": [], "fresh": []}
        for i in range(repeats):
            cold, cached, fresh = suffixes[3 * i: 3 * i + 3]
            salt = f"seed-{time.perf_counter()}"  # a fresh namespace: nothing cached before the cold request
            times["cold"].append(self._one_token(prefix + cold, salt))
            times["cached"].append(self._one_token(prefix + cached, salt))
            times["fresh"].append(self._one_token(fresh, f"fresh-{time.perf_counter()}"))
        return {key: statistics.median(values) for key, values in times.items()}


def batched_table(peer: LlamaCppToolsRunner, ours: KvservePeer, workloads: dict, new: int) -> str:
    rows = []
    for size, prompts in (("1", [workloads["prefill"]["128"]]), ("8", workloads["batch"]["8"]["prompts"]),
                          ("32", workloads["batch"]["32"]["prompts"])):
        wall, decode = ours.batch(prompts, new)
        row = peer._bench(round(statistics.mean(len(p) for p in prompts)), new, len(prompts))
        rows.append([size, wall, row.generated_per_wall_s, wall / row.generated_per_wall_s, decode,
                     row.decode_tok_s, decode / row.decode_tok_s])
        print(f"batch {size}: kvserve {wall:.1f} / {decode:.1f}, llama.cpp {row.generated_per_wall_s:.1f} / "
              f"{row.decode_tok_s:.1f} tok/s", flush=True)
    return (f"Batched decode, {new} new tokens per sequence (tok/s; higher is better; ratio = kvserve / "
            "llama.cpp):\n\n" + markdown_table(
                ["batch", "kvserve generated / wall", "llama.cpp generated / wall", "ratio",
                 "kvserve decode only (≈)", "llama.cpp decode only (S_TG)", "ratio"], rows))


def shared_table(peer: LlamaCppToolsRunner, ours: KvservePeer, prefix: list[int], suffixes: list[list[int]],
                 new: int) -> str:
    ours_s = ours.shared_prefix(prefix, suffixes, new)
    print(f"shared prefix: kvserve {ours_s:.1f} s", flush=True)
    peer_s = peer.shared_prefix(prefix, suffixes, new)
    print(f"shared prefix: llama-server {peer_s:.1f} s", flush=True)
    return (f"Shared prefix, {len(suffixes)} requests ({len(prefix):,}-token prefix + {len(suffixes[0])} own "
            f"tokens, {new} new each), all sent at once (seconds; lower is better):\n\n" + markdown_table(
                ["kvserve `LLM.generate`", f"llama-server, {len(suffixes)} slots", "llama.cpp / kvserve"],
                [[ours_s, peer_s, peer_s / ours_s]]))


def seed_table(runners: list, prefix: list[int], suffixes: list[list[int]], repeats: int) -> str:
    seed = {runner.name: runner.cached_ttft(prefix, suffixes, repeats) for runner in runners}
    print(seed, flush=True)
    rows = [[name, t["cold"], t["cached"], t["fresh"], t["cached"] / t["fresh"]] for name, t in seed.items()]
    extra = "".join(f" {name} reprocessed a median of {t['cached prompt_n']:.0f} prompt tokens for the cached "
                    "request." for name, t in seed.items() if "cached prompt_n" in t)
    return (f"The seed's example, one-token request wall time in seconds (median of {repeats}; target: cached "
            f"≤ 1.2 × fresh):\n\n" + markdown_table(
                ["runner", f"cold {len(prefix) + len(suffixes[0]):,} tokens",
                 f"{len(prefix) + len(suffixes[0]):,} with {len(prefix):,} cached", f"fresh {len(suffixes[0])} tokens",
                 "cached / fresh"], rows) + ("\n\n" + extra.strip() if extra else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=32, help="generated tokens per batched sequence")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the seed's TTFT example")
    parser.add_argument("--parts", nargs="+", choices=["batched", "shared", "seed"],
                        default=["batched", "shared", "seed"])
    parser.add_argument("--prefix-tokens", type=int, default=0,
                        help="reduced run: keep only the first N prefix tokens (0: the whole 1,900)")
    args = parser.parse_args()
    workloads = load_workloads()
    shared = workloads["shared_prefix"]
    prefix = shared["prefix"][: args.prefix_tokens or None]
    peer, ours = LlamaCppToolsRunner(), KvservePeer()
    ours.batch(workloads["batch"]["8"]["prompts"][:2], 4)  # warm-up
    tables = []
    if "batched" in args.parts:
        tables.append(batched_table(peer, ours, workloads, args.new))
    if "shared" in args.parts:
        tables.append(shared_table(peer, ours, prefix, shared["suffixes"], shared["new_tokens"]))
    if "seed" in args.parts:
        tables.append(seed_table([ours, peer], prefix, shared["suffixes"], args.repeats))
    notes = (
        f"llama.cpp {tools.bindings_version()} (the llama-cpp-python sdist's vendored source), built by "
        "`benchmarks/llama_cpp_tools.py`: CPU only, -march=native, Release. Threads: "
        f"{torch.get_num_threads()} for both. llama-batched-bench gets one prompt length (the batch's mean); "
        "kvserve the workload's own 64-128-token prompts. llama-server: `--parallel 16 --cont-batching`, "
        f"{_ctx_per_slot(prefix, shared['suffixes'], shared['new_tokens'])} tokens of context per slot, "
        "requests with `cache_prompt` on (its prompt cache cannot help requests that arrive together: each slot "
        f"prefills its own copy of the prefix). Load average when the run ended: {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores: on a busy machine compare the ratios measured side by side, not absolute numbers."
    )
    write_result("llama_cpp_peers", "kvserve beside llama.cpp's own batched tools", "\n\n".join(tables), notes)
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
