"""Router policies compared over real workers, and the router's own overhead.

Starts --max-workers `python -m kvserve.server` workers (KV events on, 1 torch thread each) and one more
worker with --single-threads threads, then for each workload runs: that one worker alone (direct, no
router: the same cores as the cluster, one cache), and 2 and 4 workers behind the router with each policy
(round_robin, least_load, cache_aware, kv_events). Every run starts from empty caches. Workloads
(token-id prompts, so no tokenizer is involved):

- chat: --users users × --turns turns. Every user's conversation starts with the app's system prompt
  (--system tokens, shared by all users; workload chat-private, or --private-system, gives each user their
  own), and each turn resends the whole conversation: the previous prompt, the assistant's reply (--reply
  tokens, carried into the history, as a client does; the benchmark's own output is --max-tokens) and a new
  question (--user tokens). Users start spread over --ramp seconds and think --think seconds on average
  (exponential) between turns;
- rag:  --queries questions (--user tokens), each after one of --docs shared documents (--doc-len tokens);
  enough questions (96) that the first reads of the documents, which no policy avoids, stay under about
  10% of the requests: with 32, four first reads were 12.5% and the p90 of every policy was a first read.

Default sizes follow the Mooncake conversation trace in benchmarks/data/ (see results/router.md: every
request there starts with the same 512-token block, and a continued conversation adds hundreds of tokens
per turn), scaled down so the default run takes about 20 minutes on an idle 2-core machine.

Offered load is bounded: at most --concurrency requests are in flight at once in either workload, so a
policy that makes the workers do more prefill work shows up as longer TTFTs, not as an ever-growing queue.
That closed loop runs the cluster flat out (16 users thinking 1 s offer several times what 2 workers on 2 cores
serve): every TTFT is then about the requests in flight over the throughput, and a policy's p90 can beat
round_robin's by little more than the prefill work it saves (~1.5x over 2 workers, where round_robin
still hits ~70%). --rate R paces the requests instead, open loop: R a second on average (Poisson, one
seeded schedule for every policy), no bound on requests in flight, TTFT from the send -- the form of
vLLM's `benchmark_serving --request-rate` and production-stack's multi-round QA, where a loaded but not
saturated cluster queues by how much work each policy makes (results/router_paced_zen4.md).

Reported per run: prefix-cache hit rate (cached / prompt tokens, as the workers report them), TTFT p50
and p90 (client side, streaming), and the requests each worker served; then which of the issue's targets
are met. Then the router alone: one routing decision (cache_aware tree lookup + insert; kv_events hashing
+ index lookup) with 100k tokens in each of 4 workers' indexes, p50/p99; and TTFT of the same small
requests direct vs. through the router.

    python benchmarks/router.py                                  # the default (quoted) run, ~20 min idle
    python benchmarks/router.py --workloads chat-private --worker-counts 2 4   # adds the private-system rows
    python benchmarks/router.py --max-workers 2 --worker-counts 2 --workloads rag chat --no-single \
        --policies round_robin cache_aware kv_events --out router_2w        # results/router_2w.md
    python benchmarks/router.py --max-workers 2 --worker-counts 2 --workloads rag --num-blocks 192 \
        --host-cache 0 --queries 256 --policies round_robin cache_aware kv_events --out router_rag_bounded
        # each worker's cache below the working set (3 of the 4 documents), no host tier: where routing pays
    python benchmarks/router.py --max-workers 2 --worker-counts 2 --workloads chat rag --no-single \
        --policies round_robin cache_aware kv_events cache_aware:store_fetch_cost=1 \
        kv_events:store_fetch_cost=1 --host-cache 0 --shared-store --repeat 2 --out router_shared_store
        # the workers on one Redis (their remote tier): store-aware policies against store-blind ones
    python benchmarks/router.py --max-workers 2 --worker-counts 2 --workloads rag --no-single --out x \
        --policies round_robin kv_events kv_events:queue_model=shared:max_share=1 --dump samples.json
    python benchmarks/router.py --max-workers 2 --worker-counts 2 --workloads chat --no-single \
        --policies round_robin cache_aware kv_events --rate 1.0 --out x     # paced: 1 request a second

A policy may carry router settings (`NAME:field=value:...`, any `RouterConfig` field) to compare variants
side by side in one run. `--out NAME` writes only the policy table (and its tails) to results/NAME.md,
leaving results/router.md and router.json alone; `--dump` writes every request's sample as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, command_line, markdown_table, write_result  # noqa: E402
from kvserve.prefix.hashing import block_hashes  # noqa: E402
from kvserve.router.cli import machine_cores  # noqa: E402
from kvserve.router.cluster import Cluster  # noqa: E402
from kvserve.router.config import RouterConfig  # noqa: E402
from kvserve.router.keys import RouteKey  # noqa: E402
from kvserve.router.policies import CacheAwarePolicy, CacheAwareSettings, KvEventsPolicy  # noqa: E402
from kvserve.router.thread import RouterThread  # noqa: E402
from kvserve.router.workers import Worker, WorkerLoad  # noqa: E402
from kvserve.tiers.local_redis import LocalRedis  # noqa: E402

POLICIES = ("round_robin", "least_load", "cache_aware", "kv_events")
TOKEN_RANGE = [1000, 48000]  # benchmarks/data/workloads.json: ids fed directly (--token-range overrides)


@dataclass(slots=True)
class Sample:
    """One request: its TTFT, what the worker had cached, and the router's decision (`x-kvserve-route`)."""

    ttft: float
    prompt: int
    cached: int
    route: dict[str, str]
    sent: float = 0.0  # seconds since the run began

    @property
    def kind(self) -> str:
        """Why it was slow, as far as the client can tell: a cold read (under half the prompt cached); sent
        where more requests were in flight than on another worker; sent beside others where no worker had
        fewer; or alone on its worker."""
        if self.cached < self.prompt / 2:
            return "cold"
        ahead = int(self.route.get("ahead_requests", 0))
        if ahead > int(self.route.get("others_min_requests", ahead)):
            return "busier than another"
        return "beside others, none less busy" if ahead > 0 else "alone"


