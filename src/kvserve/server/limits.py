"""Front-door limits: what one connection or one request may cost the server before the engine sees it.

The defaults are generous for real clients and small for abusive ones:

- a client has `header_timeout_s` to send a request's headers (after connecting, or after its
  previous response) and `body_timeout_s` to send the whole body; then it gets 408 and is closed;
- at most `max_connections` connections are open at once; one more is answered 503 and closed;
- a prompt longer than `max_model_len × MAX_BYTES_PER_TOKEN` UTF-8 bytes is refused before it is
  tokenized (no tokenizer makes tokens that long on average: 64 bytes is a run of 64 spaces per token),
  and tokenization and chat templating run on a small worker pool, never on the event loop;
- `max_queue` counts requests that cannot start now: those beyond the free `max_num_seqs` slots.

This module imports nothing heavy, so the CLI can add the flags without loading the server.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

MAX_BYTES_PER_TOKEN = 64
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
# Longer than the 5 s after which httpx (and so the OpenAI SDK) drops an idle pooled connection: with
# equal timeouts a request sent as the server closes the idle socket fails with a read error (benchmarks/
# results/soak.md: 2 of 504 such requests at 5 s, none at 10 s). Below the header timeout, so an idle
# connection is closed quietly before it would be answered 408.
DEFAULT_KEEP_ALIVE_S = 8.0
DEFAULT_INPUT_WORKERS = 2


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Limits of the HTTP front door (see the module docstring); `max_num_seqs` None: no free slots
    are assumed, so every waiting request counts against `max_queue`."""

    max_num_seqs: int | None = None
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    input_workers: int = DEFAULT_INPUT_WORKERS
    docs: bool = True  # /docs and /openapi.json (behind the API keys when keys are set)

    def __post_init__(self) -> None:
        for name in ("max_connections", "input_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def max_prompt_bytes(max_prompt_tokens: int) -> int:
    """The longest prompt (UTF-8 bytes) worth tokenizing when at most `max_prompt_tokens` fit."""
    return max_prompt_tokens * MAX_BYTES_PER_TOKEN


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """The front-door flags of `kvserve serve` and `python -m kvserve.server`."""
    group = parser.add_argument_group("front door")
    group.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       help="open connections beyond this are answered 503 and closed")
    group.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                       help="seconds a client has to send a request's headers")
    group.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                       help="seconds a client has to send a request's body (then 408)")
    group.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_S,
                       help="seconds an idle keep-alive connection stays open")
    group.add_argument("--disable-docs", action="store_true", help="serve no /docs or /openapi.json")


def limits_from_args(args: argparse.Namespace, max_num_seqs: int | None) -> ServerLimits:
    return ServerLimits(
        max_num_seqs=max_num_seqs, max_connections=args.max_connections, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout, keep_alive_s=args.keep_alive_timeout, docs=not args.disable_docs,
    )
