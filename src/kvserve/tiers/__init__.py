"""Tiers below the device KV pool: host RAM, local disk, and a remote store shared by replicas.

`store.py` is the interface and the keys, `codec.py` the block payload format, `host.py`/`disk.py`/
`redis.py` the stores, `offload.py` the policy the engine calls (demote, write through, look up, load).
Tiers know keys and bytes, never requests.
"""
