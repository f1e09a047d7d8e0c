"""Router settings and their defaults (light: the CLI imports this to build its parser)."""

from __future__ import annotations

from dataclasses import dataclass, field

POLICY_NAMES = ("cache_aware", "kv_events", "least_load", "pd", "round_robin")
BALANCE_ABS = 2  # load difference (requests) beyond which cache affinity is ignored ...
BALANCE_REL = 1.5  # ... if the busiest worker also has this many times the least busy one's load
CACHE_THRESHOLD = 0.5  # cache_aware: follow the best match only if it covers more than this of the prompt
TREE_BUDGET = 1_000_000  # tokens per worker tree
LOAD_WEIGHT = 2 / 3  # eta = uncached tokens + LOAD_WEIGHT × work beside it (policies/eta.py)
REQUEST_OVERHEAD = 32.0  # tokens of prefill one request in flight costs besides its prompt (policies/eta.py)
MAX_SHARE = 0.58  # a worker past this share of the recent requests sheds them to a less busy one ...
SHARE_WINDOW = 32  # ... the recent requests counted (policies/base.py ShareGuard) ...
SHARE_MIN_SEEN = 4  # ... once it has seen this many (a shorter window until then)
SHARE_COPY_MIN = 0.125  # ... and warm-copies only a prefix at least this share of recent requests begin with
LOAD_ESTIMATES = ("eta", "requests")  # cache_aware: how it picks among cache holders and new workers
QUEUE_MODELS = ("fcfs", "shared")  # eta: a request waits for all prefill queued ahead | Σ min(p, its own)
STORE_FETCH_COST = 0.2  # kv_events: loading a token from a shared store costs this much of computing it
TIER_FETCH_COST = 0.1  # kv_events: loading a token from a worker's own host RAM or disk tier, likewise
PD_MIN_PROMPT = 128  # pd: shorter prompts skip the prefill pool (a chat turn is cheaper to compute than to ship)


@dataclass(slots=True)
class RouterConfig:
    workers: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 8080
    model: str | None = None  # whose tokenizer keys prompts; None: token-id prompts exactly, text by characters
    api_keys: str | None = None  # the workers' key file: tenants → namespaces, and an admin key for /load
    open_metrics: bool = False  # with api_keys: serve /metrics without a key (else admin keys only)
    poll_interval: float = 1.0
    max_attempts: int = 3
    balance_abs: int = BALANCE_ABS
    balance_rel: float = BALANCE_REL
    cache_threshold: float = CACHE_THRESHOLD
    tree_budget: int = TREE_BUDGET
    load_weight: float = LOAD_WEIGHT
    request_overhead: float = REQUEST_OVERHEAD
    load_estimate: str = "eta"
    max_share: float = MAX_SHARE
    share_min_seen: int = SHARE_MIN_SEEN
    warm_copy: bool = True  # the share guard copies a prefix with a duplicate request nobody waits for
    idle_copy: bool = True  # cache_aware, kv_events: idle workers compute what another just answered (idle_copy.py)
    idle_copy_slots: int = 0  # workers sharing one machine's cores: copies only while fewer are busy (0: own hardware)
    queue_model: str = "fcfs"  # eta's queue: "shared" is the earlier processor-sharing estimate
    pd_min_prompt: int = PD_MIN_PROMPT
    store_fetch_cost: float = STORE_FETCH_COST  # kv_events over workers sharing a store (policies/store.py)
    tier_fetch_cost: float = TIER_FETCH_COST  # kv_events: a worker's own lower tiers (policies/kv_events.py)
    polled_load: bool = False  # a worker's load as max(own in flight, polled): the lagging count, for comparisons

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {POLICY_NAMES}, got {self.policy!r}")
        if self.poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {self.poll_interval}")
        if self.idle_copy_slots < 0:
            raise ValueError(f"idle_copy_slots must be >= 0, got {self.idle_copy_slots}")
        if self.pd_min_prompt < 0:
            raise ValueError(f"pd_min_prompt must be >= 0, got {self.pd_min_prompt}")
        if self.load_estimate not in LOAD_ESTIMATES:
            raise ValueError(f"load_estimate must be one of {LOAD_ESTIMATES}, got {self.load_estimate!r}")
        if self.request_overhead < 0:
            raise ValueError(f"request_overhead must be >= 0, got {self.request_overhead}")
        if self.load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")
        if self.queue_model not in QUEUE_MODELS:
            raise ValueError(f"queue_model must be one of {QUEUE_MODELS}, got {self.queue_model!r}")
        if not 0.0 < self.max_share <= 1.0:
            raise ValueError(f"max_share must be in (0, 1], got {self.max_share}")
        if self.share_min_seen < 1:
            raise ValueError(f"share_min_seen must be >= 1, got {self.share_min_seen}")
        if not 0.0 <= self.store_fetch_cost <= 1.0:
            raise ValueError(f"store_fetch_cost must be in [0, 1], got {self.store_fetch_cost}")
        if not 0.0 <= self.tier_fetch_cost <= 1.0:
            raise ValueError(f"tier_fetch_cost must be in [0, 1], got {self.tier_fetch_cost}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
