"""Which KV blocks can be reused: RadixAttention tree and chained block hashes."""
