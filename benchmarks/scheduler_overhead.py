"""Cost of ordering the running sequences each step: `order_by_pool_share` (from scratch) vs `PoolShare.order`.

The scheduler reorders its running list every step by each group's share of the pool. A steady decode
batch is simulated without a model: every sequence holds --blocks blocks and crosses a block boundary
once every --block-size steps (so about batch / block_size tables grow per step, each taking a new
`table_version` as the block manager gives it), and in the `groups`
shape the batch is groups of 8 forks that share their first half of blocks. Both functions see the same
states; the table gives microseconds per step (median of --repeats runs of --steps steps each).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from kvserve.engine.pool_share import PoolShare, order_by_pool_share  # noqa: E402


@dataclass(eq=False)
class Metrics:
    arrival_time: float


@dataclass(eq=False)
class Seq:
    request_id: str
    group_id: str
    metrics: Metrics
    held_since_step: int
    block_table: list[int] = field(default_factory=list)
    table_version: int = 0


def batch(num_seqs: int, num_blocks: int, group_size: int) -> list[Seq]:
    """`num_seqs` running sequences in groups of `group_size` (a group's members share half their blocks)."""
    seqs, next_block = [], 0
    for index in range(num_seqs):
        group = index // group_size
        root = index % group_size == 0
        if root:
            shared = list(range(next_block, next_block + num_blocks // 2))
            next_block += num_blocks // 2
        own = list(range(next_block, next_block + num_blocks - len(shared)))
        next_block += len(own)
        request_id = f"g{group}" if root else f"g{group}#{index}"
        seqs.append(Seq(request_id, f"g{group}", Metrics(float(group)), index % 7, shared + own))
    return seqs


def run(order, seqs: list[Seq], steps: int, block_size: int) -> float:
    """Microseconds per step of `order`, with tables growing as a decode batch's do."""
    running = list(seqs)
    next_block = 10**6
    start = time.perf_counter()
    for step in range(1, steps + 1):
        for index in range(step % block_size, len(running), block_size):
            running[index].block_table.append(next_block)
            running[index].table_version = next_block  # as the block manager renumbers an edited table
            next_block += 1
        running = order(running, step + 100)
    return (time.perf_counter() - start) / steps * 1e6


def measure(shape: str, num_seqs: int, num_blocks: int, args) -> list[object]:
    group_size = 8 if shape == "groups" else 1
    times = {"from scratch": [], "incremental": []}
    for _ in range(args.repeats):
        for name in times:
            order = order_by_pool_share if name == "from scratch" else PoolShare().order
            times[name].append(run(order, batch(num_seqs, num_blocks, group_size), args.steps, args.block_size))
    before, after = (statistics.median(times[name]) for name in ("from scratch", "incremental"))
    return [shape, num_seqs, num_blocks, f"{before:.0f}", f"{after:.0f}", f"{before / after:.1f}x"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-write", action="store_true", help="print only; leave results/ untouched")
    args = parser.parse_args()
    rows = [measure(shape, seqs, blocks, args)
            for shape in ("single", "groups") for seqs, blocks in ((16, 32), (64, 128), (256, 128))]
    table = markdown_table(
        ["shape", "running seqs", "blocks each", "from scratch (µs/step)", "incremental (µs/step)", "speed-up"], rows)
    notes = ("Pure Python, no model: the time `Scheduler.schedule` spends ordering its running list each step. "
             "`from scratch` is the order as it was computed before (`order_by_pool_share`, kept as the "
             "reference); `incremental` is `PoolShare.order`, which the scheduler now uses; the two give the "
             "same order (tests/test_pool_share.py). `groups`: groups of 8 forks sharing half their blocks.\n\n"
             "What remains of the incremental cost is mostly the sort and the oldest-first pass, which the "
             "definition needs anyway. **Where it gains little**: groups of forks, since a group is recounted "
             "whenever any member's table changes, and with 8 members that is every other step.")
    print(table)
    if not args.no_write:
        print(f"wrote {write_result('scheduler_overhead', 'Scheduler overhead: ordering by pool share', table, notes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
