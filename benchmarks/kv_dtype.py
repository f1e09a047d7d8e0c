"""The KV cache in bf16 and fp8 (`--kv-cache-dtype bfloat16 | fp8`) against float32, default model, native
Q4_1 weights.

What a narrower pool buys and costs, side by side in one run:
- capacity: blocks (and tokens) the same `--kv-cache-memory` holds;
- quality: perplexity on the fixed text (benchmarks/data/perplexity_python_reference.txt, kvserve's own
  tokenization, chunks of 512 scored on their second half as benchmarks/perplexity.py does) and top-1
  agreement of each narrow cache's next token with the float32 cache's;
- speed: a 2,000-token prefill, and decode after a long prompt (64 tokens greedy after 1,900), where decode
  attention streams the whole context from the pool every step: half the bytes in bf16, a quarter in fp8.

    python benchmarks/kv_dtype.py            # 4 quality chunks, 3 speed rounds (~3 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from perplexity import TEXT, kvserve_logits, scored  # noqa: E402

DTYPES = ("float32", "bfloat16", "fp8")
MEMORY = "256MiB"


def quality(tokens: list[int], ctx: int, chunks: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    pieces = [tokens[i : i + ctx] for i in range(0, len(tokens) - ctx + 1, ctx)][:chunks]
    results = {}
    for dtype in DTYPES:
        print(f"quality: {dtype} KV, {len(pieces)} chunks of {ctx}", flush=True)
        results[dtype] = scored(pieces, kvserve_logits({"weights": "native", "kv_cache_dtype": dtype}))
    return results


def speed(llms: dict[str, LLM], tokens: list[int], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per dtype: prefill tok/s of 2,000 fresh tokens, decode tok/s of 64 tokens after 1,900, alternating."""
    times: dict[str, dict[str, list[float]]] = {d: {"prefill": [], "decode": []} for d in DTYPES}
    one = SamplingParams(max_tokens=1, temperature=0.0)
    decode = SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True)
    for r in range(rounds):
        for dtype in DTYPES if r % 2 == 0 else DTYPES[::-1]:
            llm = llms[dtype]
            start = time.perf_counter()
            llm.generate([tokens[:2000]], one, cache_salt=f"p{r}", use_tqdm=False)
            times[dtype]["prefill"].append(2000 / (time.perf_counter() - start))
            start = time.perf_counter()
            llm.generate([tokens[:1900]], one, cache_salt=f"f{r}", use_tqdm=False)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            out = llm.generate([tokens[:1900]], decode, cache_salt=f"d{r}", use_tqdm=False)[0]
            total = time.perf_counter() - start
            times[dtype]["decode"].append((len(out.token_ids) - 1) / (total - prefill))
            print(f"speed round {r + 1}/{rounds}: {dtype} prefill {times[dtype]['prefill'][-1]:.0f} tok/s, "
                  f"1,900 + 65 tokens {total:.2f} s", flush=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=4, help="quality chunks of --ctx tokens")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llms = {d: LLM("smollm2-135m", progress=False, kv_cache_memory=MEMORY, kv_cache_dtype=d) for d in DTYPES}
    tokens = llms["float32"].engine.tokenizer.encode(TEXT.read_text())
    if len(tokens) < 2000:
        raise SystemExit(f"{TEXT} has {len(tokens)} tokens; the speed rounds need 2,000")
    times = speed(llms, tokens, args.rounds)
    blocks = {d: llms[d].engine.kv_pool.num_blocks for d in DTYPES}
    block_size = llms["float32"].engine.kv_pool.block_size
    del llms
    scores = quality(tokens, args.ctx, args.chunks)
    ppl = {d: math.exp(float(scores[d][0].mean())) for d in DTYPES}
    agree = {d: float((scores["float32"][1] == scores[d][1]).mean()) for d in DTYPES}
    rows = [[f"{d} KV", f"{blocks[d]:,} ({blocks[d] * block_size:,} tokens)", ppl[d],
             f"{agree[d]:.4f}", statistics.median(times[d]["prefill"]),
             statistics.median(times[d]["decode"])] for d in DTYPES]
    header = ["KV cache", f"blocks in {MEMORY}", "perplexity", "top-1 = float32 KV's",
              "prefill 2,000 tok/s", "decode after 1,900 tokens, tok/s"]
    notes = (f"{len(scores['float32'][0]):,} scored tokens ({args.chunks} chunks of {args.ctx}, second halves); "
             f"speed: medians of {args.rounds} alternating rounds, wall clock, a fresh cache salt each (nothing "
             "cached); decode = 64 tokens / (a 65-token request's time - a 1-token request's on the same 1,900 "
             "tokens).")
    path = write_result("kv_dtype", "KV cache dtype: bf16 and fp8 against float32 (native Q4_1 weights)",
                        markdown_table(header, rows), notes)
    print(markdown_table(header, rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
