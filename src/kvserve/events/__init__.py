"""KV events: what a worker's prefix cache really holds, published in vLLM's format (msgpack over
ZMQ PUB with sequence numbers) so a router -- ours or any consumer of vLLM's events -- can keep an
exact index of which worker caches which block."""

from kvserve.events.format import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch", "decode_batch", "encode_batch"]
