"""vLLM's KV-event wire format, written with plain msgpack.

vLLM encodes `KVEventBatch(ts, events, data_parallel_rank)` with msgspec: structs as msgpack maps,
each event tagged `"type": "<class name>"`, fields with defaults left out when at their default:

    {"ts": 1733.5, "events": [
        {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": h0 | None,
         "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [h3], "medium": "GPU"},
        {"type": "AllBlocksCleared"}],
     "data_parallel_rank": 0}

Block hashes are our chained hashes (`prefix/hashing.py`), as bytes. Namespace-free as vLLM's: the
namespace is folded into the first block's hash, so a consumer that recomputes hashes must know it.
The decoder also accepts the older array form (`array_like` structs: positional fields, tag first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

MEDIUM_GPU = "GPU"  # vLLM's name for the device tier, whatever the device
MEDIUM_CPU = "CPU"  # the host RAM tier (vLLM's CPU offloading names it so)
MEDIUM_DISK = "DISK"  # the local-disk tier


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_EVENT_TYPES: dict[str, type] = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


def _event_map(event: KVEvent) -> dict[str, Any]:
    body: dict[str, Any] = {"type": type(event).__name__}
    for name in event.__slots__:
        body[name] = getattr(event, name)
    return body


def encode_batch(batch: KVEventBatch) -> bytes:
    document: dict[str, Any] = {"ts": batch.ts, "events": [_event_map(event) for event in batch.events]}
    if batch.data_parallel_rank is not None:
        document["data_parallel_rank"] = batch.data_parallel_rank
    return msgpack.packb(document, use_bin_type=True)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Parse one batch; ValueError naming what is wrong with it."""
    try:
        document = msgpack.unpackb(payload, raw=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as err:
        raise ValueError(f"KV event batch is not valid msgpack: {err}") from err
    if isinstance(document, list) and len(document) >= 2:  # array_like form
        document = {"ts": document[0], "events": document[1],
                    "data_parallel_rank": document[2] if len(document) > 2 else None}
    if not isinstance(document, dict) or not isinstance(document.get("events"), list):
        raise ValueError("KV event batch must be a map with an 'events' list")
    events = [_decode_event(raw) for raw in document["events"]]
    return KVEventBatch(ts=float(document.get("ts", 0.0)), events=events,
                        data_parallel_rank=document.get("data_parallel_rank"))


def _decode_event(raw: Any) -> KVEvent:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        cls = _EVENT_TYPES.get(raw[0])
        if cls is None:
            raise ValueError(f"unknown KV event type {raw[0]!r}")
        names = cls.__slots__
        return cls(**dict(zip(names, raw[1 : 1 + len(names)], strict=False)))
    if not isinstance(raw, dict) or raw.get("type") not in _EVENT_TYPES:
        raise ValueError(f"unknown KV event {raw!r:.80}")
    cls = _EVENT_TYPES[raw["type"]]
    known = {name: raw[name] for name in cls.__slots__ if name in raw}  # newer vLLM fields are ignored
    try:
        return cls(**known)
    except TypeError as err:
        raise ValueError(f"malformed {raw['type']} event: {err}") from err
