"""OffloadPolicy: what the engine calls to move blocks between the device pool and the lower tiers.

    device pool ──evict──▶ host ──evict──▶ disk          (demotion, `demote`)
         │                                                (write-through, `write_through`)
         └──────────────── background writer ──▶ remote (Redis, shared by every replica)
    lookup: host → disk → remote, by the same keys, contiguous from the first block only
    load:   a background job per request; disk/remote hits are promoted into host

The engine speaks in chained block hashes and pool block ids; this object prefixes the model
fingerprint to make keys, encodes/decodes payloads with the pool's codec, and never sees requests.
Nothing here blocks the engine thread on disk or network except `lookup`, whose remote part is one
pipelined round trip bounded by the client timeout (zero wait while the breaker is open).
Payloads that fail to decode (foreign layout) are deleted from their tier and the load stops there:
the caller recomputes from that block on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvserve.openmp import serial_thread
from kvserve.tiers.codec import BlockCodec, BlockFormatError
from kvserve.tiers.disk import DiskStore
from kvserve.tiers.host import HostStore
from kvserve.tiers.store import BlockKey, BlockStore, ModelFingerprint
from kvserve.tiers.writer import BackgroundWriter

SOURCES = ("device", "host", "disk", "remote")


@dataclass(slots=True)
class LookupResult:
    """How many leading blocks (after the ones asked about start) the tiers hold, and where each is."""

    num_blocks: int
    sources: list[str]  # per block: "host" | "disk" | "remote"


@dataclass(slots=True)
class LoadResult:
    """Decoded blocks for the leading run that loaded; shorter than asked when a block failed."""

    blocks: list[torch.Tensor]
    sources: list[str]
    seconds: float


@dataclass(slots=True)
class _LoadCounters:
    blocks: int = 0
    bytes: int = 0
    jobs: int = 0
    seconds_sum: float = 0.0
    seconds_max: float = 0.0
    failed_blocks: int = 0


@dataclass(slots=True)
class _Counters:
    lock: threading.Lock = field(default_factory=threading.Lock)
    loads: dict[str, _LoadCounters] = field(default_factory=lambda: {s: _LoadCounters() for s in SOURCES[1:]})
    demoted_blocks: int = 0
    write_through_dropped: int = 0


class OffloadPolicy:
    """See the module docstring. Any of `host`, `disk`, `remote` may be None (tier off)."""

    def __init__(
        self,
        codec: BlockCodec,
        fingerprint: ModelFingerprint,
        host: HostStore | None = None,
        disk: DiskStore | None = None,
        remote: BlockStore | None = None,
        max_queued_blocks: int = 256,
        load_workers: int = 2,
    ) -> None:
        self.codec = codec
        self.fingerprint = fingerprint
        self.host, self.disk, self.remote = host, disk, remote
        self._disk_writer = BackgroundWriter(disk, max_queued_blocks) if disk is not None else None
        self._remote_writer = BackgroundWriter(remote, max_queued_blocks) if remote is not None else None
        if host is not None and disk is not None:  # else nothing takes the evicted bytes: no copies
            host.on_evict = self._host_evicted
        # Loads promote blocks into host RAM (large tensor copies): on these threads, without OpenMP (openmp.py).
        self._loader = ThreadPoolExecutor(max_workers=load_workers, thread_name_prefix="kv-load",
                                          initializer=serial_thread)
        self._counters = _Counters()

    @property
    def tiers(self) -> list[BlockStore]:
        return [t for t in (self.host, self.disk, self.remote) if t is not None]

    # --- engine → tiers -------------------------------------------------------------------------

    def demote(self, block_hashes: Sequence[bytes], pool_tensor: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Blocks the device is evicting: into host (whose evictions go on to disk), else into disk."""
        keys = self.fingerprint.keys(block_hashes)
        if self.host is not None:
            fresh = [(k, b) for k, b in zip(keys, block_ids, strict=True) if not self.host.longest_prefix([k])]
            if fresh:
                self.host.put_blocks([k for k, _ in fresh], pool_tensor, [b for _, b in fresh], self.codec)
        elif self._disk_writer is not None and self._disk_writer.has_room(len(keys)):
            self._disk_writer.offer(list(zip(keys, self.codec.encode_blocks(pool_tensor, block_ids), strict=True)))
        with self._counters.lock:
            self._counters.demoted_blocks += len(keys)

    def write_through(self, block_hashes: Sequence[bytes], pool_tensor: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Full blocks just computed: copy to the remote store in the background; dropped when busy."""
        if self._remote_writer is None or not block_hashes:
            return
        if not self._remote_writer.has_room(len(block_hashes)):
            with self._counters.lock:
                self._counters.write_through_dropped += len(block_hashes)
            return
        keys = self.fingerprint.keys(block_hashes)
        payloads = self.codec.encode_blocks(pool_tensor, block_ids)
        dropped = self._remote_writer.offer(list(zip(keys, payloads, strict=True)))
        with self._counters.lock:
            self._counters.write_through_dropped += dropped

    # --- tiers → engine -------------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[bytes], local_only: bool = False) -> LookupResult:
        """The longest run of leading `block_hashes` held by the tiers, each block from the highest
        tier that has it (one batched `longest_prefix` per tier per round). `local_only` asks host and
        disk only (in-memory indexes: no I/O), leaving the remote store to a `load(probe_remote=True)`."""
        keys = self.fingerprint.keys(block_hashes)
        tiers = [t for t in (self.host, self.disk) if t is not None] if local_only else self.tiers
        sources: list[str] = []
        progress = True
        while progress and len(sources) < len(keys):
            progress = False
            for tier in tiers:
                found = tier.longest_prefix(keys[len(sources) :])
                sources += [tier.name] * found
                progress |= found > 0
        return LookupResult(len(sources), sources)

    def remote_available(self) -> bool:
        """A remote tier is configured and its breaker would let a call through now."""
        breaker = getattr(self.remote, "breaker", None)
        return self.remote is not None and (breaker is None or not breaker.is_open())

    def load_host(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor]:
        """Synchronous load of leading blocks from host memory (a memcpy); stops at the first miss."""
        if self.host is None:
            return []
        start = time.perf_counter()
        blocks: list[torch.Tensor] = []
        for block in self.host.get_blocks(self.fingerprint.keys(block_hashes), self.codec):
            if block is None:
                break
            blocks.append(block)
        self._count_load("host", len(blocks), time.perf_counter() - start, failed=len(block_hashes) - len(blocks))
        return blocks

    def load(
        self, block_hashes: Sequence[bytes], sources: Sequence[str], probe_remote: bool = False
    ) -> Future[LoadResult]:
        """Fetch and decode blocks in the background (see `lookup` for `sources`, which may cover only
        the leading blocks). With `probe_remote`, once those have loaded the job asks the remote store
        for the blocks after them (one round trip) and loads what it has: the engine thread never waits
        on the network.

        Host blocks are taken now, in the caller's thread (references to their buffers, no copy): the
        caller is about to make room on the device, and the demotions that causes could otherwise push
        exactly these blocks out of the host before the job reads them."""
        host_blocks: dict[int, torch.Tensor] = {}
        host_index = [i for i, source in enumerate(sources) if source == "host"]
        if self.host is not None and host_index:
            taken = self.host.get_blocks(self.fingerprint.keys([block_hashes[i] for i in host_index]), self.codec)
            host_blocks = {i: block for i, block in zip(host_index, taken, strict=True) if block is not None}
        return self._loader.submit(self._load, list(block_hashes), list(sources), host_blocks, probe_remote)

    def _load(
        self, block_hashes: list[bytes], sources: list[str], host_blocks: dict[int, torch.Tensor], probe_remote: bool
    ) -> LoadResult:
        start = time.perf_counter()
        keys = self.fingerprint.keys(block_hashes)
        if probe_remote and self.remote is not None:
            rest = keys[len(sources) :]
            sources = sources + ["remote"] * self.remote.longest_prefix(rest)
        keys = keys[: len(sources)]
        blocks: list[torch.Tensor] = []
        loaded_sources: list[str] = []
        promote: list[tuple[BlockKey, bytes]] = []
        position = 0
        while position < len(keys):
            source = sources[position]
            end = position
            while end < len(keys) and sources[end] == source:
                end += 1
            if source == "host":
                run = _leading_present([host_blocks.get(i) for i in range(position, end)])
                self._count_load("host", len(run), 0.0, failed=end - position - len(run))
            else:
                run = self._load_run(source, keys[position:end], promote)
            blocks += run
            loaded_sources += [source] * len(run)
            if len(run) < end - position:
                break
            position = end
        if promote and self.host is not None:
            self.host.put(promote)  # after the whole load: promoting earlier could evict what it reads next
        return LoadResult(blocks, loaded_sources, time.perf_counter() - start)

    def _load_run(
        self, source: str, keys: list[BlockKey], promote: list[tuple[BlockKey, bytes]]
    ) -> list[torch.Tensor]:
        store = {"host": self.host, "disk": self.disk, "remote": self.remote}[source]
        if store is None:
            return []
        start = time.perf_counter()
        blocks: list[torch.Tensor] = []
        payloads = store.get(keys)
        good: list[tuple[BlockKey, bytes]] = []
        for key, payload in zip(keys, payloads, strict=True):
            if payload is None:
                break
            try:
                blocks.append(self.codec.decode(payload))
            except BlockFormatError:
                store.delete([key])
                break
            good.append((key, payload))
        if source != "host":
            promote += good  # the next device miss finds these in RAM
        nbytes = sum(len(p) for _, p in good)
        self._count_load(source, len(blocks), time.perf_counter() - start, len(keys) - len(blocks), nbytes)
        return blocks

    # --- housekeeping ---------------------------------------------------------------------------

    def _host_evicted(self, items: list[tuple[BlockKey, bytes]]) -> None:
        """Host evictions go on to disk (installed only when there is one)."""
        assert self._disk_writer is not None and self.disk is not None
        self._disk_writer.offer([(k, p) for k, p in items if not self.disk.longest_prefix([k])])

    def clear_local(self) -> int:
        """Delete this model's blocks from host and disk (`reset_prefix_cache(tiers=True)`); returns how
        many. Other fingerprints' files in a shared disk directory stay: they are other models' caches.
        The remote store is shared by every replica and is never cleared from one of them."""
        if self._disk_writer is not None:
            self._disk_writer.flush()  # host evictions still queued for disk would land after the clear
        digest, count = self.fingerprint.digest, 0
        for store in (s for s in (self.host, self.disk) if s is not None):
            keys = [key for key in store.keys_lru_first() if key.startswith(digest)]
            store.delete(keys)
            count += len(keys)
        return count

    def local_capacity_blocks(self) -> int:
        """How many blocks host and disk can hold together (a router weighs a worker's lower tiers by it)."""
        local = [t for t in (self.host, self.disk) if t is not None]
        return sum(t.capacity_bytes // self.codec.payload_bytes for t in local)

    def _count_load(self, source: str, num_blocks: int, seconds: float, failed: int = 0, nbytes: int = 0) -> None:
        with self._counters.lock:
            counters = self._counters.loads[source]
            counters.jobs += 1
            counters.blocks += num_blocks
            counters.bytes += nbytes or num_blocks * self.codec.payload_bytes
            counters.failed_blocks += failed
            counters.seconds_sum += seconds
            counters.seconds_max = max(counters.seconds_max, seconds)

    def flush(self) -> None:
        """Wait for queued disk and remote writes (tests, benchmarks, shutdown)."""
        for writer in (self._disk_writer, self._remote_writer):
            if writer is not None:
                writer.flush()

    def stats(self) -> dict[str, dict]:
        """Per tier: the store's counters, the loads served from it, its writer queue."""
        result: dict[str, dict] = {}
        writers = {"disk": self._disk_writer, "remote": self._remote_writer}
        for tier in self.tiers:
            entry = tier.stats().as_dict()
            with self._counters.lock:
                loads = self._counters.loads[tier.name]
                entry["load"] = {
                    "blocks": loads.blocks, "bytes": loads.bytes, "jobs": loads.jobs,
                    "failed_blocks": loads.failed_blocks, "seconds_sum": loads.seconds_sum,
                    "seconds_max": loads.seconds_max,
                }
            if writers.get(tier.name) is not None:
                entry["writer"] = writers[tier.name].stats()
            result[tier.name] = entry
        with self._counters.lock:
            result["policy"] = {
                "demoted_blocks": self._counters.demoted_blocks,
                "write_through_dropped": self._counters.write_through_dropped,
            }
        return result

    def check_invariants(self) -> None:
        for tier in self.tiers:
            tier.check_invariants()

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        for writer in (self._disk_writer, self._remote_writer):
            if writer is not None:
                writer.close()
        for tier in self.tiers:
            tier.close()


def _leading_present(blocks: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The blocks before the first missing one."""
    present: list[torch.Tensor] = []
    for block in blocks:
        if block is None:
            break
        present.append(block)
    return present
