"""Prefix caching benchmarks, each side by side in one run (real default model, fp32, 2 threads).

1. The seed's example: a 2,000-token prompt, then one sharing its first 1,900 tokens; TTFT of miss and
   hit against the TTFT of a fresh 100-token prompt.
2. shared_prefix (benchmarks/data): 1,900-token prefix + 16 distinct 100-token suffixes, 32 new tokens
   each: total time and mean TTFT for radix, hash, off (all 16 at once, and one at a time) and
   transformers (one at a time).
3. Multi-turn chat: 8 users x 6 turns, each turn resends the history plus the previous answer:
   hit rate and TTFT p50/p90 per mode.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Timer, hf_generate, load_hf_model, load_workloads, markdown_table, write_result  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402

MODES = ("radix", "hash", "off")


def make_llm(mode: str) -> LLM:
    return LLM("smollm2-135m", progress=False, prefix_cache=mode, kv_cache_memory="2GiB")


def ttft(llm: LLM, prompt: list[int], max_tokens: int = 1) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([prompt], params)[0].metrics.ttft


def seed_example(workloads: dict, progress: tqdm) -> str:
    long = workloads["prefill"]["2048"][:2000]
    sharing = long[:1900] + workloads["prefill"]["512"][:100]
    fresh = workloads["prefill"]["512"][200:300]
    rows = []
    for mode in MODES:
        llm = make_llm(mode)
        ttft(llm, workloads["prefill"]["128"])  # warm-up
        fresh_ttft = ttft(llm, fresh)
        miss = ttft(llm, long)
        hit_out = llm.generate([sharing], SamplingParams(max_tokens=1, temperature=0.0))[0]
        rows.append([mode, miss, hit_out.metrics.ttft, fresh_ttft, hit_out.num_cached_tokens,
                     f"{hit_out.metrics.ttft / fresh_ttft:.2f}x"])
        progress.update(1)
    return markdown_table(
        ["mode", "TTFT 2,000 cold (s)", "TTFT 1,900-shared (s)", "TTFT fresh 100 (s)", "cached tokens",
         "shared / fresh-100"], rows)


def shared_prefix(workloads: dict, with_hf: bool, progress: tqdm) -> str:
    work = workloads["shared_prefix"]
    prompts = [work["prefix"] + suffix for suffix in work["suffixes"]]
    params = SamplingParams(max_tokens=work["new_tokens"], temperature=0.0, ignore_eos=True)
    rows = []
    results = {}
    for mode in MODES:
        for how in ("all at once", "one at a time"):
            llm = make_llm(mode)
            ttft(llm, workloads["prefill"]["128"])
            with Timer() as timer:
                if how == "all at once":
                    outputs = llm.generate(prompts, params)
                else:
                    outputs = [llm.generate([p], params)[0] for p in prompts]
            results[(mode, how)] = [o.token_ids for o in outputs]
            mean_ttft = statistics.mean(o.metrics.ttft for o in outputs)
            rows.append([f"kvserve {mode}", how, timer.seconds, mean_ttft])
            progress.update(1)
    assert all(r == results[("off", "all at once")] for r in results.values()), "caching changed an output"
    if with_hf:
        model = load_hf_model(torch.float32)
        ttfts = []
        with Timer() as timer:
            for prompt in prompts:
                with Timer() as first:
                    hf_generate(model, [prompt], 1)
                ttfts.append(first.seconds)
                hf_generate(model, [prompt], work["new_tokens"])
        # HF has no prefix cache: each request pays its prefill; its total counts only the full runs.
        hf_total = timer.seconds - sum(ttfts)
        rows.append(["transformers", "one at a time", hf_total, statistics.mean(ttfts)])
        progress.update(1)
        for row in rows:
            row.append(f"{hf_total / row[2]:.1f}x")
    header_extra = [] if not with_hf else ["speed-up vs transformers"]
    return markdown_table(["engine", "requests sent", "total (s)", "mean TTFT (s)", *header_extra], rows)


USER_TURNS = [
    "Hi! Can you help me plan a small vegetable garden?",
    "Which vegetables grow well in partial shade?",
    "How often should I water them in summer?",
    "What about pests, any natural remedies?",
    "Can you summarise everything in a short list?",
    "Thanks! One last question: when should I harvest lettuce?",
]


def multi_turn(num_users: int, num_turns: int, progress: tqdm) -> str:
    rows = []
    transcripts = {}
    for mode in MODES:
        llm = make_llm(mode)
        params = SamplingParams(max_tokens=32, temperature=0.0)
        histories = [[{"role": "system", "content": f"You are assistant #{u}, a friendly gardener."}]
                     for u in range(num_users)]
        ttfts, prompt_tokens, cached_tokens = [], 0, 0
        for turn in range(num_turns):
            for history in histories:
                history.append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)]})
            prompts = [llm.render_chat(h) for h in histories]
            outputs = llm.generate(prompts, params)  # the 8 users' turn arrives together
            for history, prompt, out in zip(histories, prompts, outputs, strict=True):
                history.append({"role": "assistant", "content": out.text})
                ttfts.append(out.metrics.ttft)
                if turn > 0:
                    prompt_tokens += len(prompt)
                    cached_tokens += out.num_cached_tokens
            progress.update(1)
        transcripts[mode] = [[m["content"] for m in h] for h in histories]
        quantiles = statistics.quantiles(ttfts, n=10)
        rows.append([mode, f"{cached_tokens / max(prompt_tokens, 1):.1%}", statistics.median(ttfts),
                     quantiles[8], llm.stats()["prefix_cache_hit_rate"]])
    assert transcripts["radix"] == transcripts["hash"] == transcripts["off"], "caching changed a reply"
    return markdown_table(["mode", "hit rate, turns 2-6 (tokens)", "TTFT p50 (s)", "TTFT p90 (s)",
                           "engine hit rate (last 1,000 requests)"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workloads = load_workloads()
    total = len(MODES) + len(MODES) * 2 + (0 if args.skip_hf else 1) + len(MODES) * args.turns
    with tqdm(total=total, desc="prefix cache") as progress:
        sections = [
            ("2,000-token prompt, then one sharing 1,900 tokens", seed_example(workloads, progress)),
            ("shared_prefix: 1,900-token prefix + 16 x 100-token suffixes, 32 new tokens",
             shared_prefix(workloads, not args.skip_hf, progress)),
            (f"Multi-turn chat: {args.users} users x {args.turns} turns",
             multi_turn(args.users, args.turns, progress)),
        ]
    text = "\n\n".join(f"### {title}\n\n{table}" for title, table in sections)
    print(text)
    write_result("prefix_cache", "Prefix caching: radix vs hash vs off (vs transformers)", text,
                 "All figures from one run; outputs are asserted identical across modes.")


if __name__ == "__main__":
    main()