@dataclass(slots=True)
class RunStats:
    ttfts: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0
    began: float = field(default_factory=time.perf_counter)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)

    def tail(self) -> str:
        """The requests at or above p90: how many of each kind, and the prefill queued ahead of them."""
        cut = percentile(self.ttfts, 0.9)
        slow = [sample for sample in self.samples if sample.ttft >= cut]
        if not slow:
            return ""
        kinds: dict[str, int] = {}
        for sample in slow:
            kinds[sample.kind] = kinds.get(sample.kind, 0) + 1
        ahead = [int(sample.route["ahead_tokens"]) for sample in slow if "ahead_tokens" in sample.route]
        uncached = sum(sample.prompt - sample.cached for sample in slow) / len(slow)
        text = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items(), key=lambda kv: -kv[1]))
        text += f"; mean uncached {uncached:.0f} tokens"
        if ahead:
            text += f", mean prefill queued ahead {sum(ahead) / len(ahead):.0f} tokens"
        return f"{len(slow)} requests ≥ p90: {text}"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                      stats: RunStats) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started, first, prompt, cached, route = time.perf_counter(), None, 0, 0, {}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                stats.errors += 1
                return
            route = parse_route(response.headers.get("x-kvserve-route", ""))
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if first is None and event.get("choices"):
                    first = time.perf_counter() - started
                if event.get("usage"):
                    prompt = event["usage"]["prompt_tokens"]
                    details = event["usage"].get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens") or 0
    except httpx.HTTPError:
        stats.errors += 1
        return
    stats.prompt_tokens += prompt
    stats.cached_tokens += cached
    if first is not None:
        stats.ttfts.append(first)
        stats.samples.append(Sample(first, prompt, cached, route, started - stats.began))


def parse_route(header: str) -> dict[str, str]:
    """The router's `x-kvserve-route` header (`name=value; ...`) as a dict ({} when absent)."""
    pairs = (item.strip().partition("=") for item in header.split(";") if "=" in item)
    return {name: value for name, _, value in pairs}


def random_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(count)]


async def chat_workload(url: str, model: str, args: argparse.Namespace, private: bool = False) -> RunStats:
    stats, rng = RunStats(), random.Random(1)
    shared = random_ids(rng, args.system)
    users = [(list(shared) if not private else random_ids(rng, args.system),
              [random_ids(rng, args.user) for _ in range(args.turns)],
              [random_ids(rng, args.reply) for _ in range(args.turns)],
              [rng.uniform(0, args.ramp)] + [rng.expovariate(1 / args.think) for _ in range(args.turns - 1)])
             for _ in range(args.users)]
    gate = in_flight_gate(args)
    if args.rate:  # Poisson in all; each round of `users` sends is every user's next turn, in a shuffled order
        dues, order = paced_dues(args.rate, args.users * args.turns, args.rate_seed), random.Random(args.rate_seed + 1)
        slots = [order.sample(range(args.users), args.users) for _ in range(args.turns)]
        users = [(*u[:3], [dues[turn * args.users + slots[turn][i]] for turn in range(args.turns)])
                 for i, u in enumerate(users)]

    async def user(client: httpx.AsyncClient, system: list[int], questions: list[list[int]],
                   replies: list[list[int]], pauses: list[float]) -> None:
        history, began = list(system), time.perf_counter()
        for question, reply, pause in zip(questions, replies, pauses, strict=True):
            await asyncio.sleep(max(0.0, began + pause - time.perf_counter()) if args.rate else pause)
            prompt = history + question
            async with gate:
                await one_request(client, url, model, prompt, args.max_tokens, stats)
            history = prompt + reply

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(user(client, *u) for u in users))
    return stats


