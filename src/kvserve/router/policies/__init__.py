"""Routing policies: which healthy worker gets a request, and why (the reason is a metric label)."""

from kvserve.router.config import POLICY_NAMES
from kvserve.router.policies.base import Decision, Policy
from kvserve.router.policies.cache_aware import CacheAwarePolicy, CacheAwareSettings
from kvserve.router.policies.kv_events import KvEventsPolicy
from kvserve.router.policies.least_load import LeastLoadPolicy
from kvserve.router.policies.round_robin import RoundRobinPolicy

__all__ = [
    "POLICY_NAMES", "CacheAwarePolicy", "CacheAwareSettings", "Decision", "KvEventsPolicy", "LeastLoadPolicy",
    "Policy", "RoundRobinPolicy",
]
