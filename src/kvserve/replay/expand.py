"""Turn a trace request's block ids into the token ids and block hashes a cache sees.

Trace token `p` of the trace block with interned id `h` (block size T) is named `h * T + p`; a replay
block (B tokens) is named by its *last* trace token, whose trace block is unique to its prefix, so the
name identifies the block's whole prefix as a chained hash does. The block's token ids are that name
followed by B - 1 zeros: equal names give equal blocks, distinct names distinct ones, and the caches
compare tokens exactly as they would for text (the zeros keep a 60M-token trace cheap to build). The
block hash is the name as 8 bytes: the caches use hashes only as an index, so replay hits are the hits
real hashes would give; `trace_id_of` maps a hash back to its trace block (the Belady oracle's key).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.replay.trace import TraceRequest


@dataclass(slots=True)
class ExpandedPrompt:
    tokens: tuple[int, ...]  # the whole prompt
    hashes: list[bytes]  # one per full block of `block_size` tokens


def block_names(request: TraceRequest, block_size: int) -> list[int]:
    """The name of every full `block_size`-token block of the prompt (see the module docstring)."""
    size, ids = request.block_size, request.hash_ids
    num_full = request.input_length // block_size
    if size % block_size == 0:  # fast path: each replay block lies inside one trace block
        names: list[int] = []
        for block_id in ids:
            names.extend(range(block_id * size + block_size - 1, (block_id + 1) * size, block_size))
        return names[:num_full]
    last = [(i + 1) * block_size - 1 for i in range(num_full)]
    return [ids[q // size] * size + q % size for q in last]


def expand(request: TraceRequest, block_size: int) -> ExpandedPrompt:
    """The request's prompt at `block_size`-token blocks."""
    names = block_names(request, block_size)
    tokens = [0] * request.input_length
    partial = -(-request.input_length // block_size) - len(names)
    tokens[::block_size] = names + [-1] * partial  # the partial tail block is never cached
    return ExpandedPrompt(tuple(tokens), [name.to_bytes(8, "little") for name in names])


def trace_id_of(block_hash: bytes, trace_block_size: int) -> int:
    """The trace block id a replay block hash (see `expand`) belongs to."""
    return int.from_bytes(block_hash, "little") // trace_block_size
