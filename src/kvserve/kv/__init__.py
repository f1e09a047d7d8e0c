"""Where KV bytes live: the paged pool, the block allocator and paged attention."""
