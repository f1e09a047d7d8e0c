"""Which of the soak's client populations grows the server's RSS: one population alone, for minutes.

Starts the server with KVSERVE_HEAP_LOG=1 (server/heap.py logs glibc's heap statistics at each periodic
trim), runs the chosen soak clients (benchmarks/soak_clients.py) back-to-back for --duration seconds, and
prints the RSS series (VmRSS and smaps_rollup's anonymous memory) and the heap lines of the server's log.

    python benchmarks/soak_rss.py --roles bad=4,adversary=1 --duration 300
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvserve.server.launcher import launch_server  # noqa: E402
from rss_maps import sample as maps_sample  # noqa: E402
from soak_clients import run_phase  # noqa: E402


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
    args = parser.parse_args()
    roles = {name: int(n) for name, n in (part.split("=") for part in args.roles.split(","))}
    log_path = Path(tempfile.mkdtemp(prefix="soak-rss-")) / "server.log"
    env = {"KVSERVE_HEAP_LOG": "1", **({"KVSERVE_TRACEMALLOC": str(args.tracemalloc)} if args.tracemalloc else {})}
    server = launch_server(["--model", args.model, "--kv-cache-memory", "256MiB", *args.server_arg],
                           env=env, log_path=log_path)
    pid = server.process.pid
    stop = threading.Event()
    maps = threading.Thread(target=print_maps, args=(pid, args.rss_every, stop), daemon=True)
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        maps.start()
        tally = asyncio.run(run_phase(server.url, model, args.duration, roles, args.think, pid, args.rss_every, 256))
        print(f"anonymous (smaps_rollup) at the end: {anonymous_mib(pid):.0f} MiB")
    finally:
        stop.set()
        server.terminate()
    print(f"roles {roles}: answers {tally.completed}, statuses {tally.status}")
    print("RSS (MiB): " + ", ".join(f"{t:.0f}s {m:.0f}" for t, m in tally.rss))
    print("KV pool resident (MiB): " + ", ".join(f"{m:.0f}" for m in tally.pool_rss))
    print("host KV tier (MiB of evicted blocks): " + ", ".join(f"{m:.0f}" for m in tally.host_tier))
    for line in log_path.read_text().splitlines():
        if "heap (MiB" in line or "python heap:" in line:
            print(line.split("heap", 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
