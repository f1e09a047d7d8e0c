"""Which features, known when a block is first inserted, predict that it will be used again (Mooncake).

    python benchmarks/eviction_features.py

The eviction report (benchmarks/results/eviction.md) says that nothing known at insertion tells the
first-time blocks that come back from the 77% that never do; this prints the evidence. At the trace's own
512-token blocks, for every block a request inserts for the first time: the share used again by a later
request, bucketed by the prompt's structure: whether it extends an earlier prompt (a conversation's next
turn: the trace's previous prompt minus its partial last block is a prefix of it), how far the block is
from the prompt's end, how many blocks of the prompt were new, and how many distinct children the
matched prefix's last block already had (branching: a shared prefix). Then, for every use of a block
(the features `predict`, prefix/predictive.py, learns from): the share used again within 60 s, 300 s and
ever, by uses so far and the last gap between two uses.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_first6000.jsonl"


def reuse_by_feature(records: list[dict]) -> dict[tuple, list[int]]:
    """(feature, bucket) -> [first insertions, of which used again]."""
    uses: dict[int, int] = defaultdict(int)
    for record in records:
        for block in record["hash_ids"]:
            uses[block] += 1
    seen: set[int] = set()
    prompts: set[tuple[int, ...]] = set()
    children: dict[int, set[int]] = defaultdict(set)
    stats: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for record in records:
        ids = record["hash_ids"]
        matched = 0
        while matched < len(ids) and ids[matched] in seen:
            matched += 1
        extends = any(tuple(ids[:k]) in prompts for k in range(2, matched + 1))
        new = [block for block in ids[matched:] if block not in seen]
        branching = len(children[ids[matched - 1]]) if matched else -1
        size = "<5" if len(new) < 5 else "5-19" if len(new) < 20 else "20+"
        for j, block in enumerate(new):
            from_end = min(len(new) - 1 - j, 3) if len(new) - 1 - j < 3 else "3+"
            for key in (("all",), ("extends earlier prompt", extends), ("blocks from prompt end", from_end),
                        ("extends, blocks from end", extends, from_end), ("new blocks in prompt", size),
                        ("children of matched parent", branching if branching < 5 else "5+")):
                bucket = stats[key]
                bucket[0] += 1
                bucket[1] += uses[block] > 1
        seen.update(ids)
        for parent, child in zip(ids, ids[1:], strict=False):
            children[parent].add(child)
        prompts.add(tuple(ids[:-1]))
    return stats


def gap_bucket(gap: float | None) -> str:
    if gap is None:
        return "-"
    return next((f"<{edge}s" for edge in (10, 30, 90, 270, 810) if gap < edge), "810s+")


def reuse_by_history(records: list[dict]) -> dict[tuple, list[int]]:
    """(uses so far, last-gap bucket) -> [uses, next use within 60 s, within 300 s, ever]."""
    times: dict[int, list[float]] = defaultdict(list)
    for record in records:
        usable = (record["input_length"] - 1) // 512 + 1  # the blocks a request can match
        for block in record["hash_ids"][:usable]:
            times[block].append(record["timestamp"] / 1000)
    stats: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for uses in times.values():
        for k, when in enumerate(uses):
            after = uses[k + 1] - when if k + 1 < len(uses) else math.inf
            bucket = stats[(min(k + 1, 4), gap_bucket(when - uses[k - 1] if k else None))]
            for i, hit in enumerate((True, after < 60, after < 300, after < math.inf)):
                bucket[i] += hit
    return stats


def main() -> None:
    records = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    for key, (count, reused) in sorted(reuse_by_feature(records).items(), key=lambda item: str(item[0])):
        print(f"{' = '.join(map(str, key)):45s} {count:7d} blocks  reused {reused / count:.3f}")
    print("\nuses so far (4 = 4+), last gap: next use within 60 s / 300 s / ever")
    order = ["-", "<10s", "<30s", "<90s", "<270s", "<810s", "810s+"]
    history = sorted(reuse_by_history(records).items(), key=lambda item: (item[0][0], order.index(item[0][1])))
    for (uses, gap), (count, soon, later, ever) in history:
        shares = " / ".join(f"{n / count:.3f}" for n in (soon, later, ever))
        print(f"{uses} uses, gap {gap:6s} {count:7d} uses  {shares}")


if __name__ == "__main__":
    main()
