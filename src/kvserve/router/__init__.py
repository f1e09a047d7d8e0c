"""A router in front of N `kvserve serve` workers: OpenAI pass-through, cache-aware placement.

`router → (HTTP) → server`: the router knows HTTP, the tokenizer and the KV-event format, never engine
internals. See `app.py` (the proxy), `workers.py` (health, load, retries) and `policies/`.
"""
