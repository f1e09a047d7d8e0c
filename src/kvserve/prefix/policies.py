"""The eviction policies by name: the one place the engine, `kvserve replay` and the CLI choose a policy.

Kept apart from `eviction.py` (the interface and the simple policies) because the adaptive policy in
`adaptive.py` builds on that interface: a registry inside `eviction.py` would make the two import each other.
"""

from __future__ import annotations

from kvserve.prefix.adaptive import AdaptiveGhostLRUPolicy
from kvserve.prefix.eviction import (
    BeladyPolicy,
    EvictionPolicy,
    GDSFPolicy,
    GhostLRUPolicy,
    LFUPolicy,
    NextUse,
    S2LRUPolicy,
)
from kvserve.prefix.predictive import NextUsePolicy

EVICTION_POLICIES = ("lru", "lfu", "gdsf", "s2lru", "glru", "alru", "predict", "belady")
ONLINE_POLICIES = EVICTION_POLICIES[:-1]  # belady needs the future: replay only
DEFAULT_EVICTION = "alru"  # at or above glru everywhere measured; within 0.6 points of lru on chat


def make_policy(name: str, next_use: NextUse | None = None) -> EvictionPolicy:
    """The policy named `name`; ValueError for an unknown name or belady without a future."""
    if name == "belady":
        if next_use is None:
            raise ValueError("eviction 'belady' needs the future: it is only available in `kvserve replay`")
        return BeladyPolicy(next_use)
    classes: dict[str, type[EvictionPolicy]] = {
        "lru": EvictionPolicy, "lfu": LFUPolicy, "gdsf": GDSFPolicy, "s2lru": S2LRUPolicy,
        "glru": GhostLRUPolicy, "alru": AdaptiveGhostLRUPolicy, "predict": NextUsePolicy,
    }
    if name not in classes:
        raise ValueError(f"unknown eviction policy {name!r}; expected one of {', '.join(ONLINE_POLICIES)}")
    return classes[name]()
