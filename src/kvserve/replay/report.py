"""Replay results as a table (terminal and Markdown) and a plot of hit ratio against cache size."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvserve.replay.driver import ReplayResult

COLUMNS = ("cache_blocks", "fraction", "eviction", "token_hit", "block_hit", "of_belady", "evictions", "seconds")


def rows(results: Sequence[ReplayResult], distinct: int) -> list[dict[str, object]]:
    """One row per result; `of_belady` is the token hit ratio over Belady's at the same size."""
    belady = {r.cache_blocks: r.token_hit_ratio for r in results if r.eviction == "belady"}
    table = []
    for r in results:
        best = belady.get(r.cache_blocks)
        table.append({
            "cache_blocks": r.cache_blocks,
            "fraction": f"{r.cache_blocks / distinct:.0%}" if distinct else "-",
            "eviction": r.eviction,
            "token_hit": f"{r.token_hit_ratio:.3f}",
            "block_hit": f"{r.block_hit_ratio:.3f}",
            "of_belady": f"{r.token_hit_ratio / best:.0%}" if best else "-",
            "evictions": r.evictions,
            "seconds": f"{r.seconds:.1f}",
        })
    return table


def text_table(table: Sequence[dict[str, object]], columns: Sequence[str] = COLUMNS) -> str:
    widths = [max(len(c), *(len(str(row[c])) for row in table)) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(str(row[c]).rjust(w) for c, w in zip(columns, widths, strict=True)) for row in table]
    return "\n".join(lines)


def markdown_table(table: Sequence[dict[str, object]], columns: Sequence[str] = COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in table]
    return "\n".join(lines)


def plot(results: Sequence[ReplayResult], distinct: int, path: str | Path, title: str) -> None:
    """Token hit ratio against cache size (% of distinct blocks), one line per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from error
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for policy in dict.fromkeys(r.eviction for r in results):
        points = sorted((r.cache_blocks, r.token_hit_ratio) for r in results if r.eviction == policy)
        xs = [100 * blocks / distinct for blocks, _ in points]
        style = {"color": "black", "linestyle": "--"} if policy == "belady" else {}
        ax.plot(xs, [hit for _, hit in points], marker="o", label=policy, **style)
    ax.set_xlabel("cache size (% of the trace's distinct blocks)")
    ax.set_ylabel("prefix hit ratio (tokens)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
