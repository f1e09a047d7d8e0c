"""EngineTiers: the request-level half of the tiered KV cache (the block-level half is kvserve.tiers).

At admission (scheduler, head of the queue), after the device match:

    [0, m)          matched on the device (radix or hash)
    [m, m + n)      found below it by `OffloadPolicy.lookup`, contiguous: host, disk, remote
    [m + n, ...)    computed

The lookup asks host and disk only (in-memory indexes); the remote store is asked by the load job
(`probe_remote`), so a slow or dead Redis never stalls the engine thread.

- all n on host and no remote tier to ask: loaded now, synchronously (a memcpy per block), published
  to the prefix cache; the admission continues with m + n matched blocks.
- any on disk, or a remote tier to ask for the blocks after them: the request leaves the queue for
  `WAITING_FOR_KV` holding its m matched blocks (so they cannot be evicted under the load) and fresh
  ones for the rest (n, or every usable block when the remote is asked), and a background job fetches
  the blocks while every other request keeps stepping. `poll` (each step) copies a landed job into its
  blocks, publishes them, releases the request's hold and puts it back at the head of the queue,
  where its device match now covers them. A probing job that answers within a moment (most find
  nothing: one round trip) is landed at once and the admission goes on in the same step
  (`_landed_quickly`). A job that fails part-way publishes what it loaded; one
  still running after `load_timeout_s` is abandoned (its result is never copied); either way the rest
  of the prompt is recomputed. A request gets one such load per admission.

Where each loaded block came from is kept on the request (`kv_sources`) so `cached_tokens` can be
split by source at admission. Evicted device blocks go down through `on_evict`; newly published blocks
go up to the remote store through `on_published` (both copy the bytes out before returning).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvserve.config import EngineConfig
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.request import Request, RequestStatus
from kvserve.model.config import ModelConfig
from kvserve.tiers.factory import TierSettings, engine_fingerprint, make_offload_policy
from kvserve.tiers.offload import LoadResult, OffloadPolicy

QUICK_LAND_S = 0.003  # seconds one schedule may wait for probing jobs to land (`_landed_quickly`)


@dataclass(slots=True)
class PendingLoad:
    request: Request
    future: Future[LoadResult]
    num_matched: int  # device blocks held at the head of the request's table
    deadline: float


class EngineTiers:
    def __init__(
        self, policy: OffloadPolicy, block_manager: BlockManager, pool_tensor: torch.Tensor, load_timeout_s: float
    ) -> None:
        self.policy = policy
        self.block_manager = block_manager
        self.pool_tensor = pool_tensor
        self.load_timeout_s = load_timeout_s
        self.loading: dict[str, PendingLoad] = {}
        self.num_failed_loads = 0
        self.num_timed_out_loads = 0
        self._quick_waited = 0.0
        self._demotion_paused = False
        block_manager.prefix_cache.on_evict = self.on_evict
        if policy.remote is not None:
            block_manager.on_published = self.on_published

    # --- hooks from the block manager ------------------------------------------------------------

    def on_evict(self, evicted: list[tuple[int, bytes]]) -> None:
        """Device blocks about to be freed: their KV goes to host (and on to disk)."""
        if evicted and not self._demotion_paused:
            self.policy.demote([h for _, h in evicted], self.pool_tensor, [b for b, _ in evicted])

    def on_published(self, block_hashes: list[bytes], block_ids: list[int]) -> None:
        """Full blocks just registered in the prefix cache: written through to the remote store."""
        self.policy.write_through(block_hashes, self.pool_tensor, block_ids)

    @contextmanager
    def demotion_paused(self) -> Iterator[None]:
        """Evictions inside the block go nowhere (`reset_prefix_cache` must not fill the host)."""
        self._demotion_paused = True
        try:
            yield
        finally:
            self._demotion_paused = False

    def reset_prefix_cache(self, local_tiers: bool) -> bool:
        """Drop the device's cached blocks without demoting them (a reset must not fill the host); with
        `local_tiers`, then empty host and disk too (the shared remote store stays). False, and nothing
        changed anywhere, while a block is in use."""
        with self.demotion_paused():
            if not self.block_manager.reset_prefix_cache():
                return False
        if local_tiers:
            self.policy.clear_local()
        return True

    # --- admission -------------------------------------------------------------------------------

    def extend_match(self, request: Request, matched: list[int]) -> list[int] | None:
        """The device match extended by host blocks, or None when the request went to WAITING_FOR_KV.
        `request.block_hashes` covers its usable blocks (`match_prefix` computed them)."""
        num_usable_blocks = request.num_reusable_blocks(self.block_manager.block_size)
        hashes = request.block_hashes[len(matched) : num_usable_blocks]
        if not hashes:
            return matched
        found = self.policy.lookup(hashes, local_only=True)  # host and disk: in-memory indexes
        may_load = not request.kv_load_tried  # one background load per admission; host copies are free
        if may_load and request.probe_remote and self.policy.remote_available() and found.num_blocks < len(hashes):
            if self._start_load(request, matched, hashes, found.sources, probe=True):
                return self.block_manager.match_prefix(request) if self._landed_quickly(request) else None
        if found.num_blocks == 0:
            return matched
        if all(source == "host" for source in found.sources):
            return self._load_from_host(request, matched, hashes[: found.num_blocks])
        if may_load and self._start_load(request, matched, hashes, found.sources, probe=False):
            return None
        return matched

    def _start_load(
        self, request: Request, matched: list[int], hashes: list[bytes], sources: list[str], probe: bool
    ) -> bool:
        """Send the request to WAITING_FOR_KV with a load job; False (nothing changed) when the pool
        cannot hold the blocks now. A probing job may find the remote has every usable block: it holds them all."""
        num_hold = len(hashes) if probe else len(sources)
        future = self.policy.load(hashes[:num_hold], sources, probe)  # first: it takes the host blocks
        if not self.block_manager.hold_for_load(request, matched, num_hold):
            future.cancel()
            return False
        request.kv_load_tried = True
        self.loading[request.request_id] = PendingLoad(
            request, future, len(matched), time.monotonic() + self.load_timeout_s
        )
        request.status = RequestStatus.WAITING_FOR_KV
        return True

    def _landed_quickly(self, request: Request) -> bool:
        """Wait a moment for a probing job that may find nothing: most probes are one round trip that
        answers "the store has none of these" (or a block or two), and without this wait the request
        would sit out the whole step for it. Over 2 one-thread workers sharing a local Redis
        (benchmarks/router.py --shared-store, kv_events, paired runs) chat TTFT p50 was 667-695 ms
        without the wait and 526-579 with it. The waits of one schedule share `QUICK_LAND_S`, so a slow
        store costs a step at most that much; a job still running goes on in the background as before."""
        pending = self.loading[request.request_id]
        left = QUICK_LAND_S - self._quick_waited
        if left <= 0:
            return False
        start = time.perf_counter()
        done, _ = wait([pending.future], timeout=left)
        self._quick_waited += time.perf_counter() - start
        if not done:
            return False
        del self.loading[request.request_id]
        self._land(pending)
        return True

    def _load_from_host(self, request: Request, matched: list[int], hashes: list[bytes]) -> list[int]:
        blocks = self.policy.load_host(hashes)
        if not blocks or not self.block_manager.hold_for_load(request, matched, len(blocks)):
            return matched
        self._publish(request, len(matched), blocks, ["host"] * len(blocks))
        return self.block_manager.match_prefix(request)

    def _publish(self, request: Request, num_matched: int, blocks: list[torch.Tensor], sources: list[str]) -> None:
        new_ids = request.block_table[num_matched : num_matched + len(blocks)]
        self.policy.codec.write_blocks(self.pool_tensor, new_ids, blocks)
        for offset, source in enumerate(sources):
            request.kv_sources[num_matched + offset] = source
        self.block_manager.publish_loaded(request, num_matched + len(blocks))

    # --- background loads ------------------------------------------------------------------------

    def poll(self) -> list[Request]:
        """Requests whose load finished, failed or timed out, in the order they were sent to load;
        each is back in WAITING holding no blocks."""
        self._quick_waited = 0.0  # a new schedule: `_landed_quickly` has its whole budget again
        landed: list[Request] = []
        now = time.monotonic()
        for request_id, pending in list(self.loading.items()):
            if not pending.future.done() and now < pending.deadline:
                continue
            del self.loading[request_id]
            self._land(pending)
            landed.append(pending.request)
        return landed

    def _land(self, pending: PendingLoad) -> None:
        request = pending.request
        result = None
        if pending.future.done():
            try:
                result = pending.future.result()
            except Exception:  # noqa: BLE001 - a failed load is a miss: recompute
                self.num_failed_loads += 1
        else:
            pending.future.cancel()
            self.num_timed_out_loads += 1
        if result is not None and result.blocks:
            self._publish(request, pending.num_matched, result.blocks, result.sources)
        else:
            self.block_manager.free(request)
        request.status = RequestStatus.WAITING

    def wait_any(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for a load to finish (when nothing else can run)."""
        if self.loading:
            wait([p.future for p in self.loading.values()], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def abort(self, request: Request) -> None:
        """Forget a loading request's job (its result is never copied); the caller frees its blocks."""
        pending = self.loading.pop(request.request_id, None)
        if pending is not None:
            pending.future.cancel()

    def holders(self) -> list[Request]:
        return [p.request for p in self.loading.values()]

    def stats(self) -> dict:
        stats = self.policy.stats()
        stats["policy"].update(
            loading=len(self.loading), failed_loads=self.num_failed_loads, timed_out_loads=self.num_timed_out_loads
        )
        return stats

    def close(self) -> None:
        for pending in self.loading.values():
            pending.future.cancel()
        self.policy.flush()
        self.policy.close()


def arithmetic_config(config: EngineConfig, model_config: ModelConfig, bf16_weights: bool = False) -> dict:
    """The model's config plus the flags that change the KV's floats (weights format, activation
    quantization, kernels, weights rounded to bf16 for storage, bf16 attention products, bf16 prefill matmuls):
    replicas that differ in them must not exchange blocks through a shared tier, or loading from the tier would
    change outputs (native and dense agree only up to summation order). Defaults add no field (fingerprints stay
    as they were)."""
    fields = asdict(model_config) | {
        "weights": config.weights, "activation_quant": config.activation_quant, "kernels": config.kernels,
    }
    if config.attention_dtype != "float32":  # later layers' keys depend on earlier layers' attention
        fields["attention_dtype"] = config.attention_dtype
    if config.prefill_dtype != "float32":  # a prompt's keys and values come out of its prefill's matmuls
        fields["prefill_dtype"] = config.prefill_dtype
    return fields | {"weight_storage": "bf16"} if bf16_weights else fields


def make_engine_tiers(
    config: EngineConfig, model_config: ModelConfig, tensor_shapes: dict[str, tuple[int, ...]],
    weights_path: Path, block_manager: BlockManager, pool_tensor: torch.Tensor, bf16_weights: bool = False,
) -> EngineTiers | None:
    """The tiers `config` asks for, or None (none asked, or the prefix cache is off: nothing to extend)."""
    settings = TierSettings(
        host_bytes=config.host_cache, disk_dir=config.disk_cache, disk_bytes=config.disk_cache_size,
        remote_url=config.remote_cache, remote_ttl_s=config.remote_cache_ttl,
    )
    if not settings.any or config.prefix_cache == "off":
        return None
    fingerprint = engine_fingerprint(
        model_config=arithmetic_config(config, model_config, bf16_weights), tensor_shapes=tensor_shapes,
        kv_dtype=pool_tensor.dtype, block_size=config.block_size,
        weights_path=weights_path if settings.persistent else None,
    )
    policy = make_offload_policy(settings, pool_tensor, fingerprint)
    return EngineTiers(policy, block_manager, pool_tensor, config.kv_load_timeout)
