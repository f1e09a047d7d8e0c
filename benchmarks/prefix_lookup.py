"""Prefix-cache lookup cost: how long `match` takes on a big cache, for radix and hash.

Fills each cache with ~1,000,000 tokens (block size 16), no KV tensors needed:
- one long conversation T of 100,000 tokens, inserted as chunked prefill would (every 512 tokens,
  the whole prefix so far), so the radix path has many nodes;
- branches off T at every 10,000 tokens (T[:b] + 10,000 new tokens), splitting T's path;
- 10,000-token chats that share a 2,000-token system prompt, until the total is reached.
Everything is released afterwards (cached, unreferenced), as after the requests finished.

Then times `match` of prompts T[:L] (fully cached) and T[:L/2] + new tokens (half cached) for L in
10k, 25k, 50k, 100k. The hash cache needs the prompt's block hashes: match is timed with them
precomputed (the engine hashes incrementally as tokens arrive), hashing is reported separately.
A last radix row shows the worst case, one node per block (T inserted block by block, as decode
inserts each block as it fills).

Usage: python benchmarks/prefix_lookup.py [--json PATH] [--repeats N] [--skip-worst-case]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence

from kvserve.kv.block_allocator import BlockAllocator
from kvserve.prefix.hashed import HashCache
from kvserve.prefix.hashing import block_hashes
from kvserve.prefix.radix import RadixCache

BS = 16
VOCAB = 49152
NAMESPACE = ("tenant",)
LONG = 100_000
PROMPT_LENGTHS = (10_000, 25_000, 50_000, 100_000)
CHUNK = 512


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def build_corpus(total_tokens: int, rng: random.Random) -> tuple[list[int], list[list[int]]]:
    """T and the other sequences; their distinct tokens add up to about `total_tokens`."""
    long = random_tokens(rng, LONG)
    others = [long[:b] + random_tokens(rng, 10_000) for b in range(10_000, LONG, 10_000)]
    system = random_tokens(rng, 2_000)
    distinct = LONG + 10_000 * len(others)
    while distinct < total_tokens:
        others.append(system + random_tokens(rng, 8_000))
        distinct += 8_000 + (2_000 if len(others) == 10 else 0)
    return long, others


def insert_sequence(cache: RadixCache | HashCache, tokens: Sequence[int], chunk: int) -> None:
    """Prefill `tokens` in chunks, inserting all full blocks after each chunk, then finish."""
    hashes = block_hashes(tokens, BS, NAMESPACE)
    alloc, blocks = cache.allocator, []
    matched = cache.match(tokens[: (len(tokens) - 1) // BS * BS], hashes, NAMESPACE)
    cache.acquire(matched)
    blocks = list(matched)
    for end in range(len(blocks) * BS + chunk, len(tokens) + chunk, chunk):
        end = min(end, len(tokens))
        blocks += alloc.allocate(-(-end // BS) - len(blocks))
        cache.insert(tokens[:end], hashes, blocks, NAMESPACE)
    cache.release(blocks[::-1])


def fill(cache: RadixCache | HashCache, long: list[int], others: list[list[int]]) -> float:
    start = time.perf_counter()
    insert_sequence(cache, long, CHUNK)
    for tokens in others:
        insert_sequence(cache, tokens, CHUNK)
    return time.perf_counter() - start


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `fn` in milliseconds, after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e6)
    return statistics.median(samples)


def measure(
    name: str, cache: RadixCache | HashCache, prompts: dict[tuple[str, int], list[int]], repeats: int
) -> list[dict[str, object]]:
    rows = []
    for (case, length), tokens in prompts.items():
        hashes = block_hashes(tokens, BS, NAMESPACE)
        matched = len(cache.match(tokens, hashes, NAMESPACE)) * BS
        ms = time_ms(lambda t=tokens, h=hashes: cache.match(t, h, NAMESPACE), repeats)
        rows.append(
            {
                "cache": name,
                "case": case,
                "prompt_tokens": length,
                "matched_tokens": matched,
                "match_ms": round(ms, 3),
            }
        )
    return rows


def hashing_rows(prompts: dict[tuple[str, int], list[int]], repeats: int) -> list[dict[str, object]]:
    rows = []
    for (case, length), tokens in prompts.items():
        if case != "full":
            continue
        for algo in ("sha256", "xxhash"):
            ms = time_ms(lambda t=tokens, a=algo: block_hashes(t, BS, NAMESPACE, a), max(3, repeats // 4))
            rows.append({"algo": algo, "prompt_tokens": length, "hash_ms": round(ms, 3)})
    return rows


def worst_case_radix(long: list[int], repeats: int) -> list[dict[str, object]]:
    cache = RadixCache(BlockAllocator(LONG // BS + 1), BS)
    insert_sequence(cache, long, BS)
    return measure("radix/1-block nodes", cache, {("full", LONG): long}, repeats)


def print_table(rows: list[dict[str, object]], columns: Sequence[str]) -> None:
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row[c]).rjust(w) for c, w in zip(columns, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total-tokens", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-worst-case", action="store_true", help="skip the 1-block-node radix row")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--write", action="store_true", help="write results/prefix_lookup.md and a plot")
    args = parser.parse_args()

    rng = random.Random(0)
    long, others = build_corpus(args.total_tokens, rng)
    prompts = {("full", n): long[:n] for n in PROMPT_LENGTHS}
    prompts |= {("half", n): long[: n // 2] + random_tokens(rng, n - n // 2) for n in PROMPT_LENGTHS}
    num_blocks = args.total_tokens // BS * 2  # ample: nothing is ever evicted
    fill_s: dict[str, float] = {}
    cached_tokens: dict[str, int] = {}
    rows: list[dict[str, object]] = []
    for name, cls in (("radix", RadixCache), ("hash", HashCache)):
        cache = cls(BlockAllocator(num_blocks), BS)
        fill_s[name] = round(fill(cache, long, others), 2)
        cached_tokens[name] = cache.num_cached_blocks * BS
        rows += measure(name, cache, prompts, args.repeats)
    if not args.skip_worst_case:
        rows += worst_case_radix(long, args.repeats)
    hashing = hashing_rows(prompts, args.repeats)

    print(f"cached tokens: {cached_tokens}, fill seconds: {fill_s}")
    print("\nmatch (block hashes precomputed), median ms:")
    print_table(rows, ["cache", "case", "prompt_tokens", "matched_tokens", "match_ms"])
    print("\nhashing a prompt's full blocks (the engine does it incrementally), median ms:")
    print_table(hashing, ["algo", "prompt_tokens", "hash_ms"])
    if args.json:
        results = {
            "block_size": BS,
            "cached_tokens": cached_tokens,
            "fill_s": fill_s,
            "match": rows,
            "hashing": hashing,
        }
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.write:
        write_markdown(rows, hashing, cached_tokens)


def write_markdown(rows: list[dict[str, object]], hashing: list[dict[str, object]], cached: dict) -> None:
    """Section for BENCHMARKS.md plus docs/prefix_lookup.png (match time vs prompt length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common import ROOT, markdown_table, write_result

    table = markdown_table(
        ["cache", "case", "prompt tokens", "matched tokens", "match ms (median)"],
        [[r["cache"], r["case"], r["prompt_tokens"], r["matched_tokens"], r["match_ms"]] for r in rows],
    )
    hash_table = markdown_table(
        ["hash", "prompt tokens", "hashing ms (median)"],
        [[h["algo"], h["prompt_tokens"], h["hash_ms"]] for h in hashing],
    )
    figure, axes = plt.subplots(figsize=(6, 4))
    for name in ("radix", "hash"):
        points = sorted((r["prompt_tokens"], r["match_ms"]) for r in rows if r["cache"] == name and r["case"] == "full")
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{name} (full hit)")
    axes.axhline(5.0, color="grey", linestyle="--", label="5 ms target")
    axes.set_xlabel("prompt tokens")
    axes.set_ylabel("match time (ms)")
    axes.set_title(f"Prefix lookup against a cache of {max(cached.values()):,} tokens")
    axes.legend()
    figure.tight_layout()
    figure.savefig(ROOT / "docs" / "prefix_lookup.png", dpi=110)
    write_result(
        "prefix_lookup", "Prefix lookup cost: radix vs hash, cache of 1,000,000 tokens",
        table + "\n\nHashing the prompt (only the hash cache needs it; the engine hashes incrementally "
        "as blocks fill):\n\n" + hash_table + "\n\n![lookup cost](docs/prefix_lookup.png)",
    )


if __name__ == "__main__":
    main()