def in_flight_gate(args: argparse.Namespace) -> contextlib.AbstractAsyncContextManager:
    """The client's bound on requests in flight: --concurrency, none when requests are paced by --rate (a user
    sends when due, and the TTFT counts every wait after that)."""
    return contextlib.nullcontext() if args.rate else asyncio.Semaphore(args.concurrency)


def paced_dues(rate: float, count: int, seed: int = 3) -> list[float]:
    """When each of the run's `count` sends is due, in seconds from its start: a Poisson stream of `rate` a
    second (seeded: every policy gets the same schedule). A chat turn is sent when due or on the user's
    previous answer, whichever comes later."""
    rng, due, dues = random.Random(seed), 0.0, []
    for _ in range(count):
        due += rng.expovariate(rate)
        dues.append(due)
    return dues


async def rag_workload(url: str, model: str, args: argparse.Namespace) -> RunStats:
    stats, rng = RunStats(), random.Random(2)
    docs = [random_ids(rng, args.doc_len) for _ in range(args.docs)]
    prompts = [docs[rng.randrange(args.docs)] + random_ids(rng, args.user) for _ in range(args.queries)]
    gate = in_flight_gate(args)
    dues = paced_dues(args.rate, len(prompts), args.rate_seed) if args.rate else [0.0] * len(prompts)

    async def ask(client: httpx.AsyncClient, prompt: list[int], due: float) -> None:
        await asyncio.sleep(due)
        async with gate:
            await one_request(client, url, model, prompt, args.max_tokens, stats)

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(ask(client, prompt, due) for prompt, due in zip(prompts, dues, strict=True)))
    return stats


async def private_chat_workload(url: str, model: str, args: argparse.Namespace) -> RunStats:
    return await chat_workload(url, model, args, private=True)


WORKLOADS = {"chat": chat_workload, "chat-private": private_chat_workload, "rag": rag_workload}
DEFAULT_WORKLOADS = ["chat", "rag"]


def reset_caches(urls: list[str], store: str | None = None) -> None:
    """Every worker's prefix cache and its host and disk tiers dropped, and the shared store emptied
    (--shared-store), so each run starts cold."""
    if store:
        redis.Redis.from_url(store).flushdb()
    for url in urls:
        deadline = time.monotonic() + 60
        while httpx.post(f"{url}/reset_prefix_cache", params={"tiers": "true"}, timeout=30).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} would not reset its prefix cache")
            time.sleep(0.2)


def served_per_worker(router_url: str, urls: list[str]) -> list[int]:
    text = httpx.get(f"{router_url}/metrics").text
    counts = dict.fromkeys(urls, 0)
    for line in text.splitlines():
        if line.startswith("kvserve_router_requests_total{") and 'outcome="ok"' in line:
            for url in urls:
                if f'worker="{url}"' in line:
                    counts[url] += int(float(line.rsplit(" ", 1)[1]))
    return [counts[url] for url in urls]


def progress(started: float, message: str) -> None:
    print(f"[{time.perf_counter() - started:7.1f} s] {message}", flush=True)


def policy_config(spec: str, urls: list[str]) -> RouterConfig:
    """`NAME[:field=value...]` (any `RouterConfig` field) as the router's settings for one run."""
    name, *settings = spec.split(":")
    if name not in POLICIES:
        raise SystemExit(f"unknown policy {name!r} in {spec!r}: one of {POLICIES}")
    fields = {f.name: f for f in dataclasses.fields(RouterConfig)}
    values: dict[str, object] = {}
    for setting in settings:
        field_name, _, value = setting.partition("=")
        if field_name not in fields:
            raise SystemExit(f"{spec!r}: RouterConfig has no field {field_name!r}")
        default = getattr(RouterConfig(), field_name)
        if isinstance(default, bool):
            values[field_name] = value.lower() in ("1", "true", "yes")
        else:
            values[field_name] = value if isinstance(default, str) or default is None else type(default)(value)
    values.setdefault("idle_copy_slots", machine_cores())  # as `kvserve cluster` sets it: 1-thread workers
    return RouterConfig(workers=urls, policy=name, poll_interval=0.25, **values)


