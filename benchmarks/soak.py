"""Soak test of the HTTP server: 64 clients, some careless and one adversarial, for --duration seconds.

Starts `python -m kvserve.server` on a free loopback port with a small KV pool, then, in phases:
1. solo: the TTFT (and total time) of a short streaming chat request, one at a time;
2. capacity (--capacity s): the 48 well-behaved clients in a closed loop with no think time: the
   server's throughput of short requests when saturated (their TTFT there is queueing, Little's law);
3. control (--control s): the 48 well-behaved clients alone, each thinking an exponential time between
   requests, its mean chosen so they offer --load of the measured capacity;
4. soak (--duration s): all 64 clients with the same think time (benchmarks/soak_clients.py):
   well-behaved short chats (their TTFT is what we judge), disconnectors (hang up mid-stream), aborters
   (cancel after 0.1-2 s), bad clients (malformed bodies: each must be a 4xx) and one adversary
   (n=16, best_of=16, max_tokens=700, temperature 1, ignore_eos, in a loop).
--stress drops the think time (clients back-to-back, as the first version of this soak did).
The server's RSS is sampled every --rss-every s. At the end every client is cancelled; the server must
drain. The report gives engine deaths (health not 200), 5xx answers, leaked blocks, RSS over time (start,
after --warmup s, end, slope after warm-up) and the well-behaved p50 / p99 TTFT against solo.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from kvserve.server.launcher import launch_server  # noqa: E402
from server_load import block_counts, percentile  # noqa: E402
from soak_clients import ROLES, Tally, rss_mib, run_phase, short_request  # noqa: E402

TTFT_TARGET = 3.0  # p99 of well-behaved short requests within this many times their solo TTFT
RSS_FLAT_MIB_PER_MIN = 1.0  # growth after warm-up below this counts as flat


async def solo(url: str, model: str, repeats: int = 10) -> tuple[float, float]:
    """Median TTFT and total time of a short request sent alone."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await short_request(http, model)  # warm-up
        runs = [await short_request(http, model) for _ in range(repeats)]
    return statistics.median(r[1] for r in runs if r[1] is not None), statistics.median(r[2] for r in runs)


def think_mean_for(load: float, capacity: float, clients: int, solo_total: float) -> float:
    """Mean think time so `clients` closed-loop users offer `load` x `capacity` requests/s: each user
    sends one request per (response time + think time), response time about solo at moderate load."""
    return max(0.0, clients / (load * capacity) - solo_total)


def ttft_summary(tally: Tally) -> tuple[float, float]:
    if not tally.ttfts:
        return float("nan"), float("nan")
    return statistics.median(tally.ttfts), percentile(tally.ttfts, 0.99)


def rss_trend(samples: list[tuple[float, float]], warmup: float) -> tuple[float, float, float, float]:
    """(start, after warm-up, end) MiB and the least-squares slope in MiB/min after warm-up."""
    after = [(t, m) for t, m in samples if t >= warmup] or samples[-1:]
    if len(after) >= 2:
        mean_t, mean_m = statistics.fmean(t for t, _ in after), statistics.fmean(m for _, m in after)
        var = sum((t - mean_t) ** 2 for t, _ in after)
        slope = sum((t - mean_t) * (m - mean_m) for t, m in after) / var * 60 if var else 0.0
    else:
        slope = float("nan")
    return samples[0][1], after[0][1], samples[-1][1], slope


def report(phases: dict, solo_ttft: float, think: float | None, counts: dict, args, alive: bool) -> tuple[str, bool]:
    capacity, control, tally = phases["capacity"], phases["control"], phases["soak"]
    sat_p50, sat_p99 = ttft_summary(capacity)
    control_p50, control_p99 = ttft_summary(control)
    p50, p99 = ttft_summary(tally)
    leaked = counts["used"]
    start, warm, end, slope = rss_trend(tally.rss, args.warmup)
    ok = alive and tally.health_failures == 0 and tally.server_errors == 0 and leaked == 0
    mode = "stress: no think time" if think is None else f"exponential think time, mean {think:.2f} s"
    rows = [
        ["soak duration (s)", args.duration],
        ["clients", ", ".join(f"{n} {role}" for role, n in ROLES.items())],
        ["client pacing", mode],
        ["short request TTFT solo (s)", solo_ttft],
        [f"capacity: {ROLES['well_behaved']} closed-loop clients, no think time, {args.capacity:.0f} s: "
         "requests/s, TTFT p50 / p99 (s)", f"{capacity.rate():.1f}, {sat_p50:.2f} / {sat_p99:.2f}"],
        [f"control: {ROLES['well_behaved']} well-behaved clients alone, {args.control:.0f} s: load (of "
         "capacity), TTFT p50 / p99 (s), p99 / solo",
         f"{control.rate() / capacity.rate():.0%}, {control_p50:.2f} / {control_p99:.2f}, "
         f"{control_p99 / solo_ttft:.1f}x"],
        ["soak: requests answered by role", ", ".join(f"{r} {tally.completed.get(r, 0)}" for r in ROLES)],
        ["soak: answers by status", ", ".join(f"{c or 'cancelled'}: {n}" for c, n in sorted(tally.status.items()))],
        ["soak: well-behaved load (of capacity)", f"{tally.rate() / capacity.rate():.0%}"],
        ["soak: short request TTFT p50 / p99 (s)", f"{p50:.2f} / {p99:.2f}"],
        [f"soak: p99 / solo (target ≤ {TTFT_TARGET:g}x)", f"{p99 / solo_ttft:.1f}x"],
        ["engine deaths (health checks not 200)", tally.health_failures],
        ["slowest /health (s)", tally.health_max_s],
        ["5xx answers", tally.server_errors],
        ["client-side errors (timeouts, resets)", len(tally.errors)],
        ["leaked blocks after drain (used)", f"{leaked:.0f} of {counts['total']:.0f}"],
        [f"server RSS (MiB): soak start, after {args.warmup:.0f} s, end", f"{start:.0f}, {warm:.0f}, {end:.0f}"],
        [f"RSS slope after warm-up (MiB/min; flat: < {RSS_FLAT_MIB_PER_MIN:g})", f"{slope:.2f}"],
        *pool_rows(tally, args.warmup),
        ["verdict (alive, no 5xx, no leaked blocks)", "PASS" if ok else "FAIL"],
        ["targets", targets(p99 / solo_ttft, slope, ok, rest_slope(tally, args.warmup))],
    ]
    return markdown_table(["metric", "value"], rows), ok


