"""Which of the soak's client populations grows the server's RSS: one population alone, for minutes.

Starts the server with KVSERVE_HEAP_LOG=1 (server/heap.py logs glibc's heap statistics at each periodic
trim), runs the chosen soak clients (benchmarks/soak_clients.py) back-to-back for --duration seconds, and
prints the RSS series (VmRSS and smaps_rollup's anonymous memory) and the heap lines of the server's log.

    python benchmarks/soak_rss.py --roles bad=4,adversary=1 --duration 300

`filler` clients (this script's own role) fill the host KV tier within a minute or two: prompts of 40,
120 or 600 words, half from four fixed prompts (prefix-cache hits) and half new (misses that evict, so
the cache demotes blocks to the tier), n 1-4, 16-64 sampled tokens -- the mixed prefills under which
glibc's heaps fragmented (benchmarks/results/soak.md). The scratch-arena A/B ran

    python benchmarks/soak_rss.py --roles filler=8 --duration 360 --rss-every 10 --kv-cache-memory 128MiB \
        --server-arg=--host-cache=256MiB

once with this branch's sources on PYTHONPATH and once with the other's, and compares the printed "RSS
less the pool and the tier" (its least-squares slope after --warmup seconds) and the heap lines.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvserve.server.launcher import launch_server  # noqa: E402
from rss_maps import sample as maps_sample  # noqa: E402
from soak_clients import ACTIONS, Tally, run_phase  # noqa: E402

FILLER_WORDS = ("river", "stone", "market", "lantern", "orbit", "velvet", "copper", "meadow", "signal", "harbor",
                "pencil", "thunder", "garden", "mirror", "engine", "candle", "forest", "ticket", "valley", "spiral")
FIXED_PROMPTS = 4


async def filler(http: httpx.AsyncClient, model: str, tally: Tally, rng: random.Random) -> None:
    """One mixed prefill: a fixed prompt (cache hit) or a new one (a miss that evicts), 40/120/600 words."""
    words = rng.choice([40, 120, 600])
    source = random.Random(rng.randrange(FIXED_PROMPTS)) if rng.random() < 0.5 else rng
    prompt = " ".join(source.choice(FILLER_WORDS) for _ in range(words))
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(16, 64), "temperature": 0.8,
            "ignore_eos": True, "n": rng.randint(1, 4)}
    response = await http.post("/v1/completions", json=body)
    tally.count("filler", response.status_code)


ACTIONS.setdefault("filler", filler)


def mib(size: str) -> float:
    """'256MiB' / '1GiB' -> MiB."""
    units = {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}
    for unit, scale in units.items():
        if size.endswith(unit):
            return float(size[: -len(unit)]) * scale
    return float(size) / 2**20


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) in MiB/min (nan with fewer than two points)."""
    finite = [(t, v) for t, v in points if not math.isnan(v)]
    if len(finite) < 2:
        return float("nan")
    n = len(finite)
    mt, mv = sum(t for t, _ in finite) / n, sum(v for _, v in finite) / n
    var = sum((t - mt) ** 2 for t, _ in finite)
    return 60 * sum((t - mt) * (v - mv) for t, v in finite) / var if var else float("nan")


def anonymous_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def print_maps(pid: int, every: float, stop: threading.Event) -> None:
    """Resident MiB by kind of mapping (benchmarks/rss_maps.py) every `every` s until `stop`."""
    began = time.monotonic()
    while not stop.wait(every):
        try:
            kinds = maps_sample(pid)
        except OSError:
            return
        print(f"maps [{time.monotonic() - began:5.0f}s] " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(kinds.items())),
              flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--roles", default="bad=4,adversary=1", help="role=clients,... (soak_clients.ROLES)")
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--rss-every", type=float, default=15.0)
    parser.add_argument("--server-arg", action="append", default=[], help="extra server argument (repeatable)")
    parser.add_argument("--tracemalloc", type=int, default=0, help="frames: log the Python heap's growth per trim")
    parser.add_argument("--think", type=float, default=None, help="mean think time (default: back-to-back)")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="the server's KV pool")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds left out of the slope")
    args = parser.parse_args()
    roles = {name: int(n) for name, n in (part.split("=") for part in args.roles.split(","))}
    log_path = Path(tempfile.mkdtemp(prefix="soak-rss-")) / "server.log"
    env = {"KVSERVE_HEAP_LOG": "1", **({"KVSERVE_TRACEMALLOC": str(args.tracemalloc)} if args.tracemalloc else {})}
    server = launch_server(["--model", args.model, "--kv-cache-memory", args.kv_cache_memory, *args.server_arg],
                           env=env, log_path=log_path)
    pid = server.process.pid
    stop = threading.Event()
    maps = threading.Thread(target=print_maps, args=(pid, args.rss_every, stop), daemon=True)
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        maps.start()
        tally = asyncio.run(run_phase(server.url, model, args.duration, roles, args.think, pid, args.rss_every,
                                      mib(args.kv_cache_memory)))
        print(f"anonymous (smaps_rollup) at the end: {anonymous_mib(pid):.0f} MiB")
    finally:
        stop.set()
        server.terminate()
    print(f"roles {roles}: answers {tally.completed}, statuses {tally.status}")
    print("RSS (MiB): " + ", ".join(f"{t:.0f}s {m:.0f}" for t, m in tally.rss))
    print("KV pool resident (MiB): " + ", ".join(f"{m:.0f}" for m in tally.pool_rss))
    print("host KV tier (MiB of evicted blocks): " + ", ".join(f"{m:.0f}" for m in tally.host_tier))
    rest = [(t, m - pool - tier) for (t, m), pool, tier in zip(tally.rss, tally.pool_rss, tally.host_tier,
                                                                     strict=False)]
    print("RSS less the pool and the tier (MiB): " + ", ".join(f"{t:.0f}s {m:.0f}" for t, m in rest))
    print(f"  slope after {args.warmup:.0f} s: {slope_per_min([p for p in rest if p[0] >= args.warmup]):.2f} MiB/min")
    for line in log_path.read_text().splitlines():
        if "heap (MiB" in line or "python heap:" in line:
            print(line.split("heap", 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