def compare_policies(cluster: Cluster, single: str, model: str, args: argparse.Namespace,
                     began: float, tails: list[list[object]]) -> list[list[object]]:
    """The policy table; `tails` gets each run's p90 diagnosis (`RunStats.tail`)."""
    rows: list[list[object]] = []
    for name, workload in WORKLOADS.items():
        if name not in args.workloads:
            continue
        if args.no_single:
            _compare_cluster(cluster, name, workload, model, args, began, tails, rows)
            continue
        progress(began, f"{name}: one worker (direct)")
        reset_caches([single])
        started = time.perf_counter()
        stats = asyncio.run(workload(single, model, args))
        rows.append(_row(name, 1, f"one worker (direct, {args.single_threads} threads)", stats, [len(stats.ttfts)],
                         time.perf_counter() - started))
        progress(began, f"  {rows[-1]}")
        tails.append([name, 1, "one worker", stats.tail()])
        _dump(args, name, 1, "one worker", stats)
        _compare_cluster(cluster, name, workload, model, args, began, tails, rows)
    return rows


def _compare_cluster(cluster: Cluster, name: str, workload, model: str, args: argparse.Namespace, began: float,
                     tails: list[list[object]], rows: list[list[object]]) -> None:
    for num_workers in sorted({min(2, args.max_workers), args.max_workers} & set(args.worker_counts)):
        urls = cluster.urls[:num_workers]
        for repeat in range(args.repeat):
            for policy in args.policies:
                label = policy if args.repeat == 1 else f"{policy} #{repeat + 1}"
                progress(began, f"{name}: {num_workers} workers, {label}")
                reset_caches(urls, args.store_url)
                with RouterThread(policy_config(policy, urls)) as router:
                    if policy.startswith("kv_events"):
                        _wait_for_streams(router, num_workers)
                    started = time.perf_counter()
                    stats = asyncio.run(workload(router.url, model, args))
                    elapsed = time.perf_counter() - started
                    rows.append(_row(name, num_workers, label, stats, served_per_worker(router.url, urls), elapsed))
                progress(began, f"  {rows[-1]}")
                tails.append([name, num_workers, label, stats.tail()])
                progress(began, f"  tail: {tails[-1][-1]}")
                _dump(args, name, num_workers, label, stats)


def _dump(args: argparse.Namespace, workload: str, workers: int, policy: str, stats: RunStats) -> None:
    """Append one run's samples to --dump (a JSON list of runs), for whoever studies a tail."""
    if not args.dump:
        return
    path = Path(args.dump)
    runs = json.loads(path.read_text()) if path.exists() else []
    runs.append({"workload": workload, "workers": workers, "policy": policy,
                 "samples": [dataclasses.asdict(sample) for sample in stats.samples]})
    path.write_text(json.dumps(runs))


def targets(rows: list[list[object]]) -> str:
    """The issue's targets, checked against the policy table: a plain list of what is met and what is not."""
    by = {(row[0], row[1], row[2]): row for row in rows}
    met, missed = [], []
    for (workload, workers, policy), row in sorted(by.items()):
        if not str(policy).startswith(("cache_aware", "kv_events")):
            continue
        where = f"{workload}@{workers} {policy}"
        single = next((r for (w, n, _), r in by.items() if w == workload and n == 1), None)
        if single is not None:
            hit, single_hit = float(str(row[3]).rstrip("%")), float(str(single[3]).rstrip("%"))
            (met if hit >= single_hit - 5 else missed).append(f"{where}: hit rate {row[3]} vs one worker {single[3]}")
        suffix = str(policy).rpartition(" #")[2] if " #" in str(policy) else None
        rr = by.get((workload, workers, "round_robin" + (f" #{suffix}" if suffix else "")))
        if rr is not None:
            ratio = float(rr[5]) / max(float(row[5]), 1e-9)
            (met if ratio >= 2 else missed).append(f"{where}: TTFT p90 {ratio:.1f}× better than round_robin")
        if workers == 2:
            served = [int(x) for x in str(row[6]).split(" / ")]
            share = max(served) / max(sum(served), 1)
            (met if share <= 0.6 else missed).append(f"{where}: busiest worker {100 * share:.0f}% of requests")
    return ("**Targets** (hit rate within 5 points of one worker's; TTFT p90 at least 2× round_robin's; no worker "
            "above 60% of the requests at 2 workers). Met: " + ("; ".join(met) or "none") + ". **Not met**: "
            + ("; ".join(missed) or "none") + ".")


