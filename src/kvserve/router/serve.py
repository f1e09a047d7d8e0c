"""Build the router from a RouterConfig and serve it (the body of `kvserve router`)."""

from __future__ import annotations

import logging

import httpx
import uvicorn
from fastapi import FastAPI

from kvserve.router.app import Router, build_router_app
from kvserve.router.config import RouterConfig
from kvserve.router.idle_copy import IDLE_COPY_POLICIES, IdleCopies
from kvserve.router.keys import RequestKeyer, load_tokenizer
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies import (
    CacheAwarePolicy,
    CacheAwareSettings,
    KvEventsPolicy,
    LeastLoadPolicy,
    PdPolicy,
    Policy,
    RoundRobinPolicy,
)
from kvserve.router.policies.eta import EtaCost
from kvserve.router.policies.store import SharedStore
from kvserve.router.workers import WorkerPool
from kvserve.server.auth import load_api_keys, read_key_entries

logger = logging.getLogger("uvicorn.error")
# Generations can run for minutes; connection setup should not.
CLIENT_TIMEOUT = httpx.Timeout(None, connect=5.0)
CLIENT_LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=256)


def build_router(config: RouterConfig) -> FastAPI:
    """Load the tokenizer (if a model is named) and the key file, then assemble the app."""
    tokenizer = load_tokenizer(config.model) if config.model else None
    api_keys = load_api_keys(config.api_keys) if config.api_keys else None
    client = httpx.AsyncClient(timeout=CLIENT_TIMEOUT, limits=CLIENT_LIMITS)
    pool = WorkerPool(config.workers, client, config.poll_interval, poll_headers=_admin_headers(config.api_keys),
                      polled_load=config.polled_load)
    policy = build_policy(config)
    metrics = RouterMetrics(lambda: pool.workers, policy.index_sizes)
    copies = config.idle_copy and config.policy in IDLE_COPY_POLICIES
    idle = IdleCopies(client, policy, metrics, interval=config.poll_interval,
                                 slots=config.idle_copy_slots) if copies else None
    router = Router(pool=pool, policy=policy, keyer=RequestKeyer(tokenizer, api_keys), client=client,
                    metrics=metrics, max_attempts=config.max_attempts,
                    metrics_keys=None if config.open_metrics else api_keys, idle=idle)
    return build_router_app(router)


def build_policy(config: RouterConfig) -> Policy:
    if config.policy == "round_robin":
        return RoundRobinPolicy()
    if config.policy == "least_load":
        return LeastLoadPolicy()
    cost = EtaCost(config.load_weight, config.request_overhead, config.queue_model)
    if config.policy == "kv_events":
        return KvEventsPolicy(cost, config.balance_abs, config.balance_rel, config.max_share,
                              SharedStore(config.store_fetch_cost), config.tier_fetch_cost, config.warm_copy,
                              config.share_min_seen)
    settings = CacheAwareSettings(config.balance_abs, config.balance_rel, config.cache_threshold, config.tree_budget,
                                  config.load_estimate, cost, config.max_share, config.warm_copy,
                                  SharedStore(config.store_fetch_cost), config.share_min_seen)
    if config.policy == "pd":  # plans by request counts (PdPolicy)
        return PdPolicy(settings, config.pd_min_prompt)
    return CacheAwarePolicy(settings)


def _admin_headers(api_keys_path: str | None) -> dict[str, str]:
    """With keys, `/load` is admin-only on the workers: poll with the file's first admin key."""
    if not api_keys_path:
        return {}
    entries = read_key_entries(api_keys_path)
    admin = next((key for key, principal in entries.items() if principal.is_admin), None)
    if admin is None:
        logger.warning("router: the key file has no admin key; worker load cannot be polled (health only)")
        return {}
    return {"Authorization": f"Bearer {admin}"}


def run_router(config: RouterConfig) -> None:
    app = build_router(config)
    logger.info("kvserve router: %d workers, policy %s", len(config.workers), config.policy)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info")
