"""Soak test of the HTTP server: 64 clients, some careless and one adversarial, for --duration seconds.

Starts `python -m kvserve.server` on a free loopback port with a small KV pool, measures the solo TTFT
of a short streaming chat request, then runs for --duration seconds:
- well-behaved clients: short streaming chats one after another (their TTFT is what we judge);
- disconnectors: start a stream, read a few events, hang up;
- aborters: non-streaming requests cancelled client-side after 0.1-2 s;
- bad clients: malformed bodies (extreme numbers, wrong types, huge prompts) -- each must be a 4xx;
- one adversarial client: n=16, best_of=16, max_tokens=700, temperature 1, ignore_eos, in a loop.
A control phase first (--control seconds) runs the well-behaved clients alone, so their TTFT under
the same load without the others is known (on a small CPU most of the gap to solo is plain load).
A monitor thread polls /health every second. At the end every client is cancelled (in-flight
requests hang up). Afterwards the server must drain: the report gives engine
deaths (health not 200), 5xx answers, leaked blocks after drain, the server's RSS at start and end,
and the p50 / p99 TTFT of the well-behaved requests against their solo TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from kvserve.server.launcher import launch_server  # noqa: E402
from server_load import block_counts, percentile  # noqa: E402

ROLES = {"well_behaved": 48, "disconnector": 6, "aborter": 5, "bad": 4, "adversary": 1}  # 64 clients
SHORT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0,
         "stream": True}
ADVERSARY = {"prompt": "Hi", "n": 16, "best_of": 16, "max_tokens": 700, "temperature": 1, "ignore_eos": True}
BAD_BODIES = [
    {"prompt": "Hi", "max_tokens": 4, "use_beam_search": True, "n": 2, "length_penalty": 1100},
    {"prompt": "Hi", "max_tokens": 4, "use_beam_search": True, "n": 2, "length_penalty": -2000},
    {"prompt": "Hi", "temperature": 1e300}, {"prompt": "Hi", "top_p": 0}, {"prompt": "Hi", "top_k": 2**40},
    {"prompt": "Hi", "max_tokens": 2**40}, {"prompt": "Hi", "n": 10**6}, {"prompt": 5},
    {"messages": [{"role": "user", "content": 5}]}, {"prompt": "x" * 3_000_000},
    {"prompt": "Hi", "seed": 2**70}, {"prompt": "Hi", "logprobs": 99}, {"prompt": "Hi", "stop": [1]},
]


@dataclass(slots=True)
class Tally:
    ttfts: list[float] = field(default_factory=list)
    completed: dict[str, int] = field(default_factory=dict)
    status: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    health_failures: int = 0
    health_max_s: float = 0.0

    def count(self, role: str, status: int) -> None:
        self.completed[role] = self.completed.get(role, 0) + 1
        self.status[status] = self.status.get(status, 0) + 1

    @property
    def server_errors(self) -> int:
        return sum(n for code, n in self.status.items() if code >= 500)


async def short_ttft(http: httpx.AsyncClient, model: str) -> tuple[int, float | None]:
    """Status and TTFT (request sent -> first content event) of one short streaming chat."""
    start = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json={"model": model, **SHORT}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None
        ttft = None
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                ttft = time.perf_counter() - start
    return 200, ttft


async def well_behaved(http: httpx.AsyncClient, model: str, tally: Tally, rng: random.Random) -> None:
    status, ttft = await short_ttft(http, model)
    tally.count("well_behaved", status)
    if ttft is not None:
        tally.ttfts.append(ttft)


async def disconnector(http: httpx.AsyncClient, model: str, tally: Tally, rng: random.Random) -> None:
    body = {"model": model, "prompt": "Tell me a long story about a cat", "max_tokens": 200,
            "temperature": 0.8, "ignore_eos": True, "stream": True, "n": rng.choice([1, 2, 4])}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        tally.count("disconnector", response.status_code)
        events = rng.randint(0, 8)
        async for _ in response.aiter_lines():
            events -= 1
            if events < 0:
                break  # leaving the block closes the connection mid-stream


async def aborter(http: httpx.AsyncClient, model: str, tally: Tally, rng: random.Random) -> None:
    body = {"model": model, "prompt": "Write a poem", "max_tokens": 300, "ignore_eos": True,
            "use_beam_search": rng.random() < 0.3, "n": 2, **({"temperature": 0.9} if rng.random() < 0.5 else {})}
    if body["use_beam_search"]:
        body.pop("temperature", None)
    try:
        response = await asyncio.wait_for(http.post("/v1/completions", json=body), rng.uniform(0.1, 2.0))
        tally.count("aborter", response.status_code)
    except TimeoutError:
        tally.count("aborter", 0)  # 0: cancelled by us, as intended


async def bad(http: httpx.AsyncClient, model: str, tally: Tally, rng: random.Random) -> None:
    body = {"model": model, **rng.choice(BAD_BODIES)}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = await http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    tally.count("bad", response.status_code)
    if not 400 <= response.status_code < 500:
        tally.errors.append(f"bad body answered {response.status_code}: {str(body)[:80]}")


async def adversary(http: httpx.AsyncClient, model: str, tally: Tally, rng: random.Random) -> None:
    response = await http.post("/v1/completions", json={"model": model, **ADVERSARY})
    tally.count("adversary", response.status_code)


ACTIONS = {"well_behaved": well_behaved, "disconnector": disconnector, "aborter": aborter, "bad": bad,
           "adversary": adversary}


async def client_loop(role: str, seed: int, url: str, model: str, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        while True:
            try:
                await ACTIONS[role](http, model, tally, rng)
            except (httpx.HTTPError, OSError) as err:
                tally.errors.append(f"{role}: {type(err).__name__}: {err}")
                await asyncio.sleep(1)
            await asyncio.sleep(rng.uniform(0, 0.2))


def monitor(url: str, stop: threading.Event, tally: Tally, started: float) -> None:
    """Poll /health every second (own thread and connection, so the clients' event loop does not
    delay it) and print progress every ten seconds."""
    next_report = 10.0
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                ok = http.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            tally.health_max_s = max(tally.health_max_s, time.perf_counter() - start)
            tally.health_failures += not ok
            elapsed = time.monotonic() - started
            if elapsed >= next_report:
                next_report += 10.0
                p99 = percentile(tally.ttfts, 0.99) if tally.ttfts else float("nan")
                print(f"[{elapsed:5.0f}s] requests {sum(tally.completed.values())}, well-behaved TTFT p99 "
                      f"{p99:.2f}s, 5xx {tally.server_errors}, health failures {tally.health_failures}", flush=True)
            stop.wait(1.0)


async def soak(url: str, model: str, duration: float, roles: dict[str, int]) -> Tally:
    """Run the clients of `roles` for `duration` seconds, then cancel them (in-flight requests hang up)."""
    tally = Tally()
    started = time.monotonic()
    stop = threading.Event()
    watcher = threading.Thread(target=monitor, args=(url, stop, tally, started))
    watcher.start()
    clients = [role for role, count in roles.items() for _ in range(count)]
    tasks = [asyncio.create_task(client_loop(role, seed, url, model, tally)) for seed, role in enumerate(clients)]
    try:
        await asyncio.sleep(duration)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stop.set()
        watcher.join()
    return tally


async def solo_ttft(url: str, model: str, repeats: int = 8) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await short_ttft(http, model)  # warm-up
        ttfts = [(await short_ttft(http, model))[1] for _ in range(repeats)]
    return statistics.median(t for t in ttfts if t is not None)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ttft_summary(tally: Tally) -> tuple[float, float]:
    if not tally.ttfts:
        return float("nan"), float("nan")
    return statistics.median(tally.ttfts), percentile(tally.ttfts, 0.99)


def report(
    tally: Tally, control: Tally, solo: float, counts: dict, rss: tuple[float, float], args, alive: bool
) -> tuple[str, bool]:
    p50, p99 = ttft_summary(tally)
    control_p50, control_p99 = ttft_summary(control)
    leaked = counts["used"]
    ok = alive and tally.health_failures == 0 and tally.server_errors == 0 and leaked == 0
    rows = [
        ["duration (s)", args.duration],
        ["clients", ", ".join(f"{n} {role}" for role, n in ROLES.items())],
        ["requests answered by role", ", ".join(f"{role} {tally.completed.get(role, 0)}" for role in ROLES)],
        ["answers by status", ", ".join(f"{code or 'cancelled'}: {n}" for code, n in sorted(tally.status.items()))],
        ["engine deaths (health checks not 200)", tally.health_failures],
        ["slowest /health (s)", tally.health_max_s],
        ["5xx answers", tally.server_errors],
        ["client-side errors (timeouts, resets)", len(tally.errors)],
        ["leaked blocks after drain (used)", f"{leaked:.0f} of {counts['total']:.0f}"],
        ["server RSS start → end (MiB)", f"{rss[0]:.0f} → {rss[1]:.0f}"],
        ["short request TTFT solo (s)", solo],
        [f"control: {ROLES['well_behaved']} well-behaved clients alone, {args.control:.0f} s: requests, "
         "TTFT p50 / p99 (s)", f"{len(control.ttfts)}, {control_p50:.2f} / {control_p99:.2f}"],
        ["short request TTFT under soak p50 / p99 (s)", f"{p50:.2f} / {p99:.2f}"],
        ["p99 / solo", p99 / solo],
        ["verdict", "PASS (alive, no 5xx, no leaked blocks)" if ok else "FAIL"],
    ]
    return markdown_table(["metric", "value"], rows), ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--control", type=float, default=60.0,
                        help="seconds of well-behaved clients alone first (their TTFT without the others)")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="small on purpose: the adversary fills it")
    parser.add_argument("--no-write", action="store_true", help="print only; leave results/ untouched")
    args = parser.parse_args()

    print(f"starting server with {args.model} ...", file=sys.stderr)
    server = launch_server(["--model", args.model, "--kv-cache-memory", args.kv_cache_memory])
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        solo = asyncio.run(solo_ttft(server.url, model))
        print(f"solo TTFT {solo:.3f}s; control for {args.control:.0f}s", flush=True)
        control = asyncio.run(soak(server.url, model, args.control, {"well_behaved": ROLES["well_behaved"]}))
        block_counts(server.url, timeout=120)
        print(f"soaking for {args.duration:.0f}s", flush=True)
        rss_start = rss_mib(server.process.pid)
        tally = asyncio.run(soak(server.url, model, args.duration, ROLES))
        counts = block_counts(server.url, timeout=120)
        rss_end = rss_mib(server.process.pid)
        alive = server.process.poll() is None and httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        exit_code = server.terminate()
    table, ok = report(tally, control, solo, counts, (rss_start, rss_end), args, alive)
    notes = (f"Model `{model}`, KV pool {args.kv_cache_memory}, loopback only. Well-behaved requests: streaming "
             f"chat, max_tokens 4, temperature 0; TTFT is client-side (request sent → first content event). "
             f"Server exit status after SIGTERM: {exit_code}.")
    if tally.errors:
        notes += "\n\nFirst client-side errors:\n" + "\n".join(f"- {e}" for e in tally.errors[:5])
    print(table)
    print(notes)
    if not args.no_write:
        print(f"wrote {write_result('soak', 'Soak: 64 clients, careless and adversarial', table, notes)}")
    return 0 if ok and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