def merge_rows(saved: Path, rows: list[list[object]], tails: list[list[object]], sizes: str,
               command: str) -> tuple[list[list[object]], list[list[object]], str]:
    """A partial re-run: its rows (and tails) replace the same (workload, workers, policy) ones of the last
    full run."""
    previous = json.loads(saved.read_text())
    if previous.get("sizes") != sizes:
        raise SystemExit("a partial re-run must use the sizes of the run it amends (see results/router.json)")

    def merge(old: list[list[object]], new: list[list[object]]) -> list[list[object]]:
        fresh = {tuple(row[:3]): row for row in new}
        return [fresh.pop(tuple(row[:3]), row) for row in old] + list(fresh.values())

    return (merge(previous["rows"], rows), merge(previous.get("tails", []), tails),
            f"{previous['command']}` then `{command}")


KEPT_MARKER = "<!-- written by hand below this line: benchmarks/router.py keeps it -->"


def kept_notes() -> str:
    """The hand-written part of results/router.md (readings, earlier runs), kept across re-runs."""
    path = RESULTS / "router.md"
    text = path.read_text() if path.exists() else ""
    return text[text.index(KEPT_MARKER):] if KEPT_MARKER in text else KEPT_MARKER + "\n"


def host_note(args: argparse.Namespace) -> str:
    host = "" if args.host_cache is None else f" (host tier {args.host_cache})"
    store = " (the cluster's workers share one local Redis as their remote tier)" if args.store_url else ""
    return host + store


def worker_argv(args: argparse.Namespace, threads: int, store: str | None = None) -> list[str]:
    """One worker's flags: the pool, the host tier when --host-cache is given (the server's default
    otherwise), the shared store when given, the torch threads."""
    host = ["--host-cache", args.host_cache] if args.host_cache is not None else []
    remote = ["--remote-cache", store] if store else []
    chunked = ["--long-prefill-always"] if args.long_prefill_always else []
    if args.long_prefill_token_threshold is not None:
        chunked += ["--long-prefill-token-threshold", str(args.long_prefill_token_threshold)]
    if args.max_num_batched_tokens is not None:
        chunked += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.max_admitted_prefill_tokens is not None:
        chunked += ["--max-admitted-prefill-tokens", str(args.max_admitted_prefill_tokens)]
    if args.long_prefill_busy_tokens is not None:
        chunked += ["--long-prefill-busy-tokens", str(args.long_prefill_busy_tokens)]
    return ["--model", args.model, "--num-blocks", str(args.num_blocks), *host, *remote, *chunked,
            "--num-threads", str(threads)]


def pacing_note(args: argparse.Namespace) -> str:
    if args.rate:
        return ("the run's sends in rounds of one turn per user, the users in a new random order each round, a "
                "turn never before that user's previous answer")
    return f"users start within {args.ramp:g} s and think {args.think:g} s on average between turns"


def flight_note(args: argparse.Namespace) -> str:
    if args.rate:
        return (f"**requests paced at {args.rate:g} a second** in all (Poisson, seed {args.rate_seed}), no bound on "
                "requests in flight, TTFT from the send")
    return f"at most {args.concurrency} requests in flight"


def sizes_note(args: argparse.Namespace) -> str:
    return (
        f"Sizes: chat {args.users} users × {args.turns} turns (chat: one system prompt shared by all users; "
        f"chat-private: a private one per user; system prompts of {args.system} tokens, "
        f"questions of {args.user}, replies of {args.reply} carried into the history; "
        f"{pacing_note(args)}); RAG {args.queries} questions of "
        f"{args.user} tokens over {args.docs} shared documents of {args.doc_len} tokens; {flight_note(args)}; "
        f"{args.max_tokens} output tokens per request; {args.num_blocks} KV blocks"
        f"{host_note(args)} and 1 torch "
        f"thread per cluster worker, {args.single_threads} threads for the single worker; model {args.model}. All "
        "workers share the same 2 cores, so more workers add no compute here: TTFT differences come from cache "
        "hits and queueing, not from parallel hardware."
    )


def _wait_for_streams(router: RouterThread, count: int) -> None:
    deadline = time.monotonic() + 30
    policy = router.router.policy
    while len(getattr(policy, "streams", {})) < count or any(s.stats.last_seq is None for s in policy.streams.values()):
        if time.monotonic() > deadline:
            raise RuntimeError("KV event streams did not sync")
        time.sleep(0.05)


