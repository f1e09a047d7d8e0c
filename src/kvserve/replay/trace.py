"""Trace records and their readers: Mooncake's format, which kvserve's request log also writes.

One JSON object a line (benchmarks/data/TRACES.md): `timestamp` (ms from the start), `input_length`,
`output_length` (tokens) and `hash_ids`, the prompt as a chain of block ids, one per `block_size`
tokens (the last may be partial); equal leading ids mean an equal prefix. Mooncake's ids are ints over
512-token blocks; a kvserve request log adds `block_size` and `namespace` (an opaque digest) and writes
its ids as hex block hashes. Ids are interned as ints here, in order of first appearance.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK_SIZE = 512


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request of a trace; `hash_ids` are interned ints, unique to their prefix."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_size: int  # tokens per hash id


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """All requests of a trace file (or the first `limit`), in arrival order."""
    with open(path, encoding="utf-8") as handle:
        return parse_trace(handle, limit, str(path))


def parse_trace(lines: Iterable[str], limit: int | None = None, source: str = "trace") -> list[TraceRequest]:
    """Parse JSON lines; ValueError naming the line for a malformed record."""
    interned: dict[object, int] = {}
    requests: list[TraceRequest] = []
    for number, line in enumerate(lines, 1):
        if limit is not None and len(requests) >= limit:
            break
        if not line.strip():
            continue
        try:
            requests.append(_parse_record(json.loads(line), interned))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{source}:{number}: bad trace record: {error}") from None
    requests.sort(key=lambda request: request.timestamp_ms)  # stable: ties keep file order
    return requests


def _parse_record(record: dict, interned: dict[object, int]) -> TraceRequest:
    block_size = int(record.get("block_size", MOONCAKE_BLOCK_SIZE))
    input_length, output_length = int(record["input_length"]), int(record["output_length"])
    namespace = record.get("namespace", "")
    ids = tuple(interned.setdefault((namespace, raw), len(interned)) for raw in record["hash_ids"])
    if block_size < 1 or input_length < 1 or output_length < 0:
        raise ValueError("block_size and input_length must be >= 1, output_length >= 0")
    if len(ids) != -(-input_length // block_size):
        raise ValueError(f"{len(ids)} hash_ids for {input_length} tokens in blocks of {block_size}")
    return TraceRequest(float(record["timestamp"]), input_length, output_length, ids, block_size)
