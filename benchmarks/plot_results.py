"""Plots from the result tables in benchmarks/results (run after the benchmarks; run_all does it)."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs"


def table_rows(markdown: str, first_cell: str) -> list[list[str]]:
    """Rows (as cell lists) of the first markdown table whose header starts with `first_cell`."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_cell}"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def number(cell: str) -> float:
    return float(re.sub(r"[^0-9.]", "", cell))


def plot_throughput() -> Path:
    rows = table_rows((HERE / "results" / "throughput.md").read_text(), "figure")
    names = [row[0] for row in rows]
    ratios = [number(row[3]) for row in rows]
    figure, axes = plt.subplots(figsize=(8, 4.5))
    axes.barh(names, ratios, color=["tab:green" if r >= 1 else "tab:red" for r in ratios])
    axes.axvline(1.0, color="black", linewidth=1)
    axes.axvline(2.0, color="grey", linestyle="--", label="2x target (decode, 64 mixed)")
    axes.set_xlabel("kvserve / transformers (same GGUF, same work, one run)")
    axes.invert_yaxis()
    axes.legend(loc="lower right")
    figure.tight_layout()
    path = DOCS / "throughput.png"
    figure.savefig(path, dpi=110)
    return path


def plot_shared_prefix() -> Path:
    rows = table_rows((HERE / "results" / "prefix_cache.md").read_text(), "engine")
    labels = [f"{row[0]}\n{row[1]}" for row in rows]
    totals = [number(row[2]) for row in rows]
    figure, axes = plt.subplots(figsize=(8, 4.5))
    axes.barh(labels, totals, color=["tab:blue" if "kvserve" in label else "tab:grey" for label in labels])
    axes.set_xlabel("total seconds: 1,900-token shared prefix + 16 x 100-token suffixes, 32 new tokens each")
    axes.invert_yaxis()
    figure.tight_layout()
    path = DOCS / "shared_prefix.png"
    figure.savefig(path, dpi=110)
    return path


def main() -> None:
    for plot in (plot_throughput, plot_shared_prefix):
        try:
            print("wrote", plot())
        except (FileNotFoundError, StopIteration) as error:
            print(f"skipped {plot.__name__}: {error!r}")


if __name__ == "__main__":
    main()
