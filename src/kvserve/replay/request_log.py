"""`kvserve serve --request-log FILE`: one Mooncake-format line per finished request, for `kvserve replay`.

Each line: `timestamp` (ms since the log was opened, at the request's arrival), `input_length`,
`output_length` (tokens generated), `hash_ids` (the prompt's chained block hashes in hex, one per
`block_size` tokens; the last, partial block is hashed the same way over its tokens), `block_size`, and
`namespace` (a digest of the tenant / cache_salt fields). No token ids and no text are written: an
operator can replay their traffic against other cache sizes and policies without keeping prompts.
The hashes are those the prefix cache uses (`--prefix-hash`), so equal prefixes give equal leading ids.
Requests of a parallel-sampling or beam group are not logged (one prompt, several sequences).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from kvserve.prefix.hashing import extend_block_hashes, hash_block

if TYPE_CHECKING:
    from kvserve.engine.request import Request


def namespace_digest(namespace: tuple[str, ...]) -> str:
    """An opaque, stable name for a namespace (its fields length-prefixed, then SHA-256)."""
    encoded = b"".join(len(f.encode()).to_bytes(4, "little") + f.encode() for f in namespace)
    return hashlib.sha256(b"kvserve-namespace\x00" + encoded).hexdigest()[:16]


def prompt_hash_ids(prompt: list[int], block_size: int, namespace: tuple[str, ...], algo: str,
                    known: list[bytes] | None = None) -> list[str]:
    """Hex hash of every prompt block, the partial last one included; reuses `known` leading hashes."""
    num_full = len(prompt) // block_size
    hashes = list((known or [])[:num_full])
    extend_block_hashes(hashes, prompt[: num_full * block_size], block_size, namespace, algo)
    tail = prompt[num_full * block_size :]
    if tail:
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, tail, () if hashes else tuple(namespace), algo))
    return [h.hex() for h in hashes]


class RequestLog:
    """Appends finished requests to a JSONL file; call it with each finished `Request` (thread-safe)."""

    def __init__(self, path: str | Path, block_size: int, hash_algo: str = "sha256") -> None:
        self.block_size, self.hash_algo = block_size, hash_algo
        self._file: TextIO = open(path, "a", encoding="utf-8")  # closed by close()
        self._start = time.monotonic()
        self._lock = threading.Lock()

    def record(self, request: Request) -> dict[str, object]:
        """The log line for `request` (what `__call__` writes)."""
        prompt = request.prompt_token_ids
        return {
            "timestamp": round((request.metrics.arrival_time - self._start) * 1000),
            "input_length": len(prompt),
            "output_length": len(request.output_token_ids),
            "hash_ids": prompt_hash_ids(prompt, self.block_size, request.namespace, self.hash_algo,
                                        request.block_hashes),
            "block_size": self.block_size,
            "namespace": namespace_digest(request.namespace),
        }

    def __call__(self, request: Request) -> None:
        if request.group_id != request.request_id or not request.prompt_token_ids:  # a fork: its root logs
            return
        line = json.dumps(self.record(request))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
