"""BENCHMARKS.md is assembled from benchmarks/results by `python benchmarks/run_all.py --assemble`: a section
edited in BENCHMARKS.md alone would be lost at the next assembly (and its benchmark's next run would not
know about it), so the file must be exactly what the assembly writes."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_benchmarks_md_is_what_run_all_assembles():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run_all
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    sections = [run_all.HERE / "results" / f"{name}.md" for name in run_all.ORDER]
    missing = [path.name for path in sections if not path.exists()]
    assembled = run_all.HEADER + "\n\n".join(p.read_text().strip() for p in sections if p.exists()) + "\n"
    assert assembled == (ROOT / "BENCHMARKS.md").read_text(), (
        "BENCHMARKS.md differs from `python benchmarks/run_all.py --assemble`: edit benchmarks/results/*.md "
        f"(and run_all.py's HEADER / ORDER) instead; results files named in ORDER but absent: {missing}")
    unlisted = {p.stem for p in (ROOT / "benchmarks" / "results").glob("*.md")} - set(run_all.ORDER)
    orphans = sorted(name for name in unlisted if name not in assembled)  # neither assembled nor cited
    assert not orphans, f"results files that BENCHMARKS.md neither includes nor names: {orphans}"
