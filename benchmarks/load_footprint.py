"""What loading the default model costs a fresh process: `import kvserve`, `LLM()` and the memory it leaves.

Each round starts new interpreters (imports and page faults are what is measured) and reads, after
`LLM(model="smollm2-135m")`, the process's VmRSS and RssAnon (/proc/self/status): anonymous memory is the
process's own; weights that stay views of the GGUF's file mapping count in RSS but not in RssAnon, and are
shared with the page cache and every other process that maps the file. `--before-src SRC` alternates with
another checkout's kvserve (its src directory, e.g. from `git archive REV src | tar -x -C /tmp/before`).

    python benchmarks/load_footprint.py
    python benchmarks/load_footprint.py --before-src /tmp/before/src --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402

PROBE = r"""
import json, time
start = time.perf_counter()
from kvserve import LLM
imported = time.perf_counter()
LLM(model="smollm2-135m", progress=False)
ready = time.perf_counter()
status = open("/proc/self/status").read()
def mib(key):
    return int(status.split(key + ":")[1].split()[0]) / 1024
print(json.dumps({"import s": imported - start, "LLM() s": ready - imported, "RSS MiB": mib("VmRSS"),
                  "anon MiB": mib("RssAnon")}))
"""
FIGURES = ("import s", "LLM() s", "RSS MiB", "anon MiB")


def probe(src: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--before-src", metavar="SRC", help="another checkout's src directory, alternated")
    parser.add_argument("--out", default="load_footprint", metavar="NAME",
                        help="results file benchmarks/results/NAME.md")
    args = parser.parse_args()
    runners = {"this checkout": None} | ({"before": args.before_src} if args.before_src else {})
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for round_ in range(args.rounds):
        for name, src in runners.items():
            samples[name].append(probe(src))
            print(f"round {round_ + 1}/{args.rounds} {name}: {samples[name][-1]}", flush=True)
    rows = [[name, *(statistics.median(s[f] for s in runs) for f in FIGURES)] for name, runs in samples.items()]
    table = markdown_table(["kvserve", *FIGURES], rows)
    path = write_result(args.out, "Loading the default model: time and memory of a fresh process", table,
                        f"Median of {args.rounds} rounds, each runner a new interpreter per round, in turn.")
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
