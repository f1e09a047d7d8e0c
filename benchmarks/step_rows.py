"""What the row cap (`--max-step-rows`) costs offline: decode step time and tokens/s against the cap.

The same 32 requests (16-token prompts, --new greedy tokens each, ignore_eos) run offline once per cap;
the engine's decode-only steps are timed (median), so the table is a step's cost against its rows,
t(R) ~ a + b R, and the decode throughput R / t(R) that the cap leaves. On a shared machine the wall
clock measures the other tenants too, so the step's CPU time (the process's, all its threads) is
given beside it: the cost of the step itself. A cap is cheap where
rows cost about the same alone as in a large batch (quantized weights on a CPU: each row streams the
weights through the same GEMV-like kernel), and expensive where a large batch amortizes the weights
(dense float32 GEMMs). Run once per --weights.

    python benchmarks/step_rows.py --weights native --caps 0 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402


def run(model: str, weights: str, cap: int, num_requests: int, new_tokens: int) -> list[float]:
    """Median decode step (wall ms, CPU ms), decode tokens per wall s and per CPU s over decode-only steps,
    and wall tokens/s of the whole batch."""
    llm = LLM(model, progress=False, weights=weights, max_step_rows=cap, kv_cache_memory="256MiB")
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[100 + (7 * i + j) % 5000 for j in range(16)] for i in range(num_requests)]
    engine.add_request(prompts[0], SamplingParams(max_tokens=4))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps: list[tuple[float, float, int]] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        before, cpu_before = time.perf_counter(), time.process_time()
        decoding = [r for r in engine.scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens]
        fresh = bool(engine.scheduler.waiting) or len(decoding) < len(engine.scheduler.running)
        outputs = engine.step()
        if not fresh:
            steps.append((time.perf_counter() - before, time.process_time() - cpu_before, len(outputs)))
    wall = time.perf_counter() - start
    tokens = sum(n for _, _, n in steps)
    return [statistics.median(t for t, _, _ in steps) * 1000, statistics.median(c for _, c, _ in steps) * 1000,
            tokens / sum(t for t, _, _ in steps), tokens / sum(c for _, c, _ in steps),
            num_requests * new_tokens / wall]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", default="native", choices=["native", "dense"])
    parser.add_argument("--caps", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new", type=int, default=24, help="tokens generated per request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for cap in args.caps:
        rows.append([cap or f"off ({args.requests})", *run(args.model, args.weights, cap, args.requests, args.new)])
        print(rows[-1], flush=True)
    with open("/proc/loadavg", encoding="ascii") as handle:
        load = " / ".join(handle.read().split()[:3])
    table = markdown_table(["max_step_rows", "decode step wall ms (median)", "decode step CPU ms (median)",
                            "decode tok / wall s", "decode tok / CPU s", "batch tok/s (wall, prefill included)"], rows)
    notes = (f"{args.requests} requests x {args.new} new tokens, weights {args.weights}, {args.threads} threads; "
             f"load average after: {load}.")
    print(table + "\n\n" + notes)
    if not args.no_write:
        print(write_result(f"step_rows_{args.weights}", f"Row cap offline cost ({args.weights} weights)", table, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
