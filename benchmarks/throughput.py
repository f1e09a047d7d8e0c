"""kvserve vs Hugging Face transformers, side by side in one run, on the shared fixed workloads.

Figures (each for fp32 and bf16, 2 threads): prefill tokens/s at 512 and 2,048 tokens; one-request
decode tokens/s (128-token prompt, 128 new); batch-32 decode (generated tokens / wall time of the
whole batch, prefill included, as PEERS.md counts it); 64 requests of mixed lengths offline
(all tokens, prompt + generated, / wall time). Every figure is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Timer, hf_generate, load_hf_model, load_workloads, markdown_table, write_result  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402


def mixed_requests(workloads: dict, count: int = 64, seed: int = 0) -> list[tuple[list[int], int]]:
    """64 prompts cut from the fixed workloads at random lengths (16-1,024), 16-128 new tokens each."""
    rng = random.Random(seed)
    source = workloads["prefill"]["2048"]
    requests = []
    for _ in range(count):
        length = rng.randint(16, 1024)
        start = rng.randint(0, len(source) - length)
        requests.append((source[start : start + length], rng.randint(16, 128)))
    return requests


class KvserveRunner:
    name = "kvserve"

    def __init__(self, dtype: str) -> None:
        self.llm = LLM("smollm2-135m", progress=False, dtype=dtype, prefix_cache="off",
                       max_num_batched_tokens=2048, max_num_seqs=64)

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> float:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
        with Timer() as timer:
            self.llm.generate(prompts, params)
        return timer.seconds

    def decode_rate(self, prompt: list[int], new_tokens: int) -> float:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        out = self.llm.generate([prompt], params)[0]
        decode_time = out.metrics.total_time - out.metrics.ttft
        return (new_tokens - 1) / decode_time


class HFRunner:
    name = "transformers"

    def __init__(self, dtype: str) -> None:
        self.model = load_hf_model(getattr(torch, dtype))

    def generate(self, prompts: list[list[int]], max_tokens: list[int], batch_size: int = 16) -> float:
        with Timer() as timer:
            if len(set(max_tokens)) == 1 and len(prompts) <= 32:
                hf_generate(self.model, prompts, max_tokens[0])
            else:  # static batches, as a plain transformers user would run them
                for start in range(0, len(prompts), batch_size):
                    chunk = slice(start, start + batch_size)
                    hf_generate(self.model, prompts[chunk], max(max_tokens[chunk]))
        return timer.seconds

    def decode_rate(self, prompt: list[int], new_tokens: int) -> float:
        with Timer() as first:
            hf_generate(self.model, [prompt], 1)
        with Timer() as total:
            hf_generate(self.model, [prompt], new_tokens)
        return (new_tokens - 1) / (total.seconds - first.seconds)


def measure(runner, workloads: dict, repeats: int, progress: tqdm) -> dict[str, float]:
    results: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)
        progress.update(1)

    mixed = mixed_requests(workloads)
    runner.generate([workloads["prefill"]["128"]], [2])  # warm-up
    for _ in range(repeats):
        for size in ("512", "2048"):
            prompt = workloads["prefill"][size]
            record(f"prefill {size} tok/s", len(prompt) / runner.generate([prompt], [1]))
        single = workloads["decode_single"]
        record("decode 1 req tok/s", runner.decode_rate(single["prompt"], single["new_tokens"]))
        batch = workloads["batch"]["32"]
        new_tokens = batch["new_tokens"]
        seconds = runner.generate(batch["prompts"], [new_tokens] * len(batch["prompts"]))
        record("decode batch 32 tok/s", len(batch["prompts"]) * new_tokens / seconds)
        total_tokens = sum(len(p) + m for p, m in mixed)
        seconds = runner.generate([p for p, _ in mixed], [m for _, m in mixed])
        record("64 mixed requests tok/s", total_tokens / seconds)
    return {name: statistics.median(values) for name, values in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workloads = load_workloads()
    runners = [KvserveRunner] + ([] if args.skip_hf else [HFRunner])
    rows: dict[str, dict[str, float]] = {}
    with tqdm(total=len(args.dtypes) * len(runners) * args.repeats * 5, desc="throughput") as progress:
        for dtype in args.dtypes:
            for runner_class in runners:
                runner = runner_class(dtype)
                for name, value in measure(runner, workloads, args.repeats, progress).items():
                    rows.setdefault(f"{name} ({dtype})", {})[runner.name] = value
                del runner
    header = ["figure", "kvserve"] + ([] if args.skip_hf else ["transformers", "kvserve / HF"])
    table_rows = []
    for figure, values in rows.items():
        row: list[object] = [figure, values["kvserve"]]
        if not args.skip_hf:
            row += [values["transformers"], f"{values['kvserve'] / values['transformers']:.2f}x"]
        table_rows.append(row)
    table = markdown_table(header, table_rows)
    print(table)
    write_result("throughput", "Throughput: kvserve vs transformers (same GGUF, same work)", table,
                 "Prefill = prompt tokens / time to first token. Batch-32 decode counts generated tokens "
                 "over the whole call (prefill included). transformers runs the 64 mixed requests in static "
                 "left-padded batches of 16; kvserve gets them all at once (continuous batching).")


if __name__ == "__main__":
    main()
