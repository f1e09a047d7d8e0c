"""`kvserve replay TRACE`: hit ratio of every eviction policy and of Belady over a trace, no model.

    kvserve replay benchmarks/data/mooncake_conversation_first6000.jsonl --cache-fraction 0.05 0.1
    kvserve replay requests.jsonl --kv-cache-memory 8GiB --eviction lru s2lru --plot hits.png
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from kvserve.config import parse_size
from kvserve.prefix.policies import EVICTION_POLICIES
from kvserve.replay.driver import Replay, ReplayConfig, ReplayResult, distinct_blocks
from kvserve.replay.oracles import ORACLE_POLICIES
from kvserve.replay.report import plot, rows, text_table
from kvserve.replay.trace import read_trace

SMOLLM2_FP32_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, fp32


def add_replay_parser(commands: argparse._SubParsersAction,
                      formatter: type[argparse.HelpFormatter] = argparse.ArgumentDefaultsHelpFormatter,
                      ) -> argparse.ArgumentParser:
    replay = commands.add_parser("replay", help="replay a request trace through the prefix caches (no model)",
                                 formatter_class=formatter)
    replay.add_argument("trace", help="Mooncake-format JSONL (or a `serve --request-log` file)")
    size = replay.add_mutually_exclusive_group()
    size.add_argument("--cache-blocks", type=int, nargs="+", help="cache sizes in blocks")
    size.add_argument("--cache-fraction", type=float, nargs="+", help="sizes as fractions of distinct blocks")
    size.add_argument("--kv-cache-memory", nargs="+", help="sizes in bytes, e.g. 8GiB (see --kv-bytes-per-token)")
    replay.add_argument("--kv-bytes-per-token", type=int, default=SMOLLM2_FP32_BYTES_PER_TOKEN,
                        help="KV bytes per token (default: smollm2-135m in fp32)")
    replay.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    replay.add_argument("--eviction", nargs="+", default=["lru"], choices=EVICTION_POLICIES + ORACLE_POLICIES,
                        help="policies to replay (belady is always added unless --no-belady)")
    replay.add_argument("--no-belady", action="store_true", help="skip the offline optimum")
    replay.add_argument("--prefix-cache", default="radix", choices=("radix", "hash"), help="which cache to drive")
    replay.add_argument("--limit", type=int, default=None, help="only the first N requests")
    replay.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0,
                        help="simulated prefill speed (how long a request holds its blocks)")
    replay.add_argument("--decode-ms-per-token", type=float, default=30.0,
                        help="simulated decode step (how long a request holds its blocks)")
    replay.add_argument("--sequential", action="store_true",
                        help="serve requests one at a time in no time (no overlap: nothing held across requests)")
    replay.add_argument("--plot", default=None, help="write hit ratio vs cache size to this PNG")
    replay.add_argument("--json", default=None, help="write the results as JSON")
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")
    for action in replay._actions:  # every flag says what it is (the shared --help check)
        if action.help is None and action.option_strings:
            action.help = action.dest.replace("_", " ")
    return replay


def cache_sizes(args: argparse.Namespace, distinct: int) -> list[int]:
    if args.cache_blocks:
        sizes = args.cache_blocks
    elif args.kv_cache_memory:
        per_block = args.kv_bytes_per_token * args.block_size
        sizes = [parse_size(text) // per_block for text in args.kv_cache_memory]
    else:
        sizes = [round(f * distinct) for f in (args.cache_fraction or [0.02, 0.05, 0.1, 0.2, 0.4])]
    if min(sizes) < 1:
        raise ValueError(f"cache sizes must be at least one block, got {sizes}")
    return sizes


def run_replay(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    requests = read_trace(args.trace, args.limit)
    if not requests:
        raise ValueError(f"{args.trace}: no requests")
    distinct = distinct_blocks(requests, args.block_size)
    policies = list(dict.fromkeys(args.eviction + ([] if args.no_belady else ["belady"])))
    sizes = cache_sizes(args, distinct)
    results: list[ReplayResult] = []
    with tqdm(total=len(sizes) * len(policies) * len(requests), disable=args.no_progress, unit="req") as bar:
        for blocks in sizes:
            for policy in policies:
                bar.set_description(f"{policy} @ {blocks} blocks")
                config = ReplayConfig(
                    blocks, args.block_size, policy, args.prefix_cache,
                    args.prefill_tokens_per_s, args.decode_ms_per_token, overlap=not args.sequential,
                )
                results.append(Replay(requests, config).run(lambda: bar.update(1)))
    print(f"{len(requests)} requests, {distinct} distinct {args.block_size}-token blocks, {args.prefix_cache} cache")
    print(text_table(rows(results, distinct)))
    if args.plot:
        plot(results, distinct, args.plot, f"{args.trace.rsplit('/', 1)[-1]} ({args.block_size}-token blocks)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"distinct_blocks": distinct, "results": [asdict(r) for r in results]}, handle, indent=1)
    return 0
