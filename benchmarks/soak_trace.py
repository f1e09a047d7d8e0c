"""Where a short request's TTFT goes under load: reads `soak.py --trace DIR` and prints a breakdown.

For each well-behaved request of each phase (matched by response id to the server's step trace,
engine/step_trace.py; both sides use CLOCK_MONOTONIC), its client-side TTFT splits into
front (sent -> the engine's arrival: HTTP, chat template, tokenization, the engine inbox),
queue (arrival -> its first scheduled step begins: the step in flight when it arrived plus any it sat out),
own (its first step: forward and sampling) and back (token -> the client sees it: delivery, SSE, client).
Also: the step in flight when it arrived (its duration to the next step's start, its rows and the most
rows one group had in it: the adversary's n=16 samples show up there) and the most rows one group had in
its own step.
The report gives p50 / p90 / p99 of each, and the mean of each over the slowest 1%, with what shared
their first step (decode rows, prefill chunks and tokens) and how many steps ran while they queued.

    python benchmarks/soak_trace.py DIR
"""

from __future__ import annotations

import bisect
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_load import percentile  # noqa: E402

PARTS = ("ttft", "front", "queue", "own", "back", "steps_waited", "decode", "chunks", "prefill", "waiting", "group",
         "preempted", "inflight_s", "inflight_rows", "inflight_group")


def load(directory: Path) -> tuple[dict, list[dict], dict]:
    requests, steps = {}, []
    for line in (directory / "steps.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["k"] == "req":
            requests[record["id"]] = record
        else:
            steps.append(record)
    return requests, steps, json.loads((directory / "clients.json").read_text())


def breakdown(requests: dict, steps: list[dict], clients: list) -> list[dict]:
    times = [step["t"] for step in steps]
    first_step = {rid: step for step in steps for rid in step["new"]}
    rows = []
    for response_id, sent, ttft in clients:
        request = requests.get(f"{response_id}-0")
        step = first_step.get(f"{response_id}-0")
        if request is None or step is None or request["first"] is None:
            continue
        inflight = max(bisect.bisect_right(times, request["arrival"]) - 1, 0)  # the step running at arrival
        after = steps[inflight + 1]["t"] if inflight + 1 < len(steps) else steps[inflight]["t"]
        gap = after - steps[inflight]["t"]
        rows.append({
            "inflight_s": gap if gap < 1.0 else 0.0,  # a longer gap: the engine was idle, no step in flight
            "inflight_rows": steps[inflight]["decode"] + steps[inflight]["chunks"],
            "inflight_group": steps[inflight].get("group", 0), "group": step.get("group", 0),
            "preempted": request.get("preemptions", 0),
            "ttft": ttft, "front": request["arrival"] - sent, "queue": request["scheduled"] - request["arrival"],
            "own": request["first"] - request["scheduled"], "back": sent + ttft - request["first"],
            "steps_waited": bisect.bisect_left(times, step["t"]) - bisect.bisect_right(times, request["arrival"]),
            "decode": step["decode"], "chunks": step["chunks"], "prefill": step["prefill"],
            "waiting": step["waiting"],
        })
    return rows


def report(name: str, rows: list[dict]) -> str:
    if not rows:
        return f"{name}: no matched requests"
    cut = percentile([r["ttft"] for r in rows], 0.99)
    slow = [r for r in rows if r["ttft"] >= cut]
    lines = [f"### {name}: {len(rows)} requests (slowest 1%: {len(slow)}, TTFT >= {cut:.3f} s)", "",
             "| part | p50 | p90 | p99 | mean of slowest 1% |", "|---|---|---|---|---|"]
    for part in PARTS:
        values = [r[part] for r in rows]
        lines.append(f"| {part} | {percentile(values, 0.5):.3f} | {percentile(values, 0.9):.3f} | "
                     f"{percentile(values, 0.99):.3f} | {statistics.fmean(r[part] for r in slow):.3f} |")
    return "\n".join(lines)


def step_report(steps: list[dict]) -> str:
    busy = [(b["t"] - a["t"], a) for a, b in zip(steps, steps[1:], strict=False) if b["t"] - a["t"] < 1.0]
    if not busy:
        return "no steps"

    def spread(values: list[float], unit: str = "", digits: int = 0) -> str:
        return " / ".join(f"{percentile(values, q):.{digits}f}" for q in (0.5, 0.9, 0.99)) + unit

    return (f"steps: {len(steps)}; p50 / p90 / p99: duration {spread([d for d, _ in busy], ' s', 3)}; "
            f"prefill tokens {spread([a['prefill'] for _, a in busy])}; decode rows "
            f"{spread([a['decode'] for _, a in busy])}")


def main() -> int:
    directory = Path(sys.argv[1])
    requests, steps, clients = load(directory)
    print(step_report(steps) + "\n")
    for name, entries in clients.items():
        print(report(name, breakdown(requests, steps, entries)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
