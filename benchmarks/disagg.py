"""Disaggregated serving (1 prefill + 1 decode worker, `--policy pd`) against 2 mixed workers behind
`cache_aware`, on the same machine and the same open-loop workload.

Workload (token-id prompts, fixed arrival rate, streaming): --requests requests at --rate per second;
every --long-every-th one is a long prompt (--long-prompt tokens, --long-output tokens out), the others
chat turns (--chat-prompt tokens, --chat-output out). Every prompt is fresh (no shared prefix), so
each long prompt is one hand-off through Redis; chat turns are shorter than `--pd-min-prompt` and go
straight to the decode worker.

Reported: TTFT p50/p99 and inter-token latency p50/p99 (client side, per streamed chunk), split by
request kind; and for pd, the hand-off cost per request from the router's metrics (KV bytes written to
the store, the prefill request's time, and the prefill worker's wait for the store).

    python benchmarks/disagg.py            # reduced sizes (see the notes in the result file)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, markdown_table, write_result  # noqa: E402
from kvserve.router.cluster import Cluster  # noqa: E402
from kvserve.router.config import RouterConfig  # noqa: E402
from kvserve.router.thread import RouterThread  # noqa: E402
from kvserve.tiers.local_redis import LocalRedis  # noqa: E402

TOKEN_RANGE = (1000, 48000)
READING = (
    "How to read it: both pools share the same 2 cores, so disaggregation adds no compute; what it changes "
    "is who waits for whom. A long prefill on a mixed worker stalls the decode steps of every stream on "
    "that worker (the ITL p99 column); with pd the decode worker never runs one, so its streams keep a "
    "steady pace. The price is paid in TTFT of long prompts: the prompt is computed on one worker, "
    "written to Redis (the KV bytes above, fp32), waited for, then loaded by the decode worker, which "
    "recomputes the last prompt token and queues behind its own streams; and one prefill worker serves "
    "every long prompt where two mixed workers shared them. On separate machines the prefill pool would "
    "add compute and the trade would shift; here it cannot."
)


@dataclass(slots=True)
class Sample:
    kind: str
    ttft: float
    gaps: list[float] = field(default_factory=list)


@dataclass(slots=True)
class RunResult:
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    wall: float = 0.0
    handoff: dict[str, float] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def workload(args: argparse.Namespace, seed: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    out = []
    for i in range(args.requests):
        long = i % args.long_every == 0
        size = args.long_prompt if long else args.chat_prompt
        out.append(("long" if long else "chat", [rng.randrange(*TOKEN_RANGE) for _ in range(size)],
                    args.long_output if long else args.chat_output))
    return out


async def one(client: httpx.AsyncClient, url: str, model: str, kind: str, prompt: list[int], max_tokens: int,
              result: RunResult) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    arrivals: list[float] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.errors += 1
                return
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                    arrivals.append(time.perf_counter())
    except httpx.HTTPError:
        result.errors += 1
        return
    if not arrivals:
        result.errors += 1
        return
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]
    result.samples.append(Sample(kind, arrivals[0] - start, gaps))


async def drive(url: str, model: str, args: argparse.Namespace, rate: float, seed: int,
                count: int | None = None) -> RunResult:
    result = RunResult()
    requests = workload(args, seed)[:count]
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10)) as client:
        tasks = []
        for i, (kind, prompt, max_tokens) in enumerate(requests):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, url, model, kind, prompt, max_tokens, result)))
        await asyncio.gather(*tasks)
    result.wall = time.perf_counter() - start
    return result


def router_metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name) and line.split("{")[0].split(" ")[0] == name)


def handoff_totals(url: str) -> dict[str, float]:
    names = {"handoffs": "kvserve_router_pd_handoffs_total", "fallbacks": "kvserve_router_pd_fallbacks_total",
             "bytes": "kvserve_router_pd_handoff_bytes_total", "prefill_s": "kvserve_router_pd_prefill_seconds_sum",
             "flush_s": "kvserve_router_pd_flush_seconds_sum"}
    return {key: router_metric(url, name) for key, name in names.items()}


def run_setup(name: str, argvs: list[list[str]], policy: str, args: argparse.Namespace) -> dict[float, RunResult]:
    """One pool, a warm-up, then the workload at each rate (fresh prompts each time)."""
    clusters = [Cluster.start_args(argv, 1) for argv in argvs]
    results: dict[float, RunResult] = {}
    try:
        urls = [url for cluster in clusters for url in cluster.urls]
        config = RouterConfig(workers=urls, policy=policy, poll_interval=0.5, pd_min_prompt=args.pd_min_prompt)
        with RouterThread(config) as router:
            time.sleep(1.5)  # first polls: roles and store state known
            asyncio.run(drive(router.url, args.model, args, 1.0, seed=0, count=args.long_every))  # warm-up
            for index, rate in enumerate(args.rate):
                before = handoff_totals(router.url) if policy == "pd" else {}
                result = asyncio.run(drive(router.url, args.model, args, rate, seed=index + 1))
                if policy == "pd":
                    after = handoff_totals(router.url)
                    delta = {key: after[key] - before[key] for key in after}
                    count = max(delta["handoffs"], 1)
                    result.handoff = {"handoffs": delta["handoffs"], "fallbacks": delta["fallbacks"],
                                      "bytes": delta["bytes"] / count, "prefill_ms": 1000 * delta["prefill_s"] / count,
                                      "flush_ms": 1000 * delta["flush_s"] / count}
                results[rate] = result
                print(f"{name} at {rate}/s: {len(result.samples)} ok, {result.errors} errors, {result.wall:.1f} s",
                      flush=True)
        return results
    finally:
        for cluster in clusters:
            cluster.stop()


def rows_for(name: str, result: RunResult) -> list[list[object]]:
    rows = []
    for kind in ("long", "chat", "all"):
        samples = [s for s in result.samples if kind in ("all", s.kind)]
        gaps = [g for s in samples for g in s.gaps]
        ttfts = [s.ttft for s in samples]
        rows.append([name, kind, len(samples), 1000 * percentile(ttfts, 0.5), 1000 * percentile(ttfts, 0.99),
                     1000 * percentile(gaps, 0.5), 1000 * percentile(gaps, 0.99)])
    rows[-1].append(result.errors)
    for row in rows[:-1]:
        row.append("")
    return rows


def verdict(rate: float, mixed: RunResult, pd: RunResult) -> str:
    """One line per rate: pd / mixed for the numbers disaggregation is meant to move, said as won or lost."""
    def ratio(kind: str, metric: str, q: float) -> float:
        def value(result: RunResult) -> float:
            samples = [s for s in result.samples if kind in ("all", s.kind)]
            values = [s.ttft for s in samples] if metric == "ttft" else [g for s in samples for g in s.gaps]
            return percentile(values, q)
        return value(pd) / value(mixed)

    checks = [("long TTFT p50", ratio("long", "ttft", 0.5)), ("chat TTFT p50", ratio("chat", "ttft", 0.5)),
              ("ITL p50", ratio("all", "itl", 0.5)), ("ITL p99", ratio("all", "itl", 0.99))]
    said = ", ".join(f"{name} ×{value:.2f} ({'wins' if value < 0.95 else 'loses' if value > 1.05 else 'even'})"
                     for name, value in checks)
    return f"- at {rate}/s, pd / mixed: {said}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rate", type=float, nargs="+", default=[0.25, 1.0],
                        help="requests per second (open loop), one measured pass each")
    parser.add_argument("--long-every", type=int, default=4, help="every N-th request is a long prompt")
    parser.add_argument("--long-prompt", type=int, default=512)
    parser.add_argument("--long-output", type=int, default=8)
    parser.add_argument("--chat-prompt", type=int, default=48)
    parser.add_argument("--chat-output", type=int, default=32)
    parser.add_argument("--pd-min-prompt", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=512)
    args = parser.parse_args()

    base = ["--model", args.model, "--num-blocks", str(args.num_blocks), "--num-threads", "1", "--host-cache", "0",
            "--max-num-batched-tokens", "512"]
    with LocalRedis() as redis:
        store = ["--remote-cache", redis.url]
        mixed = run_setup("2 mixed, cache_aware", [base, base], "cache_aware", args)
        pd = run_setup("1 prefill + 1 decode, pd", [[*base, *store, "--role", "prefill"],
                                                     [*base, *store, "--role", "decode"]], "pd", args)
    header = ["rate /s", "setup", "requests", "n", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "errors"]
    rows: list[list[object]] = []
    handoff_rows: list[list[object]] = []
    for rate in args.rate:
        for name, result in (("2 mixed (cache_aware)", mixed[rate]), ("1 prefill + 1 decode (pd)", pd[rate])):
            rows += [[rate, *row] for row in rows_for(name, result)]
        h = pd[rate].handoff
        handoff_rows.append([rate, int(h["handoffs"]), int(h["fallbacks"]), f"{h['bytes']:,.0f}", h["prefill_ms"],
                             h["flush_ms"]])
    table = markdown_table(header, rows)
    handoff = markdown_table(["rate /s", "hand-offs", "fallbacks", "KV bytes / hand-off",
                              "prefill request ms / hand-off", "store wait ms / hand-off"], handoff_rows)
    notes = (f"Sizes: {args.requests} requests per rate, open loop, streaming; every {args.long_every}th a "
             f"long prompt of {args.long_prompt} tokens ({args.long_output} out), the rest chat turns of "
             f"{args.chat_prompt} tokens ({args.chat_output} out); fresh prompts (no shared prefix); model "
             f"{args.model}, 1 torch thread, {args.num_blocks} KV blocks per worker, a local redis-server as the "
             f"store; each pool first runs {args.long_every} other requests to warm up. Command: "
             f"`{command_line()}`.\n\n**Hand-off cost (pd)**\n\n{handoff}\n\n**Won and lost** (pd / mixed; below 1 "
             f"is better)\n\n" + "\n".join(verdict(rate, mixed[rate], pd[rate]) for rate in args.rate) + "\n\n"
             + READING)
    write_result("disagg", "Disaggregated prefill / decode vs. mixed workers", table, notes)


if __name__ == "__main__":
    main()