def pool_rows(tally, warmup: float) -> list[list]:
    """The KV caches' memory (start, end) and the slope of RSS less it. The pool is a lazy mapping
    (kv/pool.py): blocks written for the first time add to the RSS until every block has been used
    once. The host tier (`--host-cache`, 1 GiB by default) fills with the blocks the pool's prefix cache
    evicts, from the first eviction (minutes into the soak) until its budget: ~40 MiB/min in the soak,
    live malloc'd memory, bounded, not a leak."""
    slope = rest_slope(tally, warmup)
    if slope is None:
        return []
    host = tally.host_tier or [0.0]
    return [["KV pool resident (MiB): soak start, end", f"{tally.pool_rss[0]:.0f}, {tally.pool_rss[-1]:.0f}"],
            ["host KV tier (MiB of evicted blocks): soak start, end", f"{host[0]:.0f}, {host[-1]:.0f}"],
            [f"RSS less the KV pool and the host tier: slope after warm-up (MiB/min; flat: < {RSS_FLAT_MIB_PER_MIN:g})",
             f"{slope:.2f}"]]


def rest_slope(tally, warmup: float) -> float | None:
    """Slope (MiB/min, after warm-up) of RSS less the KV pool's resident pages and the host tier's
    blocks; None if they were not sampled (nan: the mapping was not found or /metrics did not answer)."""
    host = tally.host_tier or [0.0] * len(tally.pool_rss)
    if not tally.pool_rss or any(m != m for m in (*tally.pool_rss, *host)):
        return None
    rest = [(t, m - pool - tier) for (t, m), pool, tier in zip(tally.rss, tally.pool_rss, host, strict=False)]
    return rss_trend(rest, warmup)[3]


def targets(ratio: float, slope: float, ok: bool, slope_less_pool: float | None = None) -> str:
    met = {"alive, no 5xx, no leaks": ok, f"p99 ≤ {TTFT_TARGET:g}x solo": ratio <= TTFT_TARGET,
           "RSS flat": abs(slope) < RSS_FLAT_MIB_PER_MIN}
    if slope_less_pool is not None:
        met["RSS less the KV pool and host tier flat"] = abs(slope_less_pool) < RSS_FLAT_MIB_PER_MIN
    return "; ".join(f"{name}: {'met' if good else '**not met**'}" for name, good in met.items())


def mib(size: str) -> float:
    """'256MiB' / '1GiB' -> MiB (the pool's mapping is found by its size)."""
    units = {"GiB": 1024.0, "MiB": 1.0}
    for unit, factor in units.items():
        if size.endswith(unit):
            return float(size[: -len(unit)]) * factor
    raise SystemExit(f"--kv-cache-memory: expected a size in MiB or GiB, got {size!r}")