def _row(workload: str, workers: int, policy: str, stats: RunStats, per_worker: list[int],
         elapsed: float) -> list[object]:
    return [workload, workers, policy, f"{100 * stats.hit_rate:.1f}%", f"{1000 * percentile(stats.ttfts, 0.5):.0f}",
            f"{1000 * percentile(stats.ttfts, 0.9):.0f}", " / ".join(map(str, per_worker)), stats.errors,
            f"{elapsed:.1f}"]


def decision_latency(tokens_per_tree: int, num_workers: int = 4, prompt_len: int = 1024,
                     samples: int = 2000) -> list[list[object]]:
    """Routing decisions with `tokens_per_tree` tokens indexed for each worker (no HTTP)."""
    rng = random.Random(3)
    pool = [Worker(url=f"http://w{i}", healthy=True, load=WorkerLoad(block_size=16, prefix_hash="sha256"))
            for i in range(num_workers)]
    namespace = ()
    systems = [random_ids(rng, 256) for _ in range(32)]
    sequences = [systems[rng.randrange(32)] + random_ids(rng, prompt_len - 256) for _ in range(256)]
    cache_aware = CacheAwarePolicy(CacheAwareSettings(tree_budget=tokens_per_tree))
    kv_events = KvEventsPolicy()
    for worker in pool:
        filled = 0
        while filled < tokens_per_tree:
            seq = systems[rng.randrange(32)] + random_ids(rng, prompt_len - 256)
            cache_aware.on_routed(RouteKey(tokens=tuple(seq), namespace=namespace, exact=True), worker)
            kv_events.index.store(worker.url, block_hashes(seq, 16, namespace))
            filled += len(seq)
    rows = []
    for name, policy in (("cache_aware", cache_aware), ("kv_events", kv_events)):
        times = []
        for i in range(samples):
            seq = sequences[i % len(sequences)] if i % 2 else systems[i % 32] + random_ids(rng, prompt_len - 256)
            key = RouteKey(tokens=tuple(seq), namespace=namespace, exact=True)
            started = time.perf_counter()
            decision = policy.choose(key, pool)
            policy.on_routed(key, decision.worker)
            times.append(time.perf_counter() - started)
        sizes = [cache_aware.tree(w).num_tokens if name == "cache_aware" else 16 * kv_events.index.num_blocks(w.url)
                 for w in pool]
        rows.append([name, num_workers, f"{min(sizes)}–{max(sizes)}", prompt_len,
                     f"{1e6 * percentile(times, 0.5):.0f}", f"{1e6 * percentile(times, 0.99):.0f}"])
    return rows


def proxy_overhead(cluster: Cluster, model: str, count: int) -> list[list[object]]:
    """TTFT of tiny unique prompts (4 tokens, 1 output token: almost no model work), alternating direct to
    a worker and through a router in front of it, so drift in the machine's load hits both alike."""
    rng = random.Random(4)
    url = cluster.urls[0]
    with RouterThread(RouterConfig(workers=[url], policy="cache_aware", poll_interval=0.5)) as router:
        direct, routed = RunStats(), RunStats()

        async def run() -> None:
            async with httpx.AsyncClient(timeout=120) as client:
                for _ in range(count):
                    await one_request(client, url, model, random_ids(rng, 4), 1, direct)
                    await one_request(client, router.url, model, random_ids(rng, 4), 1, routed)

        asyncio.run(run())
        routing = _histogram_mean(router.url, "kvserve_router_routing_seconds")
    rows = [[label, len(stats.ttfts), f"{1000 * percentile(stats.ttfts, 0.5):.1f}",
             f"{1000 * percentile(stats.ttfts, 0.9):.1f}"] for label, stats in (("direct", direct),
                                                                                ("through the router", routed))]
    difference = percentile(routed.ttfts, 0.5) - percentile(direct.ttfts, 0.5)
    rows.append(["difference (p50)", "", f"{1000 * difference:+.1f}", ""])
    rows.append(["router's own work per request (mean: parse, key, decide)", "", f"{1000 * routing:.2f}", ""])
    return rows


def _histogram_mean(url: str, name: str) -> float:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(name + suffix + " "):
                values[suffix] = float(line.rsplit(" ", 1)[1])
    return values.get("_sum", 0.0) / max(values.get("_count", 0.0), 1.0)


