"""`kvserve serve --role prefill|decode|mixed`: what a worker does in disaggregated serving.

- `mixed` (the default): today's worker, prefill and decode together.
- `prefill`: a router (`--policy pd`) sends it each long request with `max_tokens=1`. Its engine
  writes every full prompt block through to the shared store (the remote tier) as it fills; before the
  answer leaves, the worker waits until the store holds all of that request's full blocks — it asks
  the store itself (`longest_prefix` of the request's block keys, one pipelined EXISTS per poll), so the
  answer is exact whatever else the write-through queue carried, dropped or failed — bounded by
  `--prefill-flush-timeout`, and cut short once no write is in flight (a dropped block never comes).
  The answer says how that went in `x-kvserve-kv-flush` (`ok` / `failed` / `off`), with the blocks'
  bytes and the wait; the router hands off only on `ok`.
- `decode`: an ordinary worker whose admission finds the prompt in the store (`cached_tokens` by
  source: remote) and computes only the rest. The role is a label for the router: any worker serves
  any request, which is what makes every fallback to mixed serving safe.

A prefill or decode worker needs a remote tier (`--remote-cache`): without the shared store there is
nothing to hand off through, and the server refuses to start. `/load` reports the role and the store's
state (`remote_tier`: ok / open / None) so the router can fall back while the breaker is open.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("kvserve.server")
ROLES = ("mixed", "prefill", "decode")
FLUSH_TIMEOUT_S = 2.0
FLUSH_HEADER = "x-kvserve-kv-flush"
FLUSH_BYTES_HEADER = "x-kvserve-kv-flush-bytes"
FLUSH_MS_HEADER = "x-kvserve-kv-flush-ms"
# From a store-aware router: "0" when it knows the shared store holds nothing of the prompt beyond what this
# worker holds, so admission skips asking the store (`engine/kv_tiers.py`); "1" (or absent): ask as usual.
STORE_PROBE_HEADER = "x-kvserve-store-probe"
BACKGROUND_HEADER = "x-kvserve-background"  # a router's idle or warm copy (engine/background.py)
_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.02


def add_role_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("disaggregated serving")
    group.add_argument("--role", default="mixed", choices=ROLES,
                       help="prefill: compute prompts and hand their KV to the shared store; decode: generate "
                       "from prompts found there; mixed: both (a router's --policy pd splits on this)")
    group.add_argument("--prefill-flush-timeout", type=float, default=FLUSH_TIMEOUT_S,
                       help="seconds a prefill worker waits for a prompt's blocks to reach the store")


@dataclass(frozen=True, slots=True)
class FlushReport:
    status: str  # ok | failed | off
    num_blocks: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    detail: str = ""

    def headers(self) -> dict[str, str]:
        return {FLUSH_HEADER: self.status, FLUSH_BYTES_HEADER: str(self.nbytes),
                FLUSH_MS_HEADER: f"{self.seconds * 1000:.3f}"}


def store_probe_wanted(headers: Mapping[str, str]) -> bool:
    """Whether admission should ask the shared store for the prompt's blocks (`STORE_PROBE_HEADER`). Only
    the caller's own request is affected: skipping can cost it a load, never another tenant anything."""
    return headers.get(STORE_PROBE_HEADER, "1").strip() != "0"


def background_wanted(headers: Mapping[str, str]) -> bool:
    """Whether the request runs in the background (`BACKGROUND_HEADER`: only while nobody else waits or runs,
    `engine/background.py`). A caller setting it only slows itself; the router drops it from its clients'."""
    return headers.get(BACKGROUND_HEADER, "0").strip() == "1"