def write_client_trace(directory: str, phases: dict) -> None:
    """Each phase's well-behaved requests (response id, sent, TTFT) for benchmarks/soak_trace.py."""
    data = {name: list(zip(tally.ids, tally.sent, tally.ttfts, strict=True)) for name, tally in phases.items()}
    with open(os.path.join(directory, "clients.json"), "w", encoding="utf-8") as handle:
        json.dump(data, handle)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of soak")
    parser.add_argument("--capacity", type=float, default=30.0, help="seconds of saturated closed-loop load")
    parser.add_argument("--control", type=float, default=60.0, help="seconds of well-behaved clients alone")
    parser.add_argument("--load", type=float, default=0.5, help="control load as a fraction of capacity")
    parser.add_argument("--think", type=float, default=None,
                        help="mean think time (s) instead of one sized by --load: the same offered load for A/B runs")
    parser.add_argument("--stress", action="store_true", help="no think time: clients back-to-back")
    parser.add_argument("--warmup", type=float, default=120.0, help="RSS slope is fitted after this many s")
    parser.add_argument("--rss-every", type=float, default=30.0, help="seconds between RSS samples")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="small on purpose: the adversary fills it")
    parser.add_argument("--weights", default=None, help="the server's --weights (default: the server's own)")
    parser.add_argument("--max-step-rows", default=None,
                        help="the server's --max-step-rows: N, 0 (off) or auto (default: the server's own)")
    parser.add_argument("--quick", action="store_true",
                        help="a 2-3 minute iteration: capacity 20 s, control 45 s, soak 60 s; implies --no-write")
    parser.add_argument("--trace", default=None, metavar="DIR", help="write the server's step trace and the "
                        "clients' TTFTs there (benchmarks/soak_trace.py reads them)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave results/ untouched")
    parser.add_argument("--out", default="soak", metavar="NAME",
                        help="results/NAME.md (soak_paced: the run at a person's pace, --think 5)")
    parser.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                        help="the server logs the Python heap's growth at each heap trim (server/heap.py)")
    parser.add_argument("--server-log", default=None, metavar="PATH", help="keep the server's log there")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="extra server argument, repeatable (e.g. --server-arg=--host-cache=0)")
    args = parser.parse_args()
    if args.quick:
        args.capacity, args.control, args.duration, args.warmup, args.rss_every = 20.0, 45.0, 60.0, 20.0, 10.0
        args.no_write = True

    gc.freeze()  # the clients' imports out of every full collection: its pauses would count in their TTFTs
    print(f"starting server with {args.model} ...", file=sys.stderr)
    server_args = ["--model", args.model, "--kv-cache-memory", args.kv_cache_memory]
    server_args += ["--weights", args.weights] if args.weights else []
    server_args += ["--max-step-rows", args.max_step_rows] if args.max_step_rows is not None else []
    server_args += args.server_arg
    env = {}
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        env["KVSERVE_STEP_TRACE"] = os.path.join(args.trace, "steps.jsonl")
    if args.tracemalloc:
        env.update(KVSERVE_TRACEMALLOC=str(args.tracemalloc), KVSERVE_HEAP_LOG="1")
    server = launch_server(server_args, env=env, log_path=args.server_log)
    pid, phases = server.process.pid, {}
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        solo_ttft, solo_total = asyncio.run(solo(server.url, model))
        print(f"solo TTFT {solo_ttft:.3f}s (total {solo_total:.3f}s); RSS {rss_mib(pid):.0f} MiB", flush=True)
        well_behaved = {"well_behaved": ROLES["well_behaved"]}
        phases["capacity"] = asyncio.run(run_phase(server.url, model, args.capacity, well_behaved, 0.0, pid))
        block_counts(server.url, timeout=120)
        if not phases["capacity"].completed:
            raise SystemExit("no short request finished in the capacity phase: lengthen --capacity")
        think = None if args.stress else args.think if args.think is not None else think_mean_for(
            args.load, phases["capacity"].rate(), ROLES["well_behaved"], solo_total)
        print(f"capacity {phases['capacity'].rate():.1f} req/s; think time mean {think}", flush=True)
        phases["control"] = asyncio.run(run_phase(server.url, model, args.control, well_behaved, think, pid))
        block_counts(server.url, timeout=120)
        print(f"soaking for {args.duration:.0f}s", flush=True)
        phases["soak"] = asyncio.run(
            run_phase(server.url, model, args.duration, ROLES, think, pid, args.rss_every, mib(args.kv_cache_memory)))
        counts = block_counts(server.url, timeout=120)
        alive = server.process.poll() is None and httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        exit_code = server.terminate()
    if args.trace:
        write_client_trace(args.trace, phases)
    table, ok = report(phases, solo_ttft, think, counts, args, alive)
    tally = phases["soak"]
    samples = ", ".join(f"{t:.0f}s {m:.0f}" for t, m in tally.rss)
    weights = f", weights {args.weights}" if args.weights else ""
    notes = (f"Model `{model}`{weights}, KV pool {args.kv_cache_memory}, loopback only. Well-behaved requests: "
             f"streaming chat, max_tokens 4, temperature 0; TTFT is client-side (request sent → first content event). "
             f"Server exit status after SIGTERM: {exit_code}.\n\nServer RSS during the soak (MiB): {samples}.")
    if tally.errors:
        notes += "\n\nFirst client-side errors:\n" + "\n".join(f"- {e}" for e in tally.errors[:5])
    print(table)
    print(notes)
    if not args.no_write:
        title = "Soak: 64 clients, careless and adversarial" + (f" ({args.out})" if args.out != "soak" else "")
        print(f"wrote {write_result(args.out, title, table, notes)}")
    return 0 if ok and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