def partial_run(args: argparse.Namespace, began: float) -> None:
    """--out: the policy table alone, in its own result file."""
    argv, single_argv = worker_argv(args, 1, args.store_url), worker_argv(args, args.single_threads)
    tails: list[list[object]] = []
    with Cluster.start_args(argv, args.max_workers, kv_events=True) as cluster, \
            (contextlib.nullcontext() if args.no_single else Cluster.start_args(single_argv, 1)) as single:
        model = httpx.get(f"{cluster.urls[0]}/v1/models").json()["data"][0]["id"]
        rows = compare_policies(cluster, single.urls[0] if single else "", model, args, began, tails)
    table = markdown_table(["workload", "workers", "policy", "hit rate", "TTFT p50 ms", "TTFT p90 ms",
                            "requests per worker", "errors", "wall s"], rows)
    tail_table = markdown_table(["workload", "workers", "policy", "the slowest 10%"], tails)
    notes = (sizes_note(args) + "\n\n" + targets(rows) + "\n\n**The tail** (as in results/router.md):\n\n"
             + tail_table)
    path = write_result(args.out, f"Router: policies over replicas ({args.out})", table, notes)
    print(path.read_text())
    progress(began, f"done: total runtime {(time.perf_counter() - began) / 60:.1f} min")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-workers", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=2048,
                        help="KV blocks per worker (16 tokens each: room for every conversation, no eviction, "
                             "with private system prompts too)")
    parser.add_argument("--host-cache", help="each worker's host RAM tier (e.g. 0: off); default: the server's")
    parser.add_argument("--long-prefill-always", action="store_true",
                        help="workers chunk a lone long prompt at the threshold too (serve --long-prefill-always)")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=None,
                        help="workers' prefill chunk bound (serve --long-prefill-token-threshold)")
    parser.add_argument("--long-prefill-busy-tokens", type=int, default=None,
                        help="workers' chunk for a lone long prompt while busy lately (serve "
                             "--long-prefill-busy-tokens; 0: off)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="workers' token budget per step (serve --max-num-batched-tokens)")
    parser.add_argument("--max-admitted-prefill-tokens", type=int, default=None,
                        help="workers' prompt tokens admitted per step while others wait or run "
                             "(serve --max-admitted-prefill-tokens; 0: off)")
    parser.add_argument("--single-threads", type=int, default=2,
                        help="torch threads of the single worker (the cluster's workers have 1 each)")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=512, help="tokens of the system prompt")
    parser.add_argument("--private-system", action="store_true",
                        help="run the chat with a different system prompt per user (workload chat-private) "
                             "instead of one shared by all users")
    parser.add_argument("--user", type=int, default=48, help="tokens per question")
    parser.add_argument("--reply", type=int, default=192, help="tokens per assistant reply carried into the history")
    parser.add_argument("--think", type=float, default=1.0, help="mean seconds a user thinks between turns")
    parser.add_argument("--ramp", type=float, default=4.0, help="users start within this many seconds")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-len", type=int, default=1024)
    parser.add_argument("--queries", type=int, default=96,
                        help="RAG questions: 96 over 4 documents keeps the unavoidable first reads (4, or 8 "
                             "and 16 for round_robin over 2 and 4 workers) near or under 10%% of the requests, "
                             "so TTFT p90 compares routing, not cold starts (at 32, 4 first reads were 12.5%%: "
                             "the p90 of every policy was a first read)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at most (both workloads)")
    parser.add_argument("--rate", type=float, default=None,
                        help="pace the requests instead: this many a second on average over the run (Poisson; "
                             "chat: rounds of one turn per user in a random order, never before the user's "
                             "previous answer), no bound on requests in flight, TTFT from the send -- the "
                             "open-loop form of production-stack's "
                             "multi-round QA; --think and --concurrency are then unused")
    parser.add_argument("--rate-seed", type=int, default=3,
                        help="seed of --rate's schedule (the same for every policy)")
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--tree-tokens", type=int, default=100_000)
    parser.add_argument("--overhead-requests", type=int, default=40)
    parser.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS, choices=list(WORKLOADS),
                        help="re-measure only these workloads ...")
    parser.add_argument("--worker-counts", nargs="+", type=int, default=[2, 4],
                        help="... at these cluster sizes: with either flag narrowed, the new rows replace their "
                             "twins in the last run's results/router.json (same sizes required)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES),
                        help="... with these policies (the targets need round_robin's rows, old or new); "
                             "NAME:field=value:... sets RouterConfig fields for that run")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the policy list this many times in turn (rows labelled #1, #2, ...)")
    parser.add_argument("--out", help="a partial run: write its policy table to results/OUT.md only (no "
                                      "decision latency, no proxy overhead, results/router.* untouched)")
    parser.add_argument("--no-single", action="store_true", help="skip the one-worker rows (with --out)")
    parser.add_argument("--dump", help="write every request's sample to this JSON file")
    parser.add_argument("--reuse-policies", action="store_true",
                        help="take the policy table from the last run's results/router.json (re-measure the rest)")
    parser.add_argument("--token-range", type=int, nargs=2, default=TOKEN_RANGE, help="prompt ids: [low, high)")
    parser.add_argument("--shared-store", action="store_true",
                        help="start one local Redis and give every cluster worker it as --remote-cache (the "
                             "multi-machine form: a block one worker computed, another loads instead of "
                             "recomputing); emptied before each run. The single worker has none")
    args = parser.parse_args()
    if args.rate is not None and args.rate <= 0:
        parser.error(f"--rate must be > 0 requests a second, got {args.rate}")
    TOKEN_RANGE[:] = args.token_range
    with LocalRedis() if args.shared_store else contextlib.nullcontext() as store:
        args.store_url = store.url if store is not None else None
        run(args)


def run(args: argparse.Namespace) -> None:
    if args.private_system:
        args.workloads = ["chat-private" if name == "chat" else name for name in args.workloads]
    began = time.perf_counter()
    progress(began, f"router benchmark: workloads {', '.join(args.workloads)} over {args.worker_counts} workers")
    if args.out:
        partial_run(args, began)
        return

    decisions = decision_latency(args.tree_tokens)
    progress(began, f"decision latency: {decisions}")
    argv, single_argv = worker_argv(args, 1, args.store_url), worker_argv(args, args.single_threads)
    with Cluster.start_args(argv, args.max_workers, kv_events=True) as cluster, \
            Cluster.start_args(single_argv, 1) as single:
        model = httpx.get(f"{cluster.urls[0]}/v1/models").json()["data"][0]["id"]
        progress(began, "workers up; proxied vs direct TTFT")
        overhead = proxy_overhead(cluster, model, args.overhead_requests)
        progress(began, f"  {overhead}")
        saved = RESULTS / "router.json"
        tails: list[list[object]] = []
        if args.reuse_policies:
            previous = json.loads(saved.read_text())
            rows, sizes, tails = previous["rows"], previous["sizes"], previous.get("tails", [])
        else:
            rows, sizes = compare_policies(cluster, single.urls[0], model, args, began, tails), sizes_note(args)
            command = command_line()
            partial = set(args.policies) != set(POLICIES) or set(args.workloads) != set(DEFAULT_WORKLOADS)
            if partial or not {2, args.max_workers} <= set(args.worker_counts):
                rows, tails, command = merge_rows(saved, rows, tails, sizes, command)
            saved.write_text(json.dumps({"command": command, "rows": rows, "sizes": sizes, "tails": tails}))

    table = markdown_table(["workload", "workers", "policy", "hit rate", "TTFT p50 ms", "TTFT p90 ms",
                            "requests per worker", "errors", "wall s"], rows)
    decision_table = markdown_table(["policy", "workers", "tokens indexed per worker", "prompt tokens",
                                     "decision p50 µs", "decision p99 µs"], decisions)
    overhead_table = markdown_table(["path", "requests", "TTFT p50 ms", "TTFT p90 ms"], overhead)
    tail_table = markdown_table(["workload", "workers", "policy", "the slowest 10%"], tails)
    table_command = json.loads((RESULTS / "router.json").read_text())["command"]
    policy_source = f"Policy table from: `{table_command}`\n\n" if table_command != command_line() else ""
    notes = policy_source + sizes + "\n\n" + targets(rows) + (
        "\n\n**The tail, request by request** (the requests at or above each run's p90, from the router's "
        "`x-kvserve-route` header and the usage the worker reports: cold = under half the prompt cached; busier "
        "than another = sent to a worker with more requests in flight than some other worker had; beside others "
        "= sent where other requests ran, no worker having fewer; prefill queued ahead = the uncached prompt "
        "tokens of the requests in flight there, as the router estimated them):\n\n"
        f"{tail_table}\n\n"
        "**Router decision latency** (in process, no HTTP):\n\n"
        f"{decision_table}\n\n**Proxied vs direct TTFT** (unique 4-token prompts, 1 output token, alternating "
        "direct / router):\n\n"
        f"{overhead_table}\n\n{kept_notes()}"
    )
    path = write_result("router", "Router: policies over replicas", table, notes)
    print(path.read_text())
    progress(began, f"done: total runtime {(time.perf_counter() - began) / 60:.1f} min")


if __name__ == "__main__":
    main()