@dataclass(slots=True)
class RoleInfo:
    """This worker's role; `offload` is its engine's `OffloadPolicy` (kvserve.tiers) when it has a remote tier."""

    role: str = "mixed"
    flush_timeout_s: float = FLUSH_TIMEOUT_S
    offload: Any = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.flush_timeout_s <= 0:
            raise ValueError(f"prefill_flush_timeout must be > 0, got {self.flush_timeout_s}")
        if self.role != "mixed" and self.offload is None:
            raise ValueError(f"--role {self.role} needs the shared KV store: start the worker with --remote-cache "
                             "redis://HOST:PORT (prefill and decode workers hand prompts over through it)")

    @property
    def is_prefill(self) -> bool:
        return self.role == "prefill"

    def remote_tier(self) -> str | None:
        """For `/load`: "ok", "open" (the breaker is open: the store is unreachable) or None (no store)."""
        if self.offload is None:
            return None
        return "ok" if self.offload.remote_available() else "open"

    def remote_store(self) -> str | None:
        """For `/load`: which store this worker shares, as a digest of the store's URL and the model's key
        fingerprint (None: no store). Workers naming the same one can load each other's blocks; the
        router's kv_events policy prices such a load below a prefill (router/policies/store.py)."""
        if self.offload is None or self.offload.remote is None:
            return None
        identity = f"{self.offload.remote.url}#{self.offload.fingerprint.hex()}"
        return hashlib.sha256(identity.encode()).hexdigest()[:16]

    def flush(self, prompts: Sequence[Sequence[int]], block_size: int, namespace: tuple[str, ...],
              prefix_hash: str) -> FlushReport:
        """Wait until the store holds every full block of `prompts` (blocking: run it off the event loop)."""
        from kvserve.prefix.hashing import block_hashes

        if self.offload is None:
            return FlushReport("off")
        start = time.perf_counter()
        chains = [self.offload.fingerprint.keys(block_hashes(prompt, block_size, namespace, prefix_hash))
                  for prompt in prompts]
        num_blocks = sum(len(chain) for chain in chains)
        nbytes = num_blocks * self.offload.codec.payload_bytes
        deadline, pause = start + self.flush_timeout_s, _POLL_FIRST_S
        while True:
            if not self.offload.remote_available():
                return FlushReport("failed", num_blocks, nbytes, time.perf_counter() - start, "store unreachable")
            idle = _writes_idle(self.offload)  # read before asking: a write that lands after is still seen
            if all(self.offload.remote.longest_prefix(chain) == len(chain) for chain in chains if chain):
                return FlushReport("ok", num_blocks, nbytes, time.perf_counter() - start)
            if idle:
                return FlushReport("failed", num_blocks, nbytes, time.perf_counter() - start,
                                   "blocks missing with no write in flight (dropped: queue full or store error)")
            if time.perf_counter() + pause > deadline:
                return FlushReport("failed", num_blocks, nbytes, time.perf_counter() - start,
                                   f"not in the store after {self.flush_timeout_s} s")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)


def _writes_idle(offload: Any) -> bool:
    """Nothing queued for the store is still on its way: every block offered so far was written, failed
    or dropped. A request's blocks are offered before its answer exists, so once this holds, blocks
    still missing will not come (no need to wait out the timeout)."""
    writer = offload.stats().get("remote", {}).get("writer")
    if writer is None:
        return False
    return writer["queued"] <= writer["written"] + writer["failed"]


def remote_offload(llm_engine: object) -> Any:
    """The engine's offload policy if it has a remote tier, else None (no tiers, or no --remote-cache)."""
    tiers = getattr(llm_engine, "tiers", None)
    policy = getattr(tiers, "policy", None)
    return policy if getattr(policy, "remote", None) is not None else None


async def handoff_headers(replica: Any, block_size: int, prompts: Sequence[Sequence[int]],
                          namespace: tuple[str, ...]) -> dict[str, str]:
    """A prefill worker's answer headers: wait (off the event loop) for the prompts' blocks to reach the
    store and report it. Other roles: none."""
    role: RoleInfo = replica.role
    if not role.is_prefill:
        return {}
    report = await asyncio.to_thread(role.flush, prompts, block_size, namespace, replica.prefix_hash)
    if report.status != "ok":
        logger.warning("prefill: %d blocks not handed off to the store: %s", report.num_blocks, report.detail)
    return report.headers()
