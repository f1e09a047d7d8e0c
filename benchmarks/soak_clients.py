"""The soak's clients (benchmarks/soak.py): well-behaved, careless and adversarial, each a loop with think time.

Every client repeats its action, then thinks: an exponential pause of mean `think_mean` seconds (an open
population of users, so the load is a chosen fraction of capacity and TTFT measures the server, not a
queue of our own making), or, with `think_mean` None (stress), uniform 0-0.2 s as before: closed-loop
clients with no pause saturate the server and their TTFT is queueing by Little's law.
A monitor thread polls /health every second and samples the server's RSS every `rss_every` seconds.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from server_load import percentile

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
    sent: list[float] = field(default_factory=list)  # perf_counter() when each of `ttfts` was sent
    ids: list[str] = field(default_factory=list)  # their response ids (the engine's: id + "-0")
    completed: dict[str, int] = field(default_factory=dict)
    status: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    health_failures: int = 0
    health_max_s: float = 0.0
    rss: list[tuple[float, float]] = field(default_factory=list)  # (seconds since the phase began, MiB)
    pool_rss: list[float] = field(default_factory=list)  # MiB of the KV pool's mapping resident, with `rss`
    host_tier: list[float] = field(default_factory=list)  # MiB held by the host KV tier, with `rss` (nan: unknown)
    elapsed: float = 0.0

    def count(self, role: str, status: int) -> None:
        self.completed[role] = self.completed.get(role, 0) + 1
        self.status[status] = self.status.get(status, 0) + 1

    @property
    def server_errors(self) -> int:
        return sum(n for code, n in self.status.items() if code >= 500)

    def rate(self, role: str = "well_behaved") -> float:
        """Answers per second to `role` over the phase."""
        return self.completed.get(role, 0) / self.elapsed if self.elapsed else float("nan")


async def short_request(http: httpx.AsyncClient, model: str, tally: Tally | None = None
                        ) -> tuple[int, float | None, float]:
    """Status, TTFT (request sent -> first content event) and total time of one short streaming chat;
    with `tally`, the TTFT and send time are recorded there."""
    start = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json={"model": model, **SHORT}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None, time.perf_counter() - start
        ttft, response_id = None, ""
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                ttft = time.perf_counter() - start
                response_id = json.loads(line[6:])["id"]
    if tally is not None and ttft is not None:
        tally.ttfts.append(ttft)
        tally.sent.append(start)
        tally.ids.append(response_id)
    return 200, ttft, time.perf_counter() - start


async def well_behaved(http: httpx.AsyncClient, model: str, tally: Tally, rng: random.Random) -> None:
    status, _, _ = await short_request(http, model, tally)
    tally.count("well_behaved", status)


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


def think_time(rng: random.Random, think_mean: float | None) -> float:
    """Exponential with mean `think_mean` (an open population of users; 0: none), or stress (None):
    uniform 0-0.2 s."""
    if think_mean is None:
        return rng.uniform(0, 0.2)
    return rng.expovariate(1 / think_mean) if think_mean > 0 else 0.0


async def client_loop(role: str, seed: int, url: str, model: str, tally: Tally, think_mean: float | None) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        await asyncio.sleep(think_time(rng, think_mean))  # users arrive spread out, not all at once
        while True:
            try:
                await ACTIONS[role](http, model, tally, rng)
            except (httpx.HTTPError, OSError) as err:
                tally.errors.append(f"{role}: {type(err).__name__}: {err}")
                await asyncio.sleep(1)
            await asyncio.sleep(think_time(rng, think_mean))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def host_tier_mib(http: httpx.Client) -> float:
    """MiB of KV blocks the server's host tier holds (`kvserve_kv_tier_bytes{tier="host"}`; 0 when the
    tier is off, nan when /metrics does not answer): demoted blocks fill it up to `--host-cache`."""
    try:
        text = http.get("/metrics").text
    except httpx.HTTPError:
        return float("nan")
    for line in text.splitlines():
        if line.startswith("kvserve_kv_tier_bytes{") and 'tier="host"' in line:
            return float(line.rsplit(" ", 1)[1]) / 2**20
    return 0.0


def pool_rss_mib(pid: int, pool_mib: float) -> float:
    """Resident MiB of the KV pool: the server's anonymous mapping of about `pool_mib` (kv/pool.py maps a
    large pool lazily, so its pages join the RSS as blocks are first written; nan if none is found)."""
    best, size_kib = float("nan"), None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:  # a mapping's header line (Python's mmap(-1): shared, /dev/zero)
            size_kib, fields = None, line.split()
            anonymous = len(fields) < 6 or fields[5].startswith(("/dev/zero", "[anon"))
        elif line.startswith("Size:") and anonymous:
            size_kib = int(line.split()[1])
        elif line.startswith("Rss:") and size_kib is not None and abs(size_kib / 1024 - pool_mib) < 0.02 * pool_mib:
            best = int(line.split()[1]) / 1024
    return best


@dataclass(slots=True)
class Monitor:
    """Polls /health every second (own thread and connection, so the clients' event loop does not delay
    it), samples the server's RSS every `rss_every` s, and prints progress every `rss_every` s."""

    url: str
    pid: int
    tally: Tally
    rss_every: float
    pool_mib: float = 0.0  # the server's KV pool size: its resident part is sampled too (0: not)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        started = time.monotonic()
        next_sample = 0.0
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while not self.stop.is_set():
                begin = time.perf_counter()
                try:
                    ok = http.get("/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.tally.health_max_s = max(self.tally.health_max_s, time.perf_counter() - begin)
                self.tally.health_failures += not ok
                elapsed = time.monotonic() - started
                if elapsed >= next_sample:
                    next_sample += self.rss_every
                    self.sample(elapsed, http)
                self.stop.wait(1.0)
            self.sample(time.monotonic() - started, http)

    def sample(self, elapsed: float, http: httpx.Client) -> None:
        tally = self.tally
        tally.rss.append((elapsed, rss_mib(self.pid)))
        if self.pool_mib:
            tally.pool_rss.append(pool_rss_mib(self.pid, self.pool_mib))
            tally.host_tier.append(host_tier_mib(http))
        p99 = percentile(tally.ttfts, 0.99) if tally.ttfts else float("nan")
        pool = f" (KV pool {tally.pool_rss[-1]:.0f}, host tier {tally.host_tier[-1]:.0f})" if tally.pool_rss else ""
        print(f"[{elapsed:5.0f}s] RSS {tally.rss[-1][1]:.0f} MiB{pool}, requests {sum(tally.completed.values())}, "
              f"well-behaved TTFT p99 {p99:.2f}s, 5xx {tally.server_errors}, health failures "
              f"{tally.health_failures}", flush=True)


async def run_phase(
    url: str, model: str, duration: float, roles: dict[str, int], think_mean: float | None, pid: int,
    rss_every: float = 30.0, pool_mib: float = 0.0,
) -> Tally:
    """Run the clients of `roles` for `duration` seconds, then cancel them (in-flight requests hang up)."""
    tally = Tally()
    monitor = Monitor(url, pid, tally, rss_every, pool_mib)
    watcher = threading.Thread(target=monitor.run)
    watcher.start()
    clients = [role for role, count in roles.items() for _ in range(count)]
    started = time.monotonic()
    tasks = [asyncio.create_task(client_loop(role, seed, url, model, tally, think_mean))
             for seed, role in enumerate(clients)]
    try:
        await asyncio.sleep(duration)
    finally:
        tally.elapsed = time.monotonic() - started
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        monitor.stop.set()
        watcher.join()
    return tally
